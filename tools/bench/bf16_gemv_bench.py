"""Sweep of the bf16 decode GEMV launches of a Llama-3-8B step on this GPU; writes a launch table.

For each projection of a batch-1 decode step with ``decode_fusion`` on (QKV 4096->6144 and
gate/up 4096->28672 and the LM head 4096->128256 through ``norm_gemv``: residual add + RMSNorm
first; output 4096->4096 through ``decode_gemv``; down 14336->4096 through ``gated_gemv``:
SiLU * up first), in one process on one GPU:

- ``cublas``: ``F.linear`` alone; ``unfused``: what the unfused step runs for it
  (``add_rms_norm`` + ``F.linear``, ``gated_activation`` + ``F.linear``, or ``F.linear``);
- ``current``: the launch the kernels pick today on this GPU (user table, built-in table or the
  default rule: ``slipstream.kernels.ops.decode_gemv.table``);
- ``triton``: each candidate launch (output features per block, K step, warps, stages,
  next-tile prefetch, persistent programs, split-K for the output and down projections).

Candidates are compiled first in ``--compile-workers`` processes (Triton's on-disk cache then
serves this process), and the sweep stops trying new ones after ``--budget-s`` seconds. Each
timing replays a CUDA graph that calls the op once on each of enough weight copies to span
``--span-mib`` (so the weights stream from HBM, not L2): microseconds per call, weight GB/s and
the fraction of the copy bandwidth (measured as ``infer_bench.py`` does); each launch's output
is checked against torch's (max error relative to the largest output; a launch off by more
than ``--max-rel-error`` is reported and never chosen). ``--table-out`` writes the fastest
checked launch per shape as a launch table (the ``decode_gemv_table`` config key reads it).
Compact JSON lines on stdout (every row with ``--verbose``; all rows to ``--rows-out``).
From the repository root:

    PYTHONPATH=$(ls -d kernels/src packages/*/src | tr '\\n' ':') \\
        python tools/bench/bf16_gemv_bench.py --table-out /tmp/decode_gemv_table.json

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
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

SHAPES = {  # name: (out features, in features, fusion), as decode_fusion launches them
    "qkv": (6144, 4096, "norm"),
    "out": (4096, 4096, "plain"),
    "gate_up": (28672, 4096, "norm"),
    "down": (4096, 14336, "gated"),
    "lm_head": (128256, 4096, "norm"),
}
SMOKE_SHAPES = {"qkv": (48, 64, "norm"), "out": (32, 64, "plain"), "down": (32, 96, "gated")}


def emit(**row: Any) -> None:
    print(json.dumps(row), flush=True)


def candidates(fusion: str, smoke: bool = False) -> list[Any]:
    """The launches tried for ``fusion``: a grid of output features per block x K step x
    warps (accumulator at most 16K fp32), then next-tile prefetch, 4 stages, persistent grids,
    for the tall-skinny ``plain``/``gated`` shapes (output, down) split-K, and programmatic
    dependent launch (``pdl``) on the likeliest tiles, for the ``norm`` shapes ``defer_norm``
    (1 / rms applied to the sum). (The best few then also run with ``pdl`` and with 4 stages:
    :func:`bench_shape`.)"""
    from slipstream.kernels.ops.decode_gemv.table import DecodeGemvConfig as C

    if smoke:
        found = [C(4, 32), C(8, 64, prefetch=True), C(4, 32, programs_per_sm=1)]
        if fusion != "norm":
            found.append(C(4, 32, split_k=2))
        else:
            found.append(C(4, 32, defer_norm=True))
        return [*found, C(4, 32, pdl=True)]
    found = []
    for block_n in (4, 8, 16, 32):
        for block_k in (256, 512, 1024):
            for warps in (4, 8):
                if block_n * block_k <= 16384:
                    found.append(C(block_n, block_k, warps))
    found += [C(bn, bk, 4, prefetch=True) for bn in (4, 8, 16) for bk in (256, 512)]
    found += [C(4, 1024, 4, prefetch=True), C(8, 1024, 8, prefetch=True)]
    found += [C(16, 512, 8, prefetch=True), C(8, 512, 4, programs_per_sm=4, prefetch=True)]
    found += [C(bn, 512, w, num_stages=4) for bn in (4, 8, 16) for w in (4, 8)]
    found += [C(bn, 512, 4, programs_per_sm=4) for bn in (4, 8)]
    if fusion != "norm":
        found += [C(bn, 512, 4, split_k=s) for bn in (4, 8, 16, 32) for s in (2, 4)]
        found += [C(16, 1024, 8, split_k=2), C(8, 512, 4, split_k=2, prefetch=True)]
    likely = [C(4, 512, 4), C(8, 512, 4), C(16, 512, 4), C(4, 1024, 4), C(8, 1024, 8)]
    likely += [C(16, 1024, 8), C(4, 512, 4, prefetch=True), C(8, 512, 4, prefetch=True)]
    found += [dataclasses.replace(c, pdl=True) for c in likely]
    if fusion == "norm":  # the first weight tile in flight while the row's RMS is computed
        found += [dataclasses.replace(c, early=True) for c in likely]
        found += [C(32, 512, 4, early=True), C(32, 256, 4, early=True), C(64, 256, 8)]
        # no pass over the row first: 1 / rms applied to the sum (defer_norm)
        deferred = [*likely, C(32, 512, 4), C(32, 256, 4), C(8, 512, 4, programs_per_sm=4)]
        found += [dataclasses.replace(c, defer_norm=True) for c in deferred]
        found += [C(8, 512, 4, programs_per_sm=4, prefetch=True, defer_norm=True)]
    return found


class Inputs:
    """One shape's weights (copies spanning ``span_mib``) and activations, its ops and check."""

    def __init__(self, n: int, k: int, fusion: str, device: torch.device, span_mib: int):
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.n, self.k, self.fusion, self.device = n, k, fusion, device
        self.weight_bytes = n * k * torch.finfo(dtype).bits // 8
        copies = max(1, math.ceil(span_mib * 2**20 / self.weight_bytes))
        generator = torch.Generator(device=device).manual_seed(0)

        def rand(*size: int) -> torch.Tensor:
            return torch.randn(*size, device=device, generator=generator).to(dtype)

        self.weights = [rand(n, k) / k**0.5 for _ in range(copies)]
        self.x = rand(1, 2 * k if fusion == "gated" else k)
        self.residual = rand(1, k)
        self.norm_weight = rand(k)

    def triton(self, config: Any, weight: torch.Tensor) -> Any:
        from slipstream.kernels.ops.decode_gemv import triton as kernel

        if self.fusion == "norm":
            return kernel.norm_gemv(
                self.x, self.residual, self.norm_weight, 1e-5, weight, None, config
            )
        if self.fusion == "gated":
            return kernel.gated_gemv(self.x, weight, None, config)
        return kernel.decode_gemv(self.x, weight, None, config)

    def unfused(self, weight: torch.Tensor) -> torch.Tensor:
        from slipstream.kernels.ops import add_rms_norm, gated_activation

        if self.fusion == "norm":
            return F.linear(add_rms_norm(self.x, self.residual, self.norm_weight, 1e-5)[1], weight)
        if self.fusion == "gated":
            return F.linear(gated_activation(self.x), weight)
        return F.linear(self.x, weight)

    def check(self, config: Any) -> float:
        """Max |launch - torch| over max |torch| (fp32 math on the same bf16 inputs); inf when
        the norm prologue's residual sum is not torch's bit for bit."""
        from slipstream.kernels.ops.decode_gemv import reference

        weight = self.weights[0]
        with torch.no_grad():
            got = self.triton(config, weight)
            if self.fusion == "norm":
                total, got = got
                _, want = reference.norm_gemv(
                    self.x.float(), self.residual.float(), self.norm_weight.float(), 1e-5,
                    weight.float(),
                )  # fmt: skip
                if not torch.equal(total, (self.x.float() + self.residual.float()).to(total)):
                    return math.inf
            elif self.fusion == "gated":
                want = reference.gated_gemv(self.x.float(), weight.float())
            else:
                want = F.linear(self.x.float(), weight.float())
        scale = want.abs().max().item() or 1.0
        return float((got.float() - want).abs().max().item() / scale)


