"""Microseconds per tensor-parallel sum at decode sizes, inside a CUDA graph, on 2+ GPUs.

Each variant runs ``--calls`` dependent calls captured in one CUDA graph (as the decode step
captures its 64 sums), replayed ``--replays`` times; the time per call is reported:

- ``nccl``: ``torch.distributed.all_reduce``;
- ``torch``: ``torch.ops.symm_mem``'s one-shot kernel (``symm_mem_kernel: "torch"``);
- ``slipstream``: ``slipstream.inference.allreduce_norm`` (``symm_mem_kernel: "slipstream"``);

each as a sum alone (``op: "sum"``) and as a sum followed by the residual add + RMSNorm
(``op: "sum_add_norm"``: ``add_rms_norm`` after the sum, one fused kernel for ``slipstream``),
beside ``add_rms_norm`` alone (no communication) as the floor::

    PYTHONPATH=$(ls -d kernels/src packages/*/src | tr '\\n' ':') \\
        torchrun --nproc_per_node 2 tools/bench/tp_allreduce_bench.py --rows 1 32

``--layers N``: instead, the batch-1 decode GEMVs of N blocks of an 8B Llama split over the
ranks (QKV norm GEMV, output GEMV, sum, gate/up norm GEMV, gated down GEMV, sum; every block
its own weights, no attention) in one CUDA graph, without the sums (the GEMVs alone: the
floor) and with Slipstream's sum kernel; microseconds per block each, and what each sum costs
over the floor (``tp_layer_us``)::

    torchrun --nproc_per_node 2 tools/bench/tp_allreduce_bench.py --layers 32
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.inference.allreduce import TPReducer
from slipstream.kernels.ops import add_rms_norm


def graph_time_us(fn: Callable[[], Any], calls: int, replays: int) -> float:
    """Microseconds per ``fn()`` call: ``calls`` calls in one CUDA graph, best of ``replays``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    best = float("inf")
    for _ in range(replays):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / calls)
    return best


def measure(
    rows: int, hidden: int, reducers: dict[str, TPReducer], calls: int, replays: int
) -> list[tuple[str, str, float]]:
    """``(kernel, op, microseconds per call)`` of every variant at ``rows`` x ``hidden``."""
    device = torch.device("cuda", torch.cuda.current_device())
    dtype = torch.bfloat16
    weight = torch.ones(hidden, dtype=dtype, device=device)
    x = torch.randn(rows, hidden, dtype=dtype, device=device) / 64
    state = {"r": torch.randn(rows, hidden, dtype=dtype, device=device)}

    def floor() -> None:
        state["r"] = add_rms_norm(x, state["r"], weight, 1e-5)[0]

    out = [("none", "add_norm", graph_time_us(floor, calls, replays))]
    for name, reducer in reducers.items():
        in_place = reducer.kind == "nccl"  # NCCL sums in place: a copy first

        def only_sum(reducer: TPReducer = reducer, in_place: bool = in_place) -> None:
            reducer(x.clone() if in_place else x)

        def sum_add_norm(reducer: TPReducer = reducer, in_place: bool = in_place) -> None:
            part = x.clone() if in_place else x
            state["r"] = reducer.add_rms_norm(part, state["r"], weight, 1e-5)[0]

        out.append((name, "sum", graph_time_us(only_sum, calls, replays)))
        out.append((name, "sum_add_norm", graph_time_us(sum_add_norm, calls, replays)))
    return out


