"""The build cache: one build per (model files, build flags, project version), made once and reused at once.

Layout, under ``$SSD_TRT_CACHE`` (default ``~/.cache/ssd-trt``)::

    builds/file-hashes.json           sha256 of each model file by (path, size, mtime, inode): a memo, never a truth
    builds/NAME-KEY.lock              held (flock) by the process building that entry
    builds/NAME-KEY/recipe.yaml       the recipe it was built from
    builds/NAME-KEY/NAME/             the build directory (manifest.json last), renamed into place when complete
    builds/NAME-KEY/.partial-PID/     a build in progress, removed when it ends either way

KEY is a sha256 over the files' sha256 (the manifest's own ``source_sha256``), the flags that change the build, the
recipe's name and the versions (project, manifest schema, ``recipe.RECIPE_VERSION``). A changed file is another key:
it is built anew. The build directory appears whole or not at all (``os.rename`` within one folder), so a reader that
finds ``NAME/manifest.json`` may serve it without a lock. Two starts at once: the second waits on the lock, then
finds the build complete. A failed build (a full disk, Ctrl-C, a bad file) leaves nothing behind but the lock file.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from ssd_trt.errors import SsdTrtError
from ssd_trt.manifest import MANIFEST_NAME
from ssd_trt.models.sources import MODEL_FILE_SUFFIXES, ResolvedSource, source_fingerprint

CACHE_ENV = "SSD_TRT_CACHE"
CHUNK = 4 << 20
HASH_BAR_BYTES = 64 << 20         # a progress bar for hashing only where it takes a noticeable while
# Measured on the real pair (1.61 GB of Q4_K_M files, 2 CPU cores; docs/usage.md, "Serving from model files"): the
# build took 186 s and wrote 5.03 GB (the ONNX Runtime graph's weights and the CPU kernel's tiles of both models).
BUILD_SECONDS_BASE = 15.0
BUILD_SECONDS_PER_GIB = 115.0
BUILD_BYTES_PER_MODEL_BYTE = 3.2

Log = Callable[[str], None]


def cache_root() -> Path:
    """``$SSD_TRT_CACHE``, else ``~/.cache/ssd-trt``."""
    return Path(os.environ[CACHE_ENV]).expanduser() if os.environ.get(CACHE_ENV) else Path.home() / ".cache" / "ssd-trt"


class FileHashes:
    """sha256 of model files, hashed once: a memo by (path, size, mtime_ns, inode) in the cache, so that a later start
    with the same files reads no weights. A file rewritten in place changes its mtime (and mostly its size), so it is
    hashed again; the memo is written best-effort (a full disk only costs a rehash next time)."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / "file-hashes.json"
        try:
            self.memo: dict[str, dict[str, Any]] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.memo = {}

    def sha256(self, path: Path) -> str:
        stat = path.stat()
        stamp = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino}
        known = self.memo.get(str(path))
        if known and all(known.get(k) == v for k, v in stamp.items()):
            return known["sha256"]
        digest = _sha256(path, stat.st_size)
        self.memo[str(path)] = {**stamp, "sha256": digest}
        self._save()
        return digest

    def _save(self) -> None:
        partial = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps(self.memo, indent=1))
            os.replace(partial, self.path)
        except OSError:
            partial.unlink(missing_ok=True)


def _sha256(path: Path, size: int) -> str:
    from tqdm import tqdm
    digest = hashlib.sha256()
    with open(path, "rb") as handle, tqdm(total=size, unit="B", unit_scale=True, desc=f"sha256 {path.name}",
                                          file=sys.stderr, disable=size < HASH_BAR_BYTES, leave=False) as bar:
        while block := handle.read(CHUNK):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def model_files(source: ResolvedSource) -> list[Path]:
    """The files a build reads from ``source`` (as ``models/sources.source_file_hashes`` hashes them)."""
    if source.kind == "gguf":
        return [source.path]
    return sorted(p for p in source.path.iterdir() if p.is_file() and p.suffix in MODEL_FILE_SUFFIXES)


def fingerprint(source: ResolvedSource, hashes: FileHashes) -> str:
    """The source's sha256 as a build's manifest records it (``source_sha256``), from the memo where it can."""
    return source_fingerprint(source, {path.name: hashes.sha256(path) for path in model_files(source)})