def graph_time(calls: Sequence[Callable[[], Any]], replays: int) -> float:
    """Seconds per call: one CUDA graph of ``calls`` replayed ``replays`` times (on the CPU:
    the calls run ``replays`` times, wall clock)."""
    if not torch.cuda.is_available():
        began = time.perf_counter()
        for _ in range(replays):
            for call in calls:
                call()
        return (time.perf_counter() - began) / replays / len(calls)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:  # warm-up (compiles, lazy inits, split-K scratch) outside capture
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):  # the split-K scratch the warm-up made
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / replays / len(calls)


def copy_bandwidth() -> float:
    """Read + write bytes/s of a 1 GiB device copy (infer_bench.py's probe)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = math.inf
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / best


def compile_worker(n: int, k: int, fusion: str, launches: list[dict[str, Any]]) -> int:
    """Run each launch once (Triton compiles it into its on-disk cache); returns how many
    failed. In a spawned process: the parent's later launches load the compiled kernels."""
    from slipstream.kernels.ops.decode_gemv.table import DecodeGemvConfig

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    inputs = Inputs(n, k, fusion, device, span_mib=0)
    failed = 0
    with torch.no_grad():
        for launch in launches:
            try:
                inputs.triton(DecodeGemvConfig(**launch), inputs.weights[0])
            except Exception:  # the parent times it again and reports the error
                failed += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    return failed