LLAMA_8B = {"hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "ffn": 14336}


def measure_layers(layers: int, reducer: TPReducer, replays: int) -> list[tuple[str, float]]:
    """``(variant, microseconds per block)`` of ``layers`` decode blocks' GEMVs and sums."""
    from slipstream.kernels.ops.decode_gemv.triton import (
        GATED,
        NORM,
        PLAIN,
        decode_gemv,
        gated_gemv,
        launch_config,
        norm_gemv,
    )

    world = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    shape = LLAMA_8B
    hidden, hd = shape["hidden"], shape["head_dim"]
    q_out = shape["heads"] * hd // world
    qkv_out = q_out + 2 * max(shape["kv_heads"] // world, 1) * hd
    ffn = shape["ffn"] // world
    generator = torch.Generator(device=device).manual_seed(dist.get_rank())

    def weight(n: int, k: int) -> torch.Tensor:
        w = torch.randn(n, k, device=device, generator=generator, dtype=torch.bfloat16)
        return w / 64

    blocks = [
        (weight(qkv_out, hidden), weight(hidden, q_out), weight(2 * ffn, hidden), weight(hidden, ffn))
        for _ in range(layers)
    ]  # fmt: skip
    norm_weight = torch.ones(hidden, device=device, dtype=torch.bfloat16)
    x0 = torch.randn(1, hidden, device=device, dtype=torch.bfloat16)
    launches = {
        "qkv": launch_config(NORM, qkv_out, hidden, device),
        "out": launch_config(PLAIN, hidden, q_out, device),
        "up": launch_config(NORM, 2 * ffn, hidden, device),
        "down": launch_config(GATED, hidden, ffn, device),
    }

    def step(sums: bool) -> None:
        cfg = launches
        x, pending = x0, None
        for w_qkv, w_out, w_up, w_down in blocks:
            x, qkv = norm_gemv(x, pending, norm_weight, 1e-5, w_qkv, config=cfg["qkv"])
            part = decode_gemv(qkv[:, :q_out], w_out, config=cfg["out"])
            total = reducer(part) if sums else part
            x, up = norm_gemv(x, total, norm_weight, 1e-5, w_up, config=cfg["up"])
            part = gated_gemv(up, w_down, config=cfg["down"])
            pending = reducer(part) if sums else part

    out = []
    for name, sums in (("gemvs_only", False), ("sum", True)):
        us = graph_time_us(lambda s=sums: step(s), 1, replays)
        out.append((name, us / layers))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--calls", type=int, default=64)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument(
        "--layers", type=int, default=0, help="time N decode blocks' GEMVs and sums (see above)"
    )
    args = parser.parse_args()
    comm.init_distributed("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    dtype = torch.bfloat16
    reducers = {"nccl": TPReducer(None)}
    for kernel in ("torch", "slipstream"):
        reducer = TPReducer(None)
        why = reducer.setup_symm_mem(device, dtype, 1 << 21, kernel)
        if why or (kernel == "slipstream" and reducer.norm_state is None):
            why = why or reducer.norm_why
            print(json.dumps({"result": "skipped", "rank": rank, "kernel": kernel, "why": why}))
            continue
        reducers[kernel] = reducer
    if args.layers:
        slipstream = reducers.get("slipstream")
        if slipstream is None:
            raise SystemExit("--layers needs Slipstream's sum kernel (see the skipped line)")
        results = measure_layers(args.layers, slipstream, args.replays)
        floor = dict(results)["gemvs_only"]
        for name, us in results:
            if rank == 0:
                row = {"result": "tp_layer_us", "variant": name, "us_per_block": round(us, 2)}
                if name.startswith("sum"):
                    row["us_per_sum_over_floor"] = round((us - floor) / 2, 2)
                row.update(world=world, device=torch.cuda.get_device_name(device))
                print(json.dumps(row), flush=True)
        errors = int(slipstream.norm_state.error.item()) if slipstream.norm_state else 0
        if errors:
            print(json.dumps({"result": "error", "rank": rank, "wait_gave_up": errors}))
        args.rows = []
    for rows in args.rows:
        rows_out = measure(rows, args.hidden, reducers, args.calls, args.replays)
        if rank == 0:
            for kernel, op, us in rows_out:
                print(
                    json.dumps(
                        {
                            "result": "tp_sum_us",
                            "kernel": kernel,
                            "op": op,
                            "us_per_call": round(us, 2),
                            "rows": rows,
                            "hidden": args.hidden,
                            "world": world,
                            "device": torch.cuda.get_device_name(device),
                        }
                    ),
                    flush=True,
                )
        errors = {k: int(r.norm_state.error.item()) for k, r in reducers.items() if r.norm_state}
        if any(errors.values()):
            print(json.dumps({"result": "error", "rank": rank, "wait_gave_up": errors}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    main()
