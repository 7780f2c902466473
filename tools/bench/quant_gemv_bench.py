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
from slipstream.kernels.ops.quant_matmul import triton as backend
from slipstream.kernels.ops.quant_matmul.reference import dequantize_weight

SHAPES = {
    "llama3-8b": {
        "qkv": (6144, 4096),
        "out": (4096, 4096),
        "gate_up": (28672, 4096),
        "down": (4096, 14336),
    },
    "tiny": {"qkv": (96, 256), "down": (64, 512)},
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
    return Weights(
        [codes.clone() for _ in range(copies)],
        [q.scales.clone() for _ in range(copies)],
        [weight.clone() for _ in range(dense_copies)],
        quant_bytes,
        dense_bytes,
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


def main() -> None:
    """Run every (shape, rows, format) and print one JSON line each."""
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16  # interpreter: no bf16 dot
    bandwidth = copy_bandwidth(device)
    emit(metric="copy_bandwidth_GBps", value=round(bandwidth / 1e9, 1), device=str(device))
    launches = args.launches if device.type == "cuda" else 2
    for (name, (n, k)), fmt in itertools.product(SHAPES[args.preset].items(), args.formats):
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
            emit(
                shape=name,
                out_features=n,
                in_features=k,
                rows=rows,
                format=fmt,
                path="dequantize+matmul"
                if rows > backend.DEQUANTIZE_ABOVE_ROWS
                else f"kernel {dataclasses.asdict(config) if config else None}",
                us=round(seconds * 1e6, 2),
                GBps=round((weights.quant_bytes + act_bytes) / seconds / 1e9, 1),
                bw_fraction=round((weights.quant_bytes + act_bytes) / seconds / bandwidth, 3),
                bf16_us=round(dense_seconds * 1e6, 2),
                bf16_GBps=round((weights.dense_bytes + act_bytes) / dense_seconds / 1e9, 1),
                speedup_vs_bf16=round(dense_seconds / seconds, 2),
                max_rel_error=float(f"{error:.2e}"),
                **extra,
            )
            if not args.sweep or rows > 16:
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


if __name__ == "__main__":
    main()