def precompile(shapes: dict[str, tuple[int, int, str]], workers: int, smoke: bool) -> None:
    """Compile every candidate of every fusion in ``workers`` spawned processes (one shape per
    fusion: the shapes share their compiled kernels). Failures only cost the parallelism."""
    jobs = []
    seen: set[str] = set()
    for n, k, fusion in shapes.values():
        if fusion in seen:
            continue
        seen.add(fusion)
        launches = [dataclasses.asdict(c) for c in candidates(fusion, smoke)]
        for part in range(workers):
            if launches[part::workers]:
                jobs.append((n, k, fusion, launches[part::workers]))
    started = time.perf_counter()
    context = multiprocessing.get_context("spawn")
    try:
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
            failed = sum(pool.map(compile_worker, *zip(*jobs, strict=True)))
        emit(
            result="precompile",
            launches=sum(len(job[3]) for job in jobs),
            failed=failed,
            workers=workers,
            seconds=round(time.perf_counter() - started, 1),
        )
    except Exception as error:  # the sweep compiles serially instead
        emit(result="precompile_failed", error=str(error)[:300])


def bench_shape(
    name: str,
    inputs: Inputs,
    args: argparse.Namespace,
    bandwidth: float,
    deadline: float,
    rows: list[dict[str, Any]],
) -> dict[str, Any]:
    """Every variant of one projection; returns its summary (best checked launch)."""
    from slipstream.kernels.ops.decode_gemv.table import default_rule, device_key, lookup_launch

    def record(variant: str, seconds: float, **extra: Any) -> dict[str, Any]:
        row = {
            "result": "gemv",
            "shape": name,
            "variant": variant,
            "us": round(seconds * 1e6, 2),
            "gb_per_s": round(inputs.weight_bytes / seconds / 1e9, 1),
            "fraction_of_copy": round(inputs.weight_bytes / seconds / bandwidth, 3),
            **extra,
        }
        rows.append(row)
        if args.verbose:
            emit(**row)
        return row

    weights = inputs.weights
    plain_x = inputs.x[:, : inputs.k]
    cublas = record(
        "cublas",
        graph_time([functools.partial(F.linear, plain_x, w) for w in weights], args.replays),
    )
    unfused = record(
        "unfused", graph_time([functools.partial(inputs.unfused, w) for w in weights], args.replays)
    )

    def timed(config: Any) -> float:
        return graph_time(
            [functools.partial(inputs.triton, config, w) for w in weights], args.replays
        )

    current, source = lookup_launch(inputs.fusion, inputs.n, inputs.k, inputs.device)
    default = default_rule(inputs.n, inputs.k, device_key(inputs.device).sms)
    tried: list[tuple[float, Any, float]] = []
    skipped = 0
    with torch.no_grad():
        current_us = timed(current)
        record("current", current_us, source=source, **dataclasses.asdict(current))

        # A quarter of the shape's time is kept for stage 2.
        first_stage_end = time.perf_counter() + 0.75 * (deadline - time.perf_counter())

        def attempt(config: Any, until: float) -> None:
            nonlocal skipped
            if any(config == seen for _, seen, _ in tried):
                return
            if time.perf_counter() > until:
                skipped += 1
                return
            try:
                seconds = current_us if config == current else timed(config)
                error = inputs.check(config)
            except Exception as failure:  # a launch that does not compile or run: say so
                emit(
                    result="error",
                    shape=name,
                    **dataclasses.asdict(config),
                    error=str(failure)[:200],
                )
                return
            tried.append((seconds, config, error))
            record("triton", seconds, max_rel_error=round(error, 5), **dataclasses.asdict(config))

        for config in [current, default, *candidates(inputs.fusion, args.smoke)]:
            attempt(config, first_stage_end)
        # Stage 2: the three fastest checked launches with pdl, and with 4 stages.
        fastest = sorted(
            (item for item in tried if item[2] <= args.max_rel_error), key=lambda t: t[0]
        )[:3]
        for _, config, _ in fastest:
            attempt(dataclasses.replace(config, pdl=True), deadline)
            attempt(dataclasses.replace(config, num_stages=4), deadline)
    bad = [(s, c, e) for s, c, e in tried if not e <= args.max_rel_error]
    for _, config, error in bad:
        emit(result="wrong", shape=name, max_rel_error=error, **dataclasses.asdict(config))
    good = sorted((item for item in tried if item[2] <= args.max_rel_error), key=lambda t: t[0])
    summary: dict[str, Any] = {
        "result": "best",
        "shape": name,
        "fusion": inputs.fusion,
        "n": inputs.n,
        "k": inputs.k,
        "cublas_us": cublas["us"],
        "unfused_us": unfused["us"],
        "current_us": round(current_us * 1e6, 2),
        "current_source": source,
        "tried": len(tried),
        "skipped_for_budget": skipped,
        "wrong": len(bad),
    }
    if good:
        seconds, config, error = good[0]
        summary.update(
            us=round(seconds * 1e6, 2),
            gb_per_s=round(inputs.weight_bytes / seconds / 1e9, 1),
            fraction_of_copy=round(inputs.weight_bytes / seconds / bandwidth, 3),
            speedup_vs_current=round(current_us / seconds, 3),
            speedup_vs_unfused=round(unfused["us"] / (seconds * 1e6), 3),
            max_rel_error=round(error, 5),
            config=dataclasses.asdict(config),
        )
        summary["runner_up"] = [
            {"us": round(s * 1e6, 2), **dataclasses.asdict(c)} for s, c, _ in good[1:3]
        ]
    return summary