def model_bytes(sources: list[ResolvedSource]) -> int:
    return sum(path.stat().st_size for source in sources for path in model_files(source))


def expected_seconds(total_bytes: int) -> float:
    """What a build of ``total_bytes`` of model files is expected to take here (the build's time grows with the
    weights it reads, converts and checks)."""
    return BUILD_SECONDS_BASE + BUILD_SECONDS_PER_GIB * total_bytes / (1 << 30)


@dataclass(frozen=True)
class Entry:
    """One cached build."""
    folder: Path
    name: str

    @property
    def build_dir(self) -> Path:
        return self.folder / self.name

    @property
    def recipe_path(self) -> Path:
        return self.folder / "recipe.yaml"

    @property
    def lock_path(self) -> Path:
        return self.folder.with_name(self.folder.name + ".lock")

    def complete(self) -> bool:
        return (self.build_dir / MANIFEST_NAME).is_file()


def entry_for(root: Path, name: str, material: dict[str, Any]) -> Entry:
    """The entry of a build keyed by ``material`` (JSON-able: fingerprints, flags, versions)."""
    key = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()
    return Entry(root / "builds" / f"{name}-{key[:16]}", name)


@contextmanager
def build_lock(entry: Entry, log: Log) -> Iterator[None]:
    """Hold the entry's lock (an flock: the kernel drops it if the holder dies, so no lock outlives its process)."""
    entry.lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(entry.lock_path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"ssd-trt: another ssd-trt is building these files into {entry.folder}; waiting for it to finish")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_built(entry: Entry, recipe_text: str, sources: list[ResolvedSource], log: Log) -> Path:
    """The entry's build directory, built first (``ssd_trt.build.build``, its progress bar on stderr) if no complete
    one exists. ``sources``: the models the recipe reads, for the expected time."""
    from ssd_trt.build import build
    if entry.complete():
        return entry.build_dir
    with build_lock(entry, log):
        if entry.complete():           # built by the process we waited for
            log(f"ssd-trt: using the build another ssd-trt just finished: {entry.build_dir}")
            return entry.build_dir
        partial = entry.folder / f".partial-{os.getpid()}"
        size = model_bytes(sources)
        log(f"ssd-trt: first use of these files: building {entry.name} from {_bytes(size)} of model files into "
            f"{entry.folder} (expected about {_duration(expected_seconds(size))} here; later starts reuse it)")
        started = time.monotonic()
        try:
            for stale in entry.folder.glob(".partial-*"):     # of builds killed before they could clean up
                shutil.rmtree(stale, ignore_errors=True)
            entry.folder.mkdir(parents=True, exist_ok=True)
            _write_atomically(entry.recipe_path, recipe_text)
            os.rename(build(entry.recipe_path, root=partial), entry.build_dir)
        except BaseException as error:
            shutil.rmtree(partial, ignore_errors=True)
            if not entry.complete():
                shutil.rmtree(entry.folder, ignore_errors=True)
            if disk_full(error):
                raise SsdTrtError(f"the disk holding the cache {entry.folder.parent} is full (no space left on "
                                  f"device during the build; the partial build was removed, "
                                  f"{_free(entry.folder.parent)} free now, the build needs about "
                                  f"{_bytes(BUILD_BYTES_PER_MODEL_BYTE * size)}); free some space or point "
                                  f"{CACHE_ENV} at a larger disk") from None
            raise
        shutil.rmtree(partial, ignore_errors=True)
        log(f"ssd-trt: built in {time.monotonic() - started:.0f} s: {entry.build_dir}")
    return entry.build_dir


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(text)
    os.replace(partial, path)


def disk_full(error: BaseException) -> bool:
    """Whether ``error`` (or what it was raised from) is a write that found the disk full."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _free(folder: Path) -> str:
    try:
        return _bytes(shutil.disk_usage(folder).free)
    except OSError:
        return "unknown"


def _bytes(count: float) -> str:
    for unit in ("B", "KB", "MB"):
        if count < 1000:
            return f"{count:.0f} {unit}"
        count /= 1000
    return f"{count:.1f} GB"
