"""Sweep of the fused quantized decode GEMV launches of a Llama-3-8B step; writes a launch table.

For each projection of a batch-1 int4 / int8 decode step with ``decode_fusion`` on, as
``fused_quant_decode`` launches it (QKV 4096->6144 with the norm prologue and the rotary /
KV-cache epilogue: ``quant_decode_qkv``; output 4096->4096 and down 14336->4096 with the
residual add + next-norm epilogue; gate/up 4096->28672 with the norm prologue and SiLU * up;
a quantized LM head 4096->128256 with the norm prologue), in one process on one GPU:

- ``current``: the launch the kernels pick today on this GPU (user table, built-in table or
  the rule: ``slipstream.kernels.ops.quant_matmul.fused_table``);
- ``triton``: each candidate launch (rows per program, warps = K step, stages, next-tile
  prefetch, f16x2 or fp32 unpacking, split-K, persistent programs per SM).

Candidates are compiled first in ``--compile-workers`` processes (Triton's on-disk cache then
serves this process); the sweep stops trying new ones after ``--budget-s`` seconds. Each timing
replays a CUDA graph that calls the op once on each of enough weight copies to span
``--span-mib`` (the weights stream from HBM, not L2), with the library's programmatic dependent
launch setting (``--pdl``), so back-to-back launches overlap as in the decode step:
microseconds per call, weight (codes + scales) GB/s and the fraction of the copy bandwidth
(measured as ``infer_bench.py`` does). Each launch's output is checked against the torch
reference (max error relative to the largest output; one off by more than ``--max-rel-error``
is reported and never chosen). ``--table-out`` writes the fastest checked launch per shape (when
it beats the current one by ``--min-gain``) as a launch table, the file that the
``quant.weight.decode_gemv_table`` config key reads. Compact JSON lines on stdout.

    PYTHONPATH=$(ls -d kernels/src packages/*/src | tr '\\n' ':') \\
        python tools/bench/quant_decode_bench.py --format int4 --table-out /tmp/int4.json

``--smoke`` runs the same flow on tiny shapes on the CPU (Triton's interpreter, wall-clock
timing): a check of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import json
import math
import multiprocessing
import time
from typing import Any

import torch
from bf16_gemv_bench import copy_bandwidth, emit, graph_time  # the bf16 sweep's harness

# name: (out features, in features, fusion), as fused_quant_decode launches them
SHAPES = {
    "qkv": (6144, 4096, "qkv"),
    "out": (4096, 4096, "add_norm"),
    "gate_up": (28672, 4096, "gate_up"),
    "down": (4096, 14336, "add_norm"),
    "lm_head": (128256, 4096, "norm"),
}
HEADS = (32, 8, 128)  # query heads, KV heads, head dim (Llama-3-8B)
SMOKE_SHAPES = {
    "qkv": (64, 2048, "qkv"),
    "out": (32, 2048, "add_norm"),
    "up": (32, 2048, "gate_up"),
}
SMOKE_HEADS = (2, 1, 16)
STATS = 1024  # partial sums of squares the norm prologue reads (the producer's blocks)
# the group scales' dtype (--scale-dtype), set by main
SCALE_DTYPE: list[torch.dtype] = [torch.float16]


def candidates(
    fusion: str,
    k: int,
    fmt: str,
    smoke: bool = False,
    quick: bool = False,
    pipelined: bool = False,
    fields: dict[str, Any] | None = None,
) -> list[Any]:
    """The launches tried: rows per program x warps (f16x2, prefetch), then without prefetch,
    the fp32 unpacking, 1 and 3 stages, Triton's pipelining instead of the prefetch (3-4
    stages), split-K for the shapes with few blocks, persistent grids of 2-16 programs per
    SM. ``quick``: about 14 of them (rows x warps, pipelining, split-K or persistent grids).
    ``pipelined``: also Triton's pipelining at 4-16 rows x 1-2 warps x 3-5 stages (with split-K
    2 for the shapes with few blocks). ``fields``: set on every candidate (e.g.
    ``stats_one_pass``)."""
    from slipstream.kernels.ops.quant_matmul.fused_gemv import fused_config_supported
    from slipstream.kernels.ops.quant_matmul.fused_table import FusedGemvConfig as C

    few_blocks = fusion not in ("gate_up", "norm")
    if smoke:
        found = [C(4, 1), C(2, 1, prefetch=False), C(4, 1, split_k=2), C(2, 1, programs_per_sm=1)]
    elif quick:
        found = [C(bn, w) for bn in (4, 8, 16) for w in (1, 2)]
        found += [C(bn, w, two_step=True) for bn in (4, 8) for w in (1, 2)]
        found += [C(8, 1, prefetch=False, num_stages=3), C(4, 2, prefetch=False, num_stages=3)]
        if few_blocks:
            found += [C(bn, 1, split_k=s) for bn in (4, 8, 16) for s in (2, 4)]
            found += [C(8, 2, split_k=2)]
        else:
            found += [C(32, 1), C(16, 1, programs_per_sm=8), C(8, 1, programs_per_sm=8)]
    else:
        found = [C(bn, w) for bn in (2, 4, 8, 16) for w in (1, 2, 4)]
        found += [C(bn, w, two_step=True) for bn in (4, 8, 16) for w in (1, 2)]
        found += [C(4, 1, prefetch=False), C(8, 1, prefetch=False), C(4, 2, prefetch=False)]
        found += [C(4, 1, half2=False), C(4, 1, num_stages=1), C(4, 1, num_stages=3)]
        # Triton's own software pipelining of the loads (deeper than the one-step prefetch)
        found += [
            C(bn, w, prefetch=False, num_stages=s) for bn in (4, 8) for w in (1, 2) for s in (3, 4)
        ]
        if fusion in ("gate_up", "norm"):  # many blocks: more rows per program too
            found += [C(32, 1), C(32, 2)]
        if few_blocks:  # split the K range
            found += [C(bn, w, split_k=s) for bn in (4, 8, 16) for w in (1, 2) for s in (2, 4)]
        found += [C(4, 1, programs_per_sm=p) for p in (4, 8, 16)]
        found += [C(8, 1, programs_per_sm=8), C(8, 2, programs_per_sm=8)]
    if pipelined and not smoke:
        found += [
            C(bn, w, prefetch=False, num_stages=st, split_k=split)
            for bn in (4, 8, 16)
            for w in (1, 2)
            for st in (3, 4, 5)
            for split in ((1, 2) if few_blocks else (1,))
        ]
    if fields:
        found = [dataclasses.replace(c, **fields) for c in found]
    unique = list(dict.fromkeys(found))
    return [c for c in unique if fused_config_supported(fmt, 128, k, fusion, c)]


class Inputs:
    """One shape's packed weights (copies spanning ``span_mib``), activations, op and check."""

    def __init__(
        self, fmt: str, n: int, k: int, fusion: str, device: torch.device, span_mib: int,
        heads: tuple[int, int, int], pdl: str = "on",
    ) -> None:  # fmt: skip
        from slipstream.kernels.ops.quant_matmul.packing import PER_WORD

        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.fmt, self.n, self.k, self.fusion, self.device = fmt, n, k, fusion, device
        per_word = PER_WORD[fmt]
        scale_size = torch.empty((), dtype=SCALE_DTYPE[0]).element_size()
        self.weight_bytes = n * k * 4 // per_word + n * (k // 128) * scale_size
        copies = max(1, math.ceil(span_mib * 2**20 / self.weight_bytes))
        generator = torch.Generator(device=device).manual_seed(0)

        def rand(*size: int) -> torch.Tensor:
            return torch.randn(*size, device=device, generator=generator)

        # any 32-bit pattern is valid codes (int4 / int8 two's complement fields)
        self.weights = [
            (
                torch.randint(
                    -(2**31), 2**31 - 1, (n, k // per_word), device=device,
                    dtype=torch.int32, generator=generator,
                ),
                ((rand(n, k // 128).abs() + 0.5) * (0.02 if fmt == "int8" else 0.2) / k**0.5).to(
                    SCALE_DTYPE[0]
                ),
            )
            for _ in range(copies)
        ]  # fmt: skip
        self.x = rand(1, 1, k).to(dtype)
        parts = rand(1, STATS).abs() + 0.5
        self.stats = parts / parts.sum() * k  # the row's mean square is 1
        self.residual = rand(1, n).to(dtype)
        self.norm_weight = (1 + 0.1 * rand(n)).to(dtype)
        self.heads = heads
        self.pdl = pdl
        head_dim = heads[2]
        angles = rand(1, 1, head_dim // 2) * 3
        self.cos, self.sin = angles.cos(), angles.sin()
        self.caches = [torch.zeros(1, heads[1], 64, head_dim, device=device, dtype=dtype)] * 2
        self.caches = [c.clone() for c in self.caches]
        self.slot = torch.tensor([5], device=device)

    def _args(self, words: torch.Tensor, scales: torch.Tensor, reference: bool) -> Any:
        from slipstream.kernels.ops.quant_matmul import fused_gemv
        from slipstream.kernels.ops.quant_matmul import reference as ref

        heads = self.heads
        if self.fusion == "qkv":
            fn = ref.quant_decode_qkv if reference else fused_gemv.fused_quant_qkv
            keys, values = self.caches
            return functools.partial(
                fn, self.x, words, scales, self.fmt, 128, None, self.stats, 1e-5,
                self.cos, self.sin, keys, values, self.slot, heads[0], heads[1],
            )  # fmt: skip
        fn = ref.quant_decode_gemv if reference else fused_gemv.fused_quant_gemv
        x = self.x.reshape(1, -1)
        if self.fusion == "add_norm":
            return functools.partial(
                fn, x, words, scales, self.fmt, 128,
                residual=self.residual, norm_weight=self.norm_weight,
            )  # fmt: skip
        stats = None if self.fusion == "plain" else self.stats
        gated = self.fusion == "gate_up"
        return functools.partial(fn, x, words, scales, self.fmt, 128, None, stats, 1e-5, gated)

    def triton(self, config: Any, weight: tuple[torch.Tensor, torch.Tensor]) -> Any:
        return self._args(*weight, reference=False)(config=config, pdl=self.pdl)

    def check(self, config: Any) -> float:
        """Max |launch - reference| over max |reference| (the reference: dequantize, fp32
        matmul, the same epilogue); for QKV the queries and the cache rows written."""
        weight = self.weights[0]
        got = self.triton(config, weight)
        got_cache = [c.clone() for c in self.caches]
        want = self._args(*weight, reference=True)()
        if isinstance(got, tuple):
            got, want = got[0], want[0]
        error = (got.float() - want.float()).abs().max().item()
        scale = want.float().abs().max().item() or 1.0
        if self.fusion == "qkv":  # the reference rewrote the same cache slot
            for mine, theirs in zip(got_cache, self.caches, strict=True):
                error = max(error, (mine.float() - theirs.float()).abs().max().item())
        return float(error / scale)


def compile_worker(
    fmt: str, n: int, k: int, fusion: str, heads: tuple[int, int, int], pdl: str,
    launches: list[dict[str, Any]],
) -> int:  # fmt: skip
    """Run each launch once (Triton compiles it into its on-disk cache); returns how many
    failed. In a spawned process: the parent's later launches load the compiled kernels."""
    from slipstream.kernels.ops.quant_matmul.fused_table import FusedGemvConfig

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    inputs = Inputs(fmt, n, k, fusion, device, 0, heads, pdl)
    failed = 0
    with torch.no_grad():
        for launch in launches:
            try:
                inputs.triton(FusedGemvConfig(**launch), inputs.weights[0])
            except Exception:  # the parent times it again and reports the error
                failed += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    return failed


def precompile(
    fmt: str, shapes: dict[str, tuple[int, int, str]], heads: tuple[int, int, int],
    args: argparse.Namespace,
) -> None:  # fmt: skip
    """Compile every candidate of every shape in ``--compile-workers`` spawned processes.
    Failures only cost the parallelism."""
    jobs = []
    workers = args.compile_workers
    for n, k, fusion in shapes.values():
        launches = [
            dataclasses.asdict(c)
            for c in candidates(fusion, k, fmt, args.smoke, args.quick, args.pipelined, args.fields)
        ]
        for part in range(workers):
            if launches[part::workers]:
                jobs.append((fmt, n, k, fusion, heads, args.pdl, launches[part::workers]))
    started = time.perf_counter()
    context = multiprocessing.get_context("spawn")
    try:
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
            failed = sum(pool.map(compile_worker, *zip(*jobs, strict=True)))
        emit(
            result="precompile",
            launches=sum(len(job[-1]) for job in jobs),
            failed=failed,
            workers=workers,
            seconds=round(time.perf_counter() - started, 1),
        )
    except Exception as error:  # the sweep compiles serially instead
        emit(result="precompile_failed", error=str(error)[:300])


def bench_shape(
    name: str, inputs: Inputs, args: argparse.Namespace, bandwidth: float, deadline: float
) -> dict[str, Any]:
    """Every candidate launch of one projection; returns its summary (best checked launch)."""
    from slipstream.kernels.ops.quant_matmul.fused_gemv import fused_config

    def timed(config: Any) -> float:
        calls = [functools.partial(inputs.triton, config, w) for w in inputs.weights]
        return graph_time(calls, args.replays)

    def row(seconds: float) -> dict[str, Any]:
        return {
            "us": round(seconds * 1e6, 2),
            "gb_per_s": round(inputs.weight_bytes / seconds / 1e9, 1),
            "fraction_of_copy": round(inputs.weight_bytes / seconds / bandwidth, 3),
        }

    from slipstream.kernels.ops.quant_matmul.fused_table import lookup_fused

    current = fused_config(inputs.fmt, inputs.fusion, inputs.n, inputs.k, 128, inputs.device)
    assert current is not None, (name, inputs.fmt)
    found = lookup_fused(inputs.fmt, inputs.fusion, inputs.n, inputs.k, inputs.device)
    source = found[1] if found is not None and found[0] == current else "rule"
    tried: list[tuple[float, Any, float]] = []
    skipped = 0
    with torch.no_grad():
        current_s = timed(current)
        for config in [
            current,
            *candidates(
                inputs.fusion,
                inputs.k,
                inputs.fmt,
                args.smoke,
                args.quick,
                args.pipelined,
                args.fields,
            ),
        ]:
            if any(config == seen for _, seen, _ in tried):
                continue
            if time.perf_counter() > deadline:
                skipped += 1
                continue
            try:
                seconds = current_s if config == current else timed(config)
                error = inputs.check(config)
            except Exception as failure:  # a launch that does not compile or run: say so
                emit(
                    result="error",
                    shape=name,
                    **dataclasses.asdict(config),
                    error=str(failure)[:200],
                )
                continue
            tried.append((seconds, config, error))
            if args.verbose:
                emit(result="launch", shape=name, **row(seconds), max_rel_error=round(error, 5),
                     **dataclasses.asdict(config))  # fmt: skip
    bad = [(s, c, e) for s, c, e in tried if not e <= args.max_rel_error]
    for _, config, error in bad:
        emit(result="wrong", shape=name, max_rel_error=error, **dataclasses.asdict(config))
    good = sorted((t for t in tried if t[2] <= args.max_rel_error), key=lambda t: t[0])
    summary: dict[str, Any] = {
        "result": "best",
        "format": inputs.fmt,
        "shape": name,
        "fusion": inputs.fusion,
        "n": inputs.n,
        "k": inputs.k,
        "weight_mb": round(inputs.weight_bytes / 1e6, 2),
        "current": {**row(current_s), "source": source, **dataclasses.asdict(current)},
        "tried": len(tried),
        "skipped_for_budget": skipped,
        "wrong": len(bad),
    }
    if good:
        seconds, config, error = good[0]
        summary.update(
            **row(seconds),
            speedup_vs_current=round(current_s / seconds, 3),
            max_rel_error=round(error, 5),
            config=dataclasses.asdict(config),
            runner_up=[{"us": round(s * 1e6, 2), **dataclasses.asdict(c)} for s, c, _ in good[1:3]],
        )
        summary["_best"] = (seconds, config, current_s)
    return summary


def _fields(text: str) -> dict[str, Any]:
    """``--fields``: ``name=value`` pairs (true / false / integers)."""
    from slipstream.kernels.ops.quant_matmul.fused_table import FusedGemvConfig

    known = {field.name for field in dataclasses.fields(FusedGemvConfig)}
    found: dict[str, Any] = {}
    for pair in filter(None, text.split(",")):
        name, _, raw = pair.partition("=")
        if name not in known or not raw:
            raise argparse.ArgumentTypeError(f"{pair!r}: NAME=VALUE with NAME in {sorted(known)}")
        low = raw.lower()
        found[name] = low == "true" if low in ("true", "false") else int(raw)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--format", choices=["int4", "int8"], nargs="+", default=["int4", "int8"])
    parser.add_argument(
        "--scale-dtype",
        choices=["fp16", "bf16", "fp32"],
        default="fp16",
        help="the group scales' dtype (quant.weight.scale_dtype; default fp16, the library's)",
    )
    parser.add_argument("--shapes", nargs="+", default=None, help="a subset of the shape names")
    parser.add_argument("--span-mib", type=int, default=512)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--budget-s", type=float, default=90.0, help="timing budget, all shapes")
    parser.add_argument("--compile-workers", type=int, default=6)
    parser.add_argument("--max-rel-error", type=float, default=0.02)
    parser.add_argument("--min-gain", type=float, default=1.02, help="table entries: speedup")
    parser.add_argument(
        "--pdl", choices=["on", "l2_partial", "off"], default="on",
        help="programmatic dependent launch of the timed calls (quant.weight.decode_pdl's "
        "launch option; on: the default's)",
    )  # fmt: skip
    parser.add_argument("--device-name", default=None, help="table entries' device (default: GPU)")
    parser.add_argument("--table-out", default=None, metavar="JSON")
    parser.add_argument("--verbose", action="store_true", help="one line per launch timed")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--quick", action="store_true", help="about 14 launches a shape")
    parser.add_argument(
        "--pipelined",
        action="store_true",
        help="also Triton's pipelining at 4-16 rows x 1-2 warps x 3-5 stages (split-K 2 too)",
    )
    parser.add_argument(
        "--fields",
        type=_fields,
        default=None,
        metavar="K=V,...",
        help="FusedGemvConfig fields set on every candidate (e.g. stats_one_pass=true)",
    )
    args = parser.parse_args()
    SCALE_DTYPE[0] = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[
        args.scale_dtype
    ]
    from slipstream.kernels.ops.quant_matmul.fused_table import FusedEntry, fused_table_json

    device = torch.device("cpu" if args.smoke else "cuda")
    shapes, heads = (SMOKE_SHAPES, SMOKE_HEADS) if args.smoke else (SHAPES, HEADS)
    if args.shapes:
        unknown = set(args.shapes) - set(shapes)
        if unknown:
            parser.error(f"--shapes: unknown {sorted(unknown)} (known: {sorted(shapes)})")
        shapes = {name: shapes[name] for name in args.shapes}
    bandwidth = 1e9 if args.smoke else copy_bandwidth()
    name = "cpu" if args.smoke else torch.cuda.get_device_name()
    sms = 8 if args.smoke else torch.cuda.get_device_properties(0).multi_processor_count
    emit(result="copy_bandwidth", gb_per_s=round(bandwidth / 1e9, 1), device=name, sms=sms)
    if args.compile_workers > 1 and not args.smoke:
        for fmt in args.format:
            precompile(fmt, shapes, heads, args)
    started = time.perf_counter()
    entries = []
    jobs = [(fmt, shape) for fmt in args.format for shape in shapes]
    for index, (fmt, shape) in enumerate(jobs):
        n, k, fusion = shapes[shape]
        share = (args.budget_s - (time.perf_counter() - started)) / (len(jobs) - index)
        span = 1 if args.smoke else args.span_mib
        inputs = Inputs(fmt, n, k, fusion, device, span, heads, args.pdl)
        summary = bench_shape(shape, inputs, args, bandwidth, time.perf_counter() + share)
        best = summary.pop("_best", None)
        emit(**summary)
        if best is not None and best[2] / best[0] >= args.min_gain:
            device_name = args.device_name or name.removeprefix("NVIDIA ").strip()
            entries.append(FusedEntry(device_name, sms, fmt, fusion, n, k, best[1]))
        del inputs
    if args.table_out:
        with open(args.table_out, "w") as handle:
            json.dump(fused_table_json(entries), handle, indent=1)
        emit(result="table", path=args.table_out, entries=len(entries))


if __name__ == "__main__":
    main()