def bench_attention(slots: int, args: argparse.Namespace) -> None:
    """The 8B decode attention at batch 1 (8 KV heads x 4 query rows, head_dim 128) over
    ``slots`` cache slots, 32 layers' caches, in one graph: SDPA (the unfused step) against
    ``decode_attention`` at each chunk size, merged in the split launch or in a second one."""
    from slipstream.kernels.ops.decode_attention import triton as attention

    layers, kv_heads, rows, head_dim = (2, 2, 4, 16) if args.smoke else (32, 8, 4, 128)
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    cache = torch.randn(2, layers, 1, kv_heads, slots, head_dim, device=device).to(dtype)
    query = torch.randn(1, kv_heads, rows, head_dim, device=device).to(dtype)
    mask = torch.zeros(1, 1, rows, slots, device=device, dtype=dtype)
    mask[..., slots * 3 // 4 :] = float("-inf")  # a quarter of the cache still ahead
    scale = head_dim**-0.5

    def sdpa(layer: int) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            query, cache[0, layer], cache[1, layer], attn_mask=mask, scale=scale
        )

    def split(layer: int, block_s: int | None, merge: bool) -> torch.Tensor:
        return attention.decode_attention(
            query, cache[0, layer], cache[1, layer], mask, scale, block_s=block_s, merge=merge
        )

    found: dict[str, Any] = {"result": "attention", "slots": slots, "layers": layers}
    with torch.no_grad():
        calls = [functools.partial(sdpa, i) for i in range(layers)]
        found["sdpa_us_per_call"] = round(graph_time(calls, args.replays) * 1e6, 2)
        default = attention.default_block_s(slots, kv_heads, device)
        found["default_block_s"] = default
        for block_s in (16, 32, 64, 128):
            for merge in (True, False):
                calls = [functools.partial(split, i, block_s, merge) for i in range(layers)]
                try:
                    us = graph_time(calls, args.replays) * 1e6
                except Exception as error:
                    emit(result="error", attention_block_s=block_s, error=str(error)[:200])
                    continue
                found[f"block_s{block_s}_{'merged' if merge else 'two_launches'}_us"] = round(us, 2)
    emit(**found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*", choices=sorted(SHAPES), default=None)
    parser.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="NAME=N,K,FUSION",
        help="another model's shape (FUSION: norm, plain or gated), e.g. qkv_tp2=3072,4096,norm; "
        "repeatable; with it only --shapes named explicitly run besides these",
    )
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--span-mib", type=int, default=512)
    parser.add_argument("--budget-s", type=float, default=90.0, help="stop trying new launches")
    parser.add_argument("--compile-workers", type=int, default=12, help="0: compile serially")
    parser.add_argument("--max-rel-error", type=float, default=2e-2)
    parser.add_argument("--table-out", default=None, help="write the best launches here (JSON)")
    parser.add_argument("--rows-out", default=None, help="every row as JSON lines")
    parser.add_argument("--verbose", action="store_true", help="print every row")
    parser.add_argument(
        "--attention-slots",
        type=int,
        nargs="*",
        default=[192],
        help="also time the decode attention at these cache sizes (192: infer_bench's 128 + 64)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: a check")
    args = parser.parse_args()
    from slipstream.kernels.ops.decode_gemv.table import (
        DecodeGemvConfig,
        LaunchEntry,
        device_key,
        table_json,
    )

    started = time.perf_counter()
    deadline = started + args.budget_s
    shapes = {name: SHAPES[name] for name in (args.shapes if args.shapes is not None else [])}
    if args.shapes is None and not args.shape:
        shapes = dict(SHAPES)
    for text in args.shape:
        try:
            name, rest = text.split("=")
            n, k, fusion = rest.split(",")
            if fusion not in ("norm", "plain", "gated"):
                raise ValueError(fusion)
            shapes[name] = (int(n), int(k), fusion)
        except ValueError:
            parser.error(f"--shape {text!r}: expected NAME=N,K,FUSION with FUSION norm/plain/gated")
    if args.smoke:
        shapes = SMOKE_SHAPES
    if args.smoke:
        device, bandwidth = torch.device("cpu"), 1e9
        args.replays, args.span_mib = 2, 0
    else:
        device, bandwidth = torch.device("cuda"), copy_bandwidth()
    key = device_key(device)
    emit(result="copy_bandwidth", gb_per_s=round(bandwidth / 1e9, 1), device=key.name, sms=key.sms)
    if args.compile_workers > 0:
        precompile(shapes, args.compile_workers, args.smoke)
    rows: list[dict[str, Any]] = []
    summaries = []
    for index, (name, (n, k, fusion)) in enumerate(shapes.items()):
        inputs = Inputs(n, k, fusion, device, args.span_mib)
        # Each shape gets an equal share of what is left of the budget.
        share = (deadline - time.perf_counter()) / (len(shapes) - index)
        shape_deadline = time.perf_counter() + share
        summaries.append(bench_shape(name, inputs, args, bandwidth, shape_deadline, rows))
        emit(**summaries[-1])
        del inputs
    entries = [
        LaunchEntry(key.name, key.sms, s["fusion"], s["n"], s["k"], DecodeGemvConfig(**s["config"]))
        for s in summaries
        if "config" in s
    ]
    for slots in [32] if args.smoke else args.attention_slots:
        bench_attention(slots, args)
    layers = {name: 1 if name == "lm_head" else 32 for name in SHAPES}  # 8B: per step
    step_current = sum(s["current_us"] * layers.get(s["shape"], 0) for s in summaries)
    step_best = sum(s.get("us", s["current_us"]) * layers.get(s["shape"], 0) for s in summaries)
    emit(
        result="step_estimate",
        note="8B: 32 x (qkv, out, gate_up, down) + lm_head, GEMVs only, us",
        current_us=round(step_current, 1),
        best_us=round(step_best, 1),
        seconds=round(time.perf_counter() - started, 1),
    )
    measured = {
        "device": key.name,
        "sms": key.sms,
        "copy_gb_per_s": round(bandwidth / 1e9, 1),
        "torch": torch.__version__,
        "by": "tools/bench/bf16_gemv_bench.py",
        "shapes": {
            s["shape"]: {k: s.get(k) for k in ("us", "current_us", "fraction_of_copy")}
            for s in summaries
        },
    }
    if args.table_out:
        with open(args.table_out, "w") as handle:
            json.dump(table_json(entries, measured), handle, indent=1)
        emit(result="table", path=args.table_out, entries=table_json(entries)["entries"])
    if args.rows_out:
        with open(args.rows_out, "w") as handle:
            for row in rows:
                handle.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
