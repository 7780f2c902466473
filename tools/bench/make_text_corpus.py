"""Build the data-efficiency benchmark's text corpus from text already on this machine.

The GPU image holds only Python's standard library as text (about 10.7 MB), so the benchmark
can read a corpus file instead (``data_efficiency_bench.py --corpus file --corpus-file PATH``).
This script writes one: documents joined by NUL bytes, in a fixed order, from

* English manual pages (``/usr/share/man/man[1-9]``), their troff markup stripped to plain text;
* GNU info manuals (``/usr/share/info``), node separators removed;
* Python's standard library source (``sysconfig``'s stdlib of the running interpreter), to fill
  the rest of ``--bytes``.

Prose takes up to ``--prose-share`` of the bytes. The output is ignored by git (``/.device/``);
it is made here and carried to the GPU machine with the repository tree::

    python tools/bench/make_text_corpus.py --out .device/de_corpus.bin --bytes 20000000

The same sources and arguments give the same file (sorted paths, no timestamps); the script
prints the byte counts per source and a CRC-32 of the output.
"""

from __future__ import annotations

import argparse
import gzip
import re
import sysconfig
import zlib
from collections.abc import Iterator
from pathlib import Path

_FONT = re.compile(r"\\f(\[[^\]]*\]|\(..|.)")  # \fB, \f(CW, \f[I]
_SPECIAL = {
    r"\-": "-",
    r"\(em": "--",
    r"\(en": "-",
    r"\(bu": "*",
    r"\(aq": "'",
    r"\(dq": '"',
    r"\(lq": '"',
    r"\(rq": '"',
    r"\(oq": "'",
    r"\(cq": "'",
    r"\e": "\\",
    r"\&": "",
    r"\ ": " ",
    r"\~": " ",
    r"\|": "",
    r"\^": "",
    r"\0": " ",
}
_ESCAPE = re.compile(r"\\(\(..|\[[^\]]*\]|[*n]\(?..|s[-+]?\d+|[a-zA-Z])")
# Macros whose arguments are text worth keeping (section heads, bold/italic runs, tags).
_TEXT_MACROS = {"SH", "SS", "B", "I", "BI", "BR", "IB", "IR", "RB", "RI", "It",
                "Nm", "Nd", "Sh", "Ss", "Fl", "Ar", "Pa", "Em", "Dq", "Ql", "Xr"}  # fmt: skip


def troff_to_text(source: str) -> str:
    """Plain text of a manual page: text lines kept, text macros' arguments kept, escapes and
    other requests dropped (a crude reading, good enough for a language-model corpus)."""
    out = []
    for line in source.splitlines():
        if line.startswith(('.\\"', "'\\\"", '\\"')):
            continue  # comments
        if line.startswith((".", "'")):
            name, _, rest = line[1:].strip().partition(" ")
            if name == "IP":  # a list item: keep its tag (a bullet, a word), not an indent
                rest = rest.split(" ")[0].replace('"', "")
                if re.fullmatch(r"[\d.]*[mni]?", rest):
                    continue
            elif name not in _TEXT_MACROS or not rest:
                continue
            line = rest.replace('"', "")
        for escape, text in _SPECIAL.items():
            line = line.replace(escape, text)
        line = _FONT.sub("", line)
        line = _ESCAPE.sub("", line)
        out.append(line.rstrip())
    text = "\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def _read(path: Path) -> bytes:
    data = path.read_bytes()
    return gzip.decompress(data) if path.suffix == ".gz" else data


def man_pages(root: Path) -> Iterator[tuple[str, bytes]]:
    """(name, text) of each English manual page that is not a ``.so`` link; the ~16,000
    generated ``gcloud`` pages (one template) are left out."""
    for section in sorted(root.glob("man[1-9]")):
        for path in sorted(section.iterdir()):
            if path.is_symlink() or not path.is_file() or path.name.startswith("gcloud"):
                continue
            try:
                source = _read(path).decode("utf-8", errors="replace")
            except (OSError, EOFError, gzip.BadGzipFile):
                continue
            if source.lstrip().startswith(".so ") or len(source) < 200:
                continue
            text = troff_to_text(source)
            if len(text) >= 200:
                yield str(path.relative_to(root)), text.encode()


def info_manuals(root: Path) -> Iterator[tuple[str, bytes]]:
    """(name, text) of each GNU info file, node separators (0x1f) removed."""
    for path in sorted(root.glob("*.info*")):
        try:
            text = _read(path).decode("utf-8", errors="replace")
        except (OSError, EOFError, gzip.BadGzipFile):
            continue
        text = text.replace("\x1f", "").replace("\x00", "")
        yield path.name, text.encode()


def python_sources(root: Path) -> Iterator[tuple[str, bytes]]:
    """(name, source) of the standard library's ``.py`` files (no site-packages, no tests)."""
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if "site-packages" in parts or "test" in parts or "tests" in parts:
            continue
        yield str(path.relative_to(root)), path.read_bytes().replace(b"\x00", b"")


def build(total: int, prose_share: float, man_root: Path, info_root: Path) -> tuple[bytes, dict]:
    """The corpus bytes (documents joined by NUL) and bytes taken per source."""
    documents: list[bytes] = []
    taken = {"man": 0, "info": 0, "python": 0}
    prose_cap = int(total * prose_share)
    for source, items in (("info", info_manuals(info_root)), ("man", man_pages(man_root))):
        for _, text in items:
            if taken["info"] + taken["man"] + len(text) > prose_cap:
                break
            documents.append(text)
            taken[source] += len(text)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for _, text in python_sources(stdlib):
        if sum(taken.values()) + len(text) > total:
            break
        documents.append(text)
        taken["python"] += len(text)
    return b"\x00".join(documents), taken


def main(argv: list[str] | None = None) -> int:
    """Write the corpus file and print what it holds."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(".device/de_corpus.bin"))
    parser.add_argument("--bytes", type=int, default=20_000_000)
    parser.add_argument("--prose-share", type=float, default=0.6)
    parser.add_argument("--man-root", type=Path, default=Path("/usr/share/man"))
    parser.add_argument("--info-root", type=Path, default=Path("/usr/share/info"))
    args = parser.parse_args(argv)
    data, taken = build(args.bytes, args.prose_share, args.man_root, args.info_root)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(data)
    print(
        f"wrote {args.out}: {len(data):,} bytes, {data.count(0) + 1:,} documents "
        f"(man {taken['man']:,}, info {taken['info']:,}, python {taken['python']:,} bytes), "
        f"crc32 {zlib.crc32(data):08x}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
