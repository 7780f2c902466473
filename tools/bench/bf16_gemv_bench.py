"""Batch-1 bf16 decode kernels of a Llama-3-8B-shaped model: cuBLAS/SDPA beside Slipstream's.

The decode attention (SDPA, as the unfused step runs it, against ``decode_attention`` at each
chunk size, 32 layers' caches of ``--slots`` slots), then for each projection of a decode step (QKV 4096->6144, output 4096->4096, gate/up
4096->28672, down 14336->4096, LM head 4096->128256), in one process on one GPU:

- ``cublas``: ``F.linear`` alone, and ``unfused``: what the unfused decode step runs for it
  (``add_rms_norm`` + ``F.linear`` for QKV, gate/up and the head; ``gated_activation`` +
  ``F.linear`` for down; ``F.linear`` for the output projection);
- ``triton``: ``slipstream.kernels``' decode GEMV with its prologue (add + RMSNorm, SwiGLU or
  none, as ``decode_fusion`` runs it) at the default launch and over a sweep of launches
  (output features per block x K step x warps x persistent programs per SM x next-tile
  prefetch, then stages for the best few on request).

Each timing replays a CUDA graph that calls the op once on each of enough weight copies to
span 512 MiB (so the weights stream from HBM, not L2), and reports microseconds per call and
weight GB/s beside the copy bandwidth measured the same way as ``infer_bench.py``. One JSON
line per result; the last lines are the best launch per shape. From the repository root:

    PYTHONPATH=$(ls -d kernels/src packages/*/src | tr '\\n' ':') python tools/bench/bf16_gemv_bench.py
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from slipstream.kernels.ops import add_rms_norm, gated_activation
from slipstream.kernels.ops.decode_gemv import triton as kernel

SHAPES = {  # name: (out features, in features, prologue)
    "qkv": (6144, 4096, kernel.NORM),
    "out": (4096, 4096, kernel.PLAIN),
    "gate_up": (28672, 4096, kernel.NORM),
    "down": (4096, 14336, kernel.GATED),
    "lm_head": (128256, 4096, kernel.NORM),
}


def emit(**row: Any) -> None:
    print(json.dumps(row), flush=True)


def graph_time(calls: Sequence[Callable[[], Any]], replays: int) -> float:
    """Seconds per call: one CUDA graph of ``calls`` replayed ``replays`` times."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:  # warm-up (compiles, lazy inits) outside the capture
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--span-mib", type=int, default=512)
    parser.add_argument("--block-n", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--block-k", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument(
        "--programs-per-sm",
        type=int,
        nargs="+",
        default=[0, 4],
        help="0: one program per block of output features; n: a persistent grid of n per SM",
    )
    parser.add_argument(
        "--prefetch-max-block-k",
        type=int,
        default=512,
        help="launches with K steps up to this also run with the next tile prefetched",
    )
    parser.add_argument(
        "--stages", type=int, nargs="*", default=[], help="stages tried on the best launches"
    )
    parser.add_argument("--slots", type=int, nargs="*", default=[160, 384, 2048])
    parser.add_argument("--block-s", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--top", type=int, default=3, help="launches per shape tried per stage")
    args = parser.parse_args()
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    bandwidth = copy_bandwidth()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    emit(result="copy_bandwidth", gb_per_s=round(bandwidth / 1e9, 1), device=name, sms=sms)
    torch.manual_seed(0)
    best_rows = [bench_attention(slots, args) for slots in args.slots]
    best_rows += [bench_shape(shape, args, bandwidth) for shape in args.shapes]
    for row in best_rows:
        emit(**row)


def bench_attention(slots: int, args: argparse.Namespace) -> dict[str, Any]:
    """Decode attention of the 8B model at batch 1 (8 KV heads x 4 query rows, head_dim 128)
    over ``slots`` cache slots, 32 layers' caches: SDPA (what the unfused step runs) against
    ``decode_attention`` at each chunk size."""
    from slipstream.kernels.ops.decode_attention import triton as attention

    layers, kv_heads, rows, head_dim = 32, 8, 4, 128
    cache = torch.randn(2, layers, 1, kv_heads, slots, head_dim, device="cuda").bfloat16()
    query = torch.randn(1, kv_heads, rows, head_dim, device="cuda").bfloat16()
    visible = torch.arange(slots, device="cuda") < slots * 3 // 4  # a quarter still ahead
    mask = torch.zeros(1, 1, rows, slots, device="cuda", dtype=torch.bfloat16)
    mask.masked_fill_(~visible, float("-inf"))
    scale = head_dim**-0.5

    def sdpa(layer: int) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            query, cache[0, layer], cache[1, layer], attn_mask=mask, scale=scale
        )

    def split(layer: int, block_s: int | None, merge: bool) -> torch.Tensor:
        return attention.decode_attention(
            query, cache[0, layer], cache[1, layer], mask, scale, block_s=block_s, merge=merge
        )

    row = {"result": "attention", "slots": slots}
    sdpa_us = graph_time([functools.partial(sdpa, i) for i in range(layers)], args.replays) * 1e6
    emit(**row, variant="sdpa", us=round(sdpa_us, 2))
    best = (math.inf, 0, True)
    with torch.no_grad():
        for block_s, merge in itertools.product([None, *args.block_s], (True, False)):
            calls = [functools.partial(split, i, block_s, merge) for i in range(layers)]
            us = graph_time(calls, args.replays) * 1e6
            emit(**row, variant="decode_attention", block_s=block_s, merge=merge, us=round(us, 2))
            best = min(best, (us, block_s or 0, merge))
    return {
        "result": "best_attention",
        "slots": slots,
        "sdpa_us": round(sdpa_us, 2),
        "decode_attention_us": round(best[0], 2),
        "block_s": best[1] or "default",
        "merge_in_one_launch": best[2],
    }


