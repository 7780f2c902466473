"""Benchmark an expert-parallel MoE layer against a dense MLP of equal active FLOPs.

Each rank feeds ``--tokens-per-rank`` tokens through (a) a :class:`slipstream.moe.MoE` layer with
``--experts`` standard FFN experts sharded over all ranks (ep_size = world size), top-``--top-k``
routing, and (b) a dense FFN whose hidden width is ``top_k · ffn_hidden`` (the FLOPs each token
spends in its k experts). Forward + backward are timed without the comms logger (its device syncs
cost overlap); a second, logged pass measures the MoE all-to-alls (dispatch and combine, forward
and backward) from :mod:`slipstream.comm`'s logger. Tokens/s are global (all ranks). Gradients are
not all-reduced: the comparison is the layer's compute and its all-to-all, nothing else.

With capacity_factor 1 each expert processes ``capacity = tokens · k / experts`` slots (padded
when under-used, dropped when over-full), so the MoE's matmul FLOPs equal the dense MLP's.

    torchrun --nproc_per_node 2 tools/bench/moe_bench.py                   # 8 experts, top-2, hidden 4096
    torchrun --nproc_per_node 2 tools/bench/moe_bench.py --no-drop        # capacity = busiest expert
    torchrun --nproc_per_node 2 tools/bench/moe_bench.py --device cpu --hidden 64 --tokens-per-rank 256

Without torch installed editable, put the sources on the path first:
``export PYTHONPATH=kernels/src:packages/comm/src:packages/moe/src``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from slipstream import comm
from slipstream.moe import FeedForwardExpert, MoE

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
A2A_RECORDS = ("moe_dispatch", "moe_combine", "moe_dispatch_backward", "moe_combine_backward")


def parse_args() -> argparse.Namespace:
    """Command-line options (defaults: the issue's 8 experts, top-2, hidden 4096)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn-mult", type=int, default=4, help="expert FFN width / hidden")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens-per-rank", type=int, default=8192)
    parser.add_argument("--capacity-factor", type=float, default=1.0)
    parser.add_argument("--no-drop", action="store_true", help="drop_tokens=False")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--device", choices=["auto", "cpu"], default="auto")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json-out", help="also write the results as JSON here (rank 0)")
    return parser.parse_args()


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Callable[[], None], steps: int, device: torch.device) -> float:
    """Seconds per call of `step`, averaged over `steps` calls after a barrier."""
    comm.barrier()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize(device)
    return (time.perf_counter() - start) / steps


def main() -> None:
    """Run both layers, print a table on rank 0 (and write JSON with ``--json-out``)."""
    args = parse_args()
    comm.init_distributed(dist_backend="gloo" if args.device == "cpu" else None, verbose=False)
    rank, world = comm.get_rank(), comm.get_world_size()
    if args.device == "cpu" or not torch.cuda.is_available():
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = DTYPES[args.dtype]
    ffn = args.ffn_mult * args.hidden
    torch.manual_seed(0)

    moe = MoE(
        args.hidden,
        FeedForwardExpert(args.hidden, ffn),
        num_experts=args.experts,
        ep_size=world,
        k=args.top_k,
        capacity_factor=args.capacity_factor,
        min_capacity=0,
        drop_tokens=not args.no_drop,
        use_rts=False,
    )
    # Experts and input in the benchmark dtype; the router stays float32 by design.
    moe.experts.to(device=device, dtype=dtype)
    moe.gate.to(device=device)
    dense = FeedForwardExpert(args.hidden, args.top_k * ffn).to(device=device, dtype=dtype)

    generator = torch.Generator(device=device).manual_seed(1 + rank)
    tokens = torch.randn(
        args.tokens_per_rank, args.hidden, device=device, dtype=dtype, generator=generator
    )
    tokens.requires_grad_(True)

    def moe_step() -> None:
        output, l_aux, _ = moe(tokens)
        (output.float().square().mean() + 0.01 * l_aux).backward()

    def dense_step() -> None:
        dense(tokens).float().square().mean().backward()

    results: dict[str, float | int | str] = {}
    for name, step in (("dense", dense_step), ("moe", moe_step)):
        for _ in range(args.warmup):
            step()
        seconds = time_steps(step, args.steps, device)
        results[f"{name}_step_ms"] = seconds * 1e3
        results[f"{name}_tokens_per_s"] = args.tokens_per_rank * world / seconds

    comm.comms_logger.reset()
    comm.comms_logger.configure(enabled=True, prof_all=True)
    logged_seconds = time_steps(moe_step, args.steps, device)
    comm.comms_logger.configure(enabled=False)
    records = comm.comms_logger.records
    a2a_total = sum(
        stats.total_latency_s for name in A2A_RECORDS for stats in records.get(name, {}).values()
    )
    a2a_bytes = sum(
        stats.total_bytes for name in A2A_RECORDS for stats in records.get(name, {}).values()
    )
    results["moe_all_to_all_ms_per_step"] = a2a_total / args.steps * 1e3
    results["moe_all_to_all_MiB_per_step"] = a2a_bytes / args.steps / 2**20
    results["moe_logged_step_ms"] = logged_seconds * 1e3
    results["moe_all_to_all_share_of_logged_step"] = a2a_total / args.steps / logged_seconds
    gate = moe.last_gate
    assert gate is not None
    results["capacity"] = gate.capacity
    results["dropped_fraction"] = float(gate.num_dropped) / (args.tokens_per_rank * args.top_k)
    results["moe_speed_vs_dense"] = results["moe_tokens_per_s"] / results["dense_tokens_per_s"]  # type: ignore[operator]
    results["config"] = (
        f"world={world} hidden={args.hidden} ffn={ffn} experts={args.experts} k={args.top_k} "
        f"tokens/rank={args.tokens_per_rank} cf={args.capacity_factor} "
        f"drop={not args.no_drop} dtype={args.dtype} device={device.type}"
    )

    if rank == 0:
        print(results["config"])
        for key, value in results.items():
            if key != "config":
                print(
                    f"  {key:<40} {value:.4g}"
                    if isinstance(value, float)
                    else f"  {key:<40} {value}"
                )
        print(comm.comms_logger.format_summary())
        if args.json_out:
            with open(args.json_out, "w") as handle:
                json.dump(results, handle, indent=2)
    comm.destroy()


if __name__ == "__main__":
    main()
