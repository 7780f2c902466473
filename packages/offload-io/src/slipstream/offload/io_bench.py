"""Measure swap bandwidth: ``python -m slipstream.offload.io_bench --path /nvme/swap``.

Writes then reads one file of ``--size`` bytes through :class:`AsyncIOEngine` (from/to one
aligned, pinned-if-CUDA buffer) and reports GB/s, next to the raw device measured the same way
without the engine (``dd`` with ``oflag=direct``/``iflag=direct``), so a slow swap tier can be
told apart from a slow drive. ``--sweep`` tries a small grid of ``block_size × queue_depth ×
threads`` and prints the best as an ``"aio"`` block ready to paste into the config.

Reads are only meaningful when they do not come from the page cache: with O_DIRECT they never
do; for ``dd``'s buffered fallbacks and ``o_direct=false`` the tool drops the page cache through
``/proc/sys/vm/drop_caches`` when it can (root) and says so when it cannot.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from slipstream.offload.aio.config import AioSettings
from slipstream.offload.aio.engine import AsyncIOEngine
from slipstream.offload.pinned import aligned_empty

__all__ = ["main", "parse_size", "run_bench"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
SWEEP_BLOCKS = (256 * 1024, 1024 * 1024, 8 * 1024 * 1024)
SWEEP_DEPTHS = (4, 16)
SWEEP_THREADS = (1, 2)


def parse_size(text: str | int) -> int:
    """Bytes in ``text``: ``"1GiB"``, ``"512MiB"``, ``"4M"`` (decimal), ``"4096"``."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 1GiB, 512MiB, 4M or 4096")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def drop_page_cache() -> bool:
    """Flush dirty pages and drop the page cache (root only); whether it worked."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("3\n")
        return True
    except OSError:
        return False


def _engine_run(
    path: Path, buffer: torch.Tensor, settings: AioSettings, backend: str
) -> dict[str, Any]:
    file = path / f"slipstream-io-bench-{uuid.uuid4().hex[:8]}.bin"
    nbytes = buffer.numel()
    try:
        with AsyncIOEngine(settings, backend=backend) as engine:
            start = time.perf_counter()
            engine.write(buffer, file).wait()
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)  # count the data reaching the device, as dd's conv=fdatasync does
            finally:
                os.close(fd)
            write_s = time.perf_counter() - start
            cached = not settings.o_direct and not drop_page_cache()
            start = time.perf_counter()
            engine.read(buffer, file).wait()
            read_s = time.perf_counter() - start
            backend_name = engine.backend_name
            io_mode = engine.io_mode
    finally:
        file.unlink(missing_ok=True)
    return {
        "backend": backend_name,
        "io_mode": io_mode,
        "block_size": settings.block_size,
        "queue_depth": settings.queue_depth,
        "threads": settings.intra_op_parallelism,
        "o_direct": settings.o_direct,
        "write_gbps": nbytes / write_s / 1e9,
        "read_gbps": nbytes / read_s / 1e9,
        "read_may_be_cached": cached,
    }


def _dd(args: list[str]) -> tuple[float | None, str]:
    start = time.perf_counter()
    result = subprocess.run(["dd", *args], capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        return None, result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed"
    match = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", result.stderr)
    if match and float(match.group(2)) > 0:
        return int(match.group(1)) / float(match.group(2)) / 1e9, ""
    return None, f"unparsed output (took {elapsed:.2f} s)"


def raw_device(path: Path, size: int, block_size: int = 1024 * 1024) -> dict[str, Any]:
    """Raw write and read bandwidth of ``path``'s device through ``dd`` with direct I/O."""
    if shutil.which("dd") is None:
        return {"available": False, "note": "dd not found"}
    count = max(1, size // block_size)
    file = path / f"slipstream-io-bench-dd-{uuid.uuid4().hex[:8]}.bin"
    notes = []
    try:
        write, note = _dd(
            [
                "if=/dev/zero",
                f"of={file}",
                f"bs={block_size}",
                f"count={count}",
                "oflag=direct",
                "conv=fdatasync",
            ]
        )
        if write is None:  # no O_DIRECT on this file system: buffered, flushed at the end
            notes.append(f"direct write failed ({note}); buffered")
            write, note = _dd(
                [
                    "if=/dev/zero",
                    f"of={file}",
                    f"bs={block_size}",
                    f"count={count}",
                    "conv=fdatasync",
                ]
            )
        read, note = _dd([f"if={file}", "of=/dev/null", f"bs={block_size}", "iflag=direct"])
        if read is None:
            notes.append("direct read failed; buffered")
            if not drop_page_cache():
                notes.append("could not drop the page cache (not root): reads may be cached")
            read, note = _dd([f"if={file}", "of=/dev/null", f"bs={block_size}"])
    finally:
        file.unlink(missing_ok=True)
    return {"available": True, "write_gbps": write, "read_gbps": read, "note": "; ".join(notes)}


def run_bench(
    path: str | os.PathLike[str],
    *,
    size: int | str = "1GiB",
    block_size: int | str = "1MiB",
    queue_depth: int = 8,
    threads: int = 1,
    backend: str = "auto",
    o_direct: bool = True,
    sweep: bool = False,
    raw: bool = True,
) -> dict[str, Any]:
    """Benchmark the engine (and ``dd``) in ``path``; returns every run and the best settings.

    Returns:
        ``{"path", "size", "runs": [...], "best": {...}, "aio": {...}, "raw": {...}}``: each run
        holds its settings and ``write_gbps``/``read_gbps``; ``best`` is the run with the
        highest write+read bandwidth and ``aio`` its settings as an ``"aio"`` config block.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"--path {folder} is not an existing folder")
    nbytes = parse_size(size)
    if nbytes < 4096 or nbytes % 4096:
        raise ValueError(f"size must be a positive multiple of 4096 bytes, got {nbytes}")
    block = parse_size(block_size)
    grid: list[tuple[int, int, int]] = (
        list(itertools.product(SWEEP_BLOCKS, SWEEP_DEPTHS, SWEEP_THREADS))
        if sweep
        else [(block, queue_depth, threads)]
    )
    buffer = aligned_empty(nbytes, torch.uint8, pin=True)
    buffer.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    runs = []
    for index, (blk, depth, nthreads) in enumerate(grid, 1):
        settings = AioSettings(
            block_size=blk, queue_depth=depth, intra_op_parallelism=nthreads, o_direct=o_direct
        )
        run = _engine_run(folder, buffer, settings, backend)
        runs.append(run)
        _progress(
            f"[{index}/{len(grid)}] block_size={blk} queue_depth={depth} threads={nthreads}: "
            f"write {run['write_gbps']:.2f} GB/s, read {run['read_gbps']:.2f} GB/s "
            f"({run['backend']}, {run['io_mode']})"
        )
    best = max(runs, key=lambda r: r["write_gbps"] + r["read_gbps"])
    aio = {
        "block_size": best["block_size"],
        "queue_depth": best["queue_depth"],
        "intra_op_parallelism": best["threads"],
        "single_submit": False,
        "overlap_events": True,
        "o_direct": best["o_direct"],
    }
    result: dict[str, Any] = {
        "path": str(folder),
        "size": nbytes,
        "runs": runs,
        "best": best,
        "aio": aio,
    }
    if raw:
        _progress("raw device (dd) ...")
        result["raw"] = raw_device(folder, nbytes)
    return result


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def format_table(result: dict[str, Any]) -> str:
    """A plain-text table of the runs, the raw device and the ready-to-paste ``aio`` block."""
    lines = [
        f"swap bandwidth in {result['path']} ({result['size']:,} bytes per transfer)",
        f"{'backend':8} {'mode':10} {'block_size':>10} {'queue':>5} {'threads':>7} {'write GB/s':>10} "
        f"{'read GB/s':>10}",
    ]
    for run in result["runs"]:
        cached = " (read may be cached)" if run["read_may_be_cached"] else ""
        lines.append(
            f"{run['backend']:8} {run['io_mode']:10} {run['block_size']:>10} {run['queue_depth']:>5} "
            f"{run['threads']:>7} {_fmt(run['write_gbps']):>10} {_fmt(run['read_gbps']):>10}"
            f"{cached}"
        )
    raw = result.get("raw")
    if raw is not None:
        if raw.get("available"):
            note = f" ({raw['note']})" if raw.get("note") else ""
            lines.append(
                f"{'dd':8} {'direct':10} {'1048576':>10} {'-':>5} {'-':>7} {_fmt(raw['write_gbps']):>10} "
                f"{_fmt(raw['read_gbps']):>10}{note}"
            )
        else:
            lines.append(f"raw device: not measured ({raw.get('note')})")
    lines.append('best settings:\n"aio": ' + json.dumps(result["aio"], indent=4))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m slipstream.offload.io_bench",
        description="Measure swap write/read bandwidth through the aio engine and with dd.",
    )
    parser.add_argument("--path", required=True, help="folder on the swap drive (nvme_path)")
    parser.add_argument("--size", default="1GiB", help="bytes per transfer (default 1GiB)")
    parser.add_argument("--block-size", default="1MiB", help="aio block_size (default 1MiB)")
    parser.add_argument("--queue-depth", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="aio intra_op_parallelism")
    parser.add_argument("--backend", default="auto", choices=("auto", "cpp", "python"))
    parser.add_argument("--no-o-direct", action="store_true", help="buffered I/O (o_direct=false)")
    parser.add_argument("--sweep", action="store_true", help="try a grid of settings")
    parser.add_argument("--no-raw", action="store_true", help="skip the dd measurement")
    parser.add_argument("--json", dest="json_out", help="also write the results to this file")
    args = parser.parse_args(argv)
    try:
        result = run_bench(
            args.path,
            size=args.size,
            block_size=args.block_size,
            queue_depth=args.queue_depth,
            threads=args.threads,
            backend=args.backend,
            o_direct=not args.no_o_direct,
            sweep=args.sweep,
            raw=not args.no_raw,
        )
    except (OSError, ValueError, ImportError) as exc:
        print(f"io_bench: error: {exc}", file=sys.stderr)
        return 1
    print(format_table(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
