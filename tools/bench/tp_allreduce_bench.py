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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--calls", type=int, default=64)
    parser.add_argument("--replays", type=int, default=20)
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
