"""Weight-only quantized matmul (``slipstream.kernels.ops.quant_matmul``) beside bf16 ``F.linear``.

For each Llama-3-8B projection shape (QKV 6144x4096, output 4096x4096, gate/up 28672x4096,
down 4096x14336), each row count (``--rows``: decode batch sizes, and a prefill) and each
format (int8, int4, fp8 e4m3; group 128), one JSON line: kernel time, the bytes it must read
(codes + scales + activations + output) as GB/s and as a fraction of the measured copy
bandwidth, and the speedup over bf16 ``F.linear`` (cuBLAS) on the same shape; at decode row
counts also the bf16 weight through the same streaming kernel (``dense_gemv``, what
``use_triton=True`` runs) beside cuBLAS. Every timing
replays a CUDA graph of ``--launches`` back-to-back calls that cycle through enough weight copies
to overflow the L2 cache, so neither launch overhead nor a cache-resident weight flatters it.
Each kernel output is also checked against the reference (dequantize, then matmul).

``--sweep`` times every tile configuration for the decode row counts and prints the best per
(format, shape, rows): what ``default_config`` should pick on this GPU.

GPU (the lead's command)::

    PYTHONPATH=$(ls -d kernels/src packages/*/src | tr '\\n' ':') \\
        python tools/bench/quant_gemv_bench.py [--sweep]

CPU smoke run of the harness (Triton interpreter, tiny shapes, no timing meaning)::

    TRITON_INTERPRET=1 PYTHONPATH=... python tools/bench/quant_gemv_bench.py --preset tiny
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from slipstream.kernels.ops import quantize
from slipstream.kernels.ops.quant_matmul import gemv as gemv_backend
from slipstream.kernels.ops.quant_matmul import is_packable
from slipstream.kernels.ops.quant_matmul import triton as backend
from slipstream.kernels.ops.quant_matmul.reference import dequantize_weight

SHAPES = {
    "llama3-8b": {
        "qkv": (6144, 4096),
        "out": (4096, 4096),
        "gate_up": (28672, 4096),
        "down": (4096, 14336),
        "lm_head": (128256, 4096),
    },
    "tiny": {"qkv": (96, 1024), "down": (40, 2048)},
}
L2_FLUSH_BYTES = 256 << 20  # the weight copies cycled through exceed any L2 (H100: 50 MiB)


def parse_args() -> argparse.Namespace:
    """Command-line options (defaults: the Llama-3-8B shapes on one GPU)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 128, 512])
    parser.add_argument("--formats", nargs="+", default=["int8", "int4", "fp8_e4m3"])
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--launches", type=int, default=50, help="calls per timed graph")
    parser.add_argument("--repeats", type=int, default=5, help="timed replays; best kept")
    parser.add_argument("--sweep", action="store_true", help="time every decode tile config")
    parser.add_argument(
        "--table-out",
        default=None,
        help="with --sweep: write the fastest gemv config per (format, out, in) as JSON, for "
        "infer_bench.py --gemv-table (and for gemv.GEMV_TABLE)",
    )
    parser.add_argument(
        "--shapes", nargs="+", default=None, help="only these shapes of the preset (default: all)"
    )
    parser.add_argument(
        "--sweep-tiled",
        action="store_true",
        help="with --sweep: also sweep the tensor-core tile kernel (slow: many compiles)",
    )
    return parser.parse_args()


def emit(**row: Any) -> None:
    """One JSON result line."""
    print(json.dumps(row), flush=True)


def time_calls(calls: list[Callable[[], Any]], device: torch.device, repeats: int) -> float:
    """Seconds per call: a CUDA graph of all ``calls`` replayed (plain calls on the CPU)."""
    if device.type != "cuda":
        start = time.perf_counter()
        for call in calls:
            call()
        return (time.perf_counter() - start) / len(calls)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls[:2]:  # compile and warm up outside the capture
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start_event = torch.cuda.Event(enable_timing=True)
        end_event = torch.cuda.Event(enable_timing=True)
        start_event.record()
        graph.replay()
        end_event.record()
        torch.cuda.synchronize()
        best = min(best, start_event.elapsed_time(end_event) / 1e3)
    return best / len(calls)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of ``dst.copy_(src)`` on 1 GiB (read + write bytes)."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):  # as infer_bench.py measures it: the fastest single 1 GiB copy
        dst.copy_(src)
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() / best