def bench_shape(shape: str, args: argparse.Namespace, bandwidth: float) -> dict[str, Any]:
    """Every variant of one projection; returns its best Triton launch beside the unfused."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    n, k, prologue = SHAPES[shape]
    weight_bytes = n * k * 2
    copies = max(1, math.ceil(args.span_mib * 2**20 / weight_bytes))
    weights = [torch.randn(n, k, device=device, dtype=dtype) / k**0.5 for _ in range(copies)]
    x = torch.randn(1, 2 * k if prologue == kernel.GATED else k, device=device, dtype=dtype)
    residual = torch.randn(1, k, device=device, dtype=dtype)
    norm_weight = torch.randn(k, device=device, dtype=dtype)

    def record(variant: str, seconds: float, **extra: Any) -> dict[str, Any]:
        row = {
            "result": "gemv",
            "shape": shape,
            "n": n,
            "k": k,
            "variant": variant,
            "us": round(seconds * 1e6, 2),
            "gb_per_s": round(weight_bytes / seconds / 1e9, 1),
            "fraction_of_copy": round(weight_bytes / seconds / bandwidth, 3),
            **extra,
        }
        emit(**row)
        return row

    plain_x = x[:, :k] if prologue == kernel.GATED else x
    cublas = [functools.partial(F.linear, plain_x, w) for w in weights]
    record("cublas", graph_time(cublas, args.replays))

    def unfused_call(w: torch.Tensor) -> torch.Tensor:
        if prologue == kernel.NORM:
            return F.linear(add_rms_norm(x, residual, norm_weight, 1e-5)[1], w)
        if prologue == kernel.GATED:
            return F.linear(gated_activation(x), w)
        return F.linear(x, w)

    unfused = [functools.partial(unfused_call, w) for w in weights]
    baseline = record("unfused", graph_time(unfused, args.replays))

    def triton_calls(config: kernel.DecodeGemvConfig | None) -> list[Callable[[], Any]]:
        calls: list[Callable[[], Any]]
        if prologue == kernel.NORM:
            calls = [
                functools.partial(kernel.norm_gemv, x, residual, norm_weight, 1e-5, w, None, config)
                for w in weights
            ]
        elif prologue == kernel.GATED:
            calls = [functools.partial(kernel.gated_gemv, x, w, None, config) for w in weights]
        else:
            calls = [functools.partial(kernel.decode_gemv, x, w, None, config) for w in weights]
        return calls

    with torch.no_grad():
        default = kernel.default_config(n, k, device)
        record("triton_default", graph_time(triton_calls(None), args.replays), **vars(default))
        results = []
        for block_n, block_k, warps, per_sm, prefetch in itertools.product(
            args.block_n, args.block_k, args.warps, args.programs_per_sm, (False, True)
        ):
            if block_n * block_k > 16384:  # a larger fp32 accumulator spills registers
                continue
            if prefetch and block_k > args.prefetch_max_block_k:
                continue
            config = kernel.DecodeGemvConfig(
                block_n, block_k, warps, programs_per_sm=per_sm, prefetch=prefetch
            )
            try:
                seconds = graph_time(triton_calls(config), args.replays)
            except Exception as error:  # a launch that does not compile: say so, go on
                emit(result="error", shape=shape, config=vars(config), error=str(error)[:200])
                continue
            results.append((seconds, config))
            record("triton", seconds, **vars(config))
        results.sort(key=lambda item: item[0])
        for _, config in list(results[: args.top]):
            for stages in args.stages:
                staged = dataclasses.replace(config, num_stages=stages)
                seconds = graph_time(triton_calls(staged), args.replays)
                results.append((seconds, staged))
                record("triton", seconds, **vars(staged))
        results.sort(key=lambda item: item[0])
        seconds, config = results[0]
        if prologue != kernel.PLAIN:  # what the prologue costs: the same launch without it
            plain = [
                functools.partial(kernel.decode_gemv, x[:, :k], w, None, config) for w in weights
            ]
            record("triton_best_without_prologue", graph_time(plain, args.replays), **vars(config))
    return {
        "result": "best",
        "shape": shape,
        "unfused_us": baseline["us"],
        "triton_us": round(seconds * 1e6, 2),
        "speedup_vs_unfused": round(baseline["us"] / (seconds * 1e6), 3),
        "gb_per_s": round(weight_bytes / seconds / 1e9, 1),
        **vars(config),
    }


if __name__ == "__main__":
    main()