@dataclasses.dataclass
class Weights:
    """Copies of one quantized weight (codes, scales) and of its bf16 original."""

    codes: list[torch.Tensor]
    scales: list[torch.Tensor]
    dense: list[torch.Tensor]
    quant_bytes: int
    dense_bytes: int
    words: list[torch.Tensor]  # the codes in the gemv kernel's packed layout (int8/int4)


def make_weights(
    out_features: int, in_features: int, fmt: str, group: int, dtype: torch.dtype, device
) -> Weights:
    """Enough copies of a random weight that cycling through them overflows the L2 cache."""
    weight = torch.randn(out_features, in_features, device=device, dtype=dtype) * 0.02
    q = quantize(weight, fmt, group)
    codes = q.data.reshape(out_features, -1)
    quant_bytes = codes.numel() * codes.element_size() + q.scales.numel() * 4
    dense_bytes = weight.numel() * weight.element_size()
    copies = max(2, -(-L2_FLUSH_BYTES // quant_bytes)) if device.type == "cuda" else 1
    dense_copies = max(2, -(-L2_FLUSH_BYTES // dense_bytes)) if device.type == "cuda" else 1
    packable = is_packable(fmt, group, in_features)
    words = gemv_backend.pack_gemv(codes, fmt, group, in_features) if packable else None
    return Weights(
        [codes.clone() for _ in range(copies)],
        [q.scales.clone() for _ in range(copies)],
        [weight.clone() for _ in range(dense_copies)],
        quant_bytes,
        dense_bytes,
        [] if words is None else [words.clone() for _ in range(copies)],
    )


def bench_kernel(
    x: torch.Tensor,
    weights: Weights,
    fmt: str,
    group: int,
    config: backend.QuantMatmulConfig | None,
    launches: int,
    repeats: int,
) -> float:
    """Seconds per quant_matmul call (``config`` None: the op's own choice)."""
    calls = []
    for index in range(launches):
        codes = weights.codes[index % len(weights.codes)]
        scales = weights.scales[index % len(weights.scales)]
        if config is None:
            calls.append(lambda c=codes, s=scales: backend.quant_matmul(x, c, s, fmt, group))
        else:
            calls.append(
                lambda c=codes, s=scales: backend.launch(x, c, s, fmt, group, None, config)
            )
    return time_calls(calls, x.device, repeats)


def sweep_configs(block_k: int) -> list[backend.QuantMatmulConfig]:
    """Decode tile configurations tried by ``--sweep``."""
    return [
        backend.QuantMatmulConfig(
            block_m=16, block_n=n, block_k=block_k, split_k=s, num_warps=w, num_stages=st
        )
        for n, s, w, st in itertools.product((16, 32, 64), (1, 2, 4), (4, 8), (3, 5))
    ]


def gemv_sweep_configs(fmt: str = "dense") -> list[gemv_backend.GemvConfig]:
    """``gemv_kernel`` launches tried by ``--sweep`` at one row: tiles x split-K, and for int4 /
    int8 also the f16x2 unpacking (``half2``) and the register prefetch of the next step."""
    # (rows per program, warps, K splits): one warp streaming 4 or 8 rows step by step, and
    # 2 / 4 warps whose step covers 2048 / 4096 features (one step for K = 4096: every load of
    # a program in flight at once)
    tiles = [(4, 1, 1), (4, 1, 2), (8, 1, 1), (16, 1, 1), (4, 2, 1), (8, 2, 1), (4, 4, 1)]
    tiles += [(8, 4, 1), (4, 1, 4)]
    variants = [(False, False, False)]
    if fmt in ("int4", "int8"):  # (half2, prefetch, quads)
        variants += [(True, True, False), (True, False, True), (True, True, True)]
    return [
        gemv_backend.GemvConfig(block_n=n, num_warps=w, split_k=s, half2=h, prefetch=p, quads=q)
        for (h, p, q), (n, w, s) in itertools.product(variants, tiles)
    ]


def brief(config: gemv_backend.GemvConfig) -> str:
    """A gemv launch in a few characters: rows, warps, splits, then H(alf2) P(refetch) Q(uads)."""
    return "n{}w{}s{}{}{}{}".format(
        config.block_n,
        config.num_warps,
        config.split_k,
        "H" if config.half2 else "",
        "P" if config.prefetch else "",
        "Q" if config.quads else "",
    )


def gemv_calls(
    x: torch.Tensor,
    fmt: str,
    weights: Weights,
    group: int,
    config: gemv_backend.GemvConfig,
    launches: int,
) -> list[Callable[[], Any]]:
    """``launches`` gemv calls cycling through the weight copies (fmt "dense": the bf16 ones)."""
    if fmt == "dense":
        return [
            lambda w=w: gemv_backend.launch_gemv(x, w, None, "dense", 0, None, config)
            for w in itertools.islice(itertools.cycle(weights.dense), launches)
        ]
    return [
        lambda w=w, sc=sc: gemv_backend.launch_gemv(x, w, sc, fmt, group, None, config)
        for w, sc in itertools.islice(itertools.cycle(zip(weights.words, weights.scales)), launches)
    ]


def sweep_gemv(
    x: torch.Tensor,
    name: str,
    fmt: str,
    weights: Weights,
    group: int,
    act_bytes: int,
    bandwidth: float,
    launches: int,
    repeats: int,
) -> None:
    """Time every :func:`gemv_sweep_configs` entry; print the best three and the default's."""
    n, k = weights.dense[0].shape
    nbytes = (weights.dense_bytes if fmt == "dense" else weights.quant_bytes) + act_bytes
    results = []
    chosen = gemv_backend.gemv_default_config(fmt, n, k, group, x.device)
    candidates = gemv_sweep_configs(fmt)
    if chosen is not None and chosen not in candidates:
        candidates.append(chosen)
    if fmt == "dense":
        expected = F.linear(x.float(), weights.dense[0].float())
    else:
        expected = (
            x.float()
            @ dequantize_weight(
                weights.codes[0], weights.scales[0], fmt, group, k, torch.float32
            ).t()
        )
    for candidate in candidates:
        if not gemv_backend.gemv_supports(fmt, group, k, candidate):
            continue
        try:
            t = time_calls(
                gemv_calls(x, fmt, weights, group, candidate, launches), x.device, repeats
            )
            out = gemv_calls(x, fmt, weights, group, candidate, 1)[0]()
        except Exception as error_:  # a config that does not compile or fit: skip
            emit(sweep_error=str(error_)[:200], config=dataclasses.asdict(candidate))
            continue
        error = ((out.float() - expected).abs().max() / expected.abs().max()).item()
        results.append((t, candidate, error))
    results.sort(key=lambda item: item[0])

    def line(rank: Any, t: float, config: gemv_backend.GemvConfig, error: float) -> None:
        emit(
            gemv_sweep=name,
            format=fmt,
            rank=rank,
            config=brief(config),
            us=round(t * 1e6, 2),
            GBps=round(nbytes / t / 1e9, 1),
            bw_fraction=round(nbytes / t / bandwidth, 3),
            max_rel_error=float(f"{error:.1e}"),
        )

    for rank, (t, candidate, error) in enumerate(results[:3]):
        line(rank, t, candidate, error)
    # the best of each (half2, prefetch) variant, and the default's time
    for variant in sorted({(c.half2, c.prefetch, c.quads) for _, c, _ in results}):
        best = next(r for r in results if (r[1].half2, r[1].prefetch, r[1].quads) == variant)
        line("best_" + "".join(f if v else "-" for f, v in zip("HPQ", variant)), *best)
    for t, candidate, error in results:
        if candidate == chosen:
            line("default", t, candidate, error)
    if results:
        BEST[f"{fmt},{n},{k}"] = dataclasses.asdict(results[0][1])


BEST: dict[str, dict[str, Any]] = {}  # "format,out,in" -> the sweep's fastest GemvConfig


def main() -> None:
    """Run every (shape, rows, format) and print one JSON line each."""
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16  # interpreter: no bf16 dot
    bandwidth = copy_bandwidth(device)
    emit(metric="copy_bandwidth_GBps", value=round(bandwidth / 1e9, 1), device=str(device))
    launches = args.launches if device.type == "cuda" else 2
    shapes = {
        name: shape
        for name, shape in SHAPES[args.preset].items()
        if args.shapes is None or name in args.shapes
    }
    for (name, (n, k)), fmt in itertools.product(shapes.items(), args.formats):
        weights = make_weights(n, k, fmt, args.group_size, dtype, device)
        reference = dequantize_weight(
            weights.codes[0], weights.scales[0], fmt, args.group_size, k, torch.float32
        )
        for rows in args.rows:
            x = torch.randn(rows, k, device=device, dtype=dtype)
            out = backend.quant_matmul(x, weights.codes[0], weights.scales[0], fmt, args.group_size)
            expected = x.float() @ reference.t()
            error = ((out.float() - expected).abs().max() / expected.abs().max()).item()
            act_bytes = (rows * k + rows * n) * x.element_size()
            seconds = bench_kernel(x, weights, fmt, args.group_size, None, launches, args.repeats)
            dense_calls = [
                lambda w=w, x=x: F.linear(x, w)
                for w in itertools.islice(itertools.cycle(weights.dense), launches)
            ]
            dense_seconds = time_calls(dense_calls, device, args.repeats)
            config = backend.default_config(rows, n, k, fmt, args.group_size, device)
            extra = {}
            if rows <= backend.DENSE_GEMV_MAX_ROWS and device.type == "cuda":
                # The same streaming kernel on the bf16 weight (use_triton=True's GEMV).
                dense_triton = [
                    lambda w=w, x=x: backend.dense_gemv(x, w)
                    for w in itertools.islice(itertools.cycle(weights.dense), launches)
                ]
                triton_seconds = time_calls(dense_triton, device, args.repeats)
                extra["bf16_triton_gemv_us"] = round(triton_seconds * 1e6, 2)
            if rows > backend.DEQUANTIZE_ABOVE_ROWS and config is not None:
                # The tiled kernel on a prefill, for moving DEQUANTIZE_ABOVE_ROWS.
                tiled = bench_kernel(
                    x, weights, fmt, args.group_size, config, launches, args.repeats
                )
                extra = {"tiled_kernel_us": round(tiled * 1e6, 2)}
            gemv = (
                gemv_backend.gemv_default_config(fmt, n, k, args.group_size, device)
                if rows <= backend.DENSE_GEMV_MAX_ROWS and weights.words
                else None
            )
            if gemv is not None:
                # The packed-layout gemv kernel (what WeightOnlyLinear runs at decode).
                g_seconds = time_calls(
                    gemv_calls(x, fmt, weights, args.group_size, gemv, launches),
                    device,
                    args.repeats,
                )
                extra["gemv_us"] = round(g_seconds * 1e6, 2)
                extra["gemv_GBps"] = round((weights.quant_bytes + act_bytes) / g_seconds / 1e9, 1)
                extra["gemv_bw_fraction"] = round(
                    (weights.quant_bytes + act_bytes) / g_seconds / bandwidth, 3
                )
                extra["gemv_speedup_vs_bf16"] = round(dense_seconds / g_seconds, 2)
                if rows > 1:
                    # The packed weight's other path (dequantize once, cuBLAS), for GEMV_MAX_ROWS.
                    deq_calls = [
                        lambda w=w, sc=sc, x=x, f=fmt, k=k: F.linear(
                            x, gemv_backend.dequantize_packed(w, sc, f, args.group_size, k, dtype)
                        )
                        for w, sc in itertools.islice(
                            itertools.cycle(zip(weights.words, weights.scales)), launches
                        )
                    ]
                    extra["packed_dequantize_us"] = round(
                        time_calls(deq_calls, device, args.repeats) * 1e6, 2
                    )
                out = gemv_backend.launch_gemv(
                    x, weights.words[0], weights.scales[0], fmt, args.group_size, None, gemv
                )
                extra["gemv_max_rel_error"] = float(
                    f"{((out.float() - expected).abs().max() / expected.abs().max()).item():.2e}"
                )
            if rows > backend.DEQUANTIZE_ABOVE_ROWS:
                path = "dequantize+matmul"
            else:
                path = "tile kernel " + (
                    "n{block_n}k{block_k}s{split_k}w{num_warps}".format(
                        **dataclasses.asdict(config)
                    )
                    if config
                    else "none"
                )
            emit(
                shape=name,
                out_features=n,
                in_features=k,
                rows=rows,
                format=fmt,
                path=path,
                us=round(seconds * 1e6, 2),
                GBps=round((weights.quant_bytes + act_bytes) / seconds / 1e9, 1),
                bw_fraction=round((weights.quant_bytes + act_bytes) / seconds / bandwidth, 3),
                bf16_us=round(dense_seconds * 1e6, 2),
                speedup_vs_bf16=round(dense_seconds / seconds, 2),
                max_rel_error=float(f"{error:.2e}"),
                **extra,
                gemv_config=None if gemv is None else brief(gemv),
            )
            if fmt == args.formats[0]:
                # bf16 on the same shape: cuBLAS, and (few rows) dense_gemv's streaming kernel.
                dense_bytes = weights.dense_bytes + act_bytes
                triton_us = extra.get("bf16_triton_gemv_us")
                emit(
                    shape=name,
                    rows=rows,
                    format="bf16",
                    us=round(dense_seconds * 1e6, 2),
                    GBps=round(dense_bytes / dense_seconds / 1e9, 1),
                    bw_fraction=round(dense_bytes / dense_seconds / bandwidth, 3),
                    triton_gemv_us=triton_us,
                    triton_gemv_bw_fraction=None
                    if triton_us is None
                    else round(dense_bytes / (triton_us / 1e6) / bandwidth, 3),
                )
            if not args.sweep or rows > 16:
                continue
            if rows == 1 and weights.words:
                sweep_gemv(
                    x,
                    name,
                    fmt,
                    weights,
                    args.group_size,
                    act_bytes,
                    bandwidth,
                    launches,
                    args.repeats,
                )
                if fmt == args.formats[0]:
                    sweep_gemv(
                        x,
                        name,
                        "dense",
                        weights,
                        args.group_size,
                        act_bytes,
                        bandwidth,
                        launches,
                        args.repeats,
                    )
            if not args.sweep_tiled:
                continue
            block_k = backend.default_config(1, n, k, fmt, args.group_size, device)
            assert block_k is not None
            results = []
            for candidate in sweep_configs(block_k.block_k):
                try:
                    t = bench_kernel(
                        x, weights, fmt, args.group_size, candidate, launches, args.repeats
                    )
                except Exception as error_:  # a config that does not compile or fit: skip
                    emit(sweep_error=str(error_)[:200], config=dataclasses.asdict(candidate))
                    continue
                results.append((t, candidate))
            results.sort(key=lambda item: item[0])
            for t, candidate in results[:3]:
                emit(
                    sweep=name,
                    rows=rows,
                    format=fmt,
                    config=dataclasses.asdict(candidate),
                    us=round(t * 1e6, 2),
                    bw_fraction=round((weights.quant_bytes + act_bytes) / t / bandwidth, 3),
                )
    if args.table_out:
        with open(args.table_out, "w") as handle:
            json.dump(BEST, handle, indent=1)
        emit(table_out=args.table_out, entries=len(BEST))


if __name__ == "__main__":
    main()
