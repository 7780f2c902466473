"""Microseconds per tensor-parallel decoder layer (its GEMVs and sums, no attention) at batch 1.

Each variant runs ``--layers`` layers of Llama-3-8B shapes split over the ranks (QKV and gate/up
column-parallel, output and down row-parallel, distinct weights per layer so that they stream
from memory) captured in one CUDA graph, replayed ``--replays`` times; the time per layer is
reported, with the weight bytes streamed per second per GPU:

- ``unfused``: cuBLAS GEMVs, SwiGLU, and Slipstream's sum + add + RMSNorm kernel
  (``decode_fusion: false``);
- ``fused``: the decode GEMVs with the add + RMSNorm / SwiGLU fused in, one sum kernel per sum
  (``decode_fusion: true, tensor_parallel.gemv_push: false``);
- ``push``: the row-parallel GEMVs push their partial sums, the norm GEMVs pull them
  (``gemv_push: true``), with the default launches and with a few others for the pulling GEMVs
  (``push:pull_block_n=..``, ``push:pull_programs_per_sm=..``, ``push:push_block_n=..``,
  ``push:prefetch``: the first weight tile requested before the wait for the peers).

The attention's input is stood in by a slice of the QKV output. ``fused`` and ``push`` must end
with the same residual (printed as ``max_diff``)::

    PYTHONPATH=$(ls -d kernels/src packages/*/src | tr '\\n' ':') \\
        torchrun --nproc_per_node 2 tools/bench/tp_push_bench.py
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from slipstream import comm
from slipstream.inference.allreduce import TPReducer
from slipstream.inference.tp_decode import (
    GATED,
    PLAIN,
    PushState,
    pull_norm_gemv,
    push_gemv,
    symmetric_push_state,
)
from slipstream.kernels.ops import decode_gemv, gated_activation, gated_gemv, norm_gemv
from slipstream.kernels.ops.decode_gemv.triton import default_config


def graph_time_us(fn: Callable[[], Any], replays: int) -> float:
    """Microseconds per ``fn()``, captured in one CUDA graph, best of ``replays`` replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
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
        best = min(best, start.elapsed_time(end) * 1e3)
    return best


@dataclasses.dataclass
class Layer:
    """One layer's shards and norm weights."""

    qkv: torch.Tensor
    out: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    norm: torch.Tensor
    post: torch.Tensor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--qkv", type=int, default=6144, help="QKV output features (whole)")
    args = parser.parse_args()
    comm.init_distributed("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    dtype = torch.bfloat16
    hidden, inter = args.hidden, args.intermediate // world
    heads_width = (args.qkv * 2 // 3) // world  # the attention output's (query heads') width
    generator = torch.Generator(device=device).manual_seed(rank + 1)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device=device, generator=generator) * 0.02).to(dtype)

    layers = [
        Layer(
            rand(args.qkv // world, hidden),
            rand(hidden, heads_width),
            rand(2 * inter, hidden),
            rand(hidden, inter),
            1 + rand(hidden),
            1 + rand(hidden),
        )
        for _ in range(args.layers)
    ]
    layer_bytes = sum(
        t.numel() * t.element_size()
        for t in (layers[0].qkv, layers[0].out, layers[0].up, layers[0].down)
    )
    reducer = TPReducer(None)
    why = reducer.setup_symm_mem(device, dtype, 1 << 21, "slipstream")
    assert not why and reducer.norm_state is not None, why or reducer.norm_why
    state, why = symmetric_push_state(None, device, 2 * args.layers, hidden)
    assert state is not None, why
    same = torch.Generator(device=device).manual_seed(0)  # the residual: the same on every rank
    x0 = torch.randn(1, hidden, device=device, generator=same).to(dtype)
    results: dict[str, torch.Tensor] = {}

    def unfused() -> None:
        x, h = x0, F.rms_norm(x0.float(), (hidden,)).to(dtype)
        for layer in layers:
            qkv = F.linear(h * layer.norm, layer.qkv)
            attn = qkv[:, :heads_width].contiguous()  # the attention's stand-in
            x, h = reducer.add_rms_norm(F.linear(attn, layer.out), x, layer.post, 1e-5)
            down = F.linear(gated_activation(F.linear(h, layer.up), "silu"), layer.down)
            x, h = reducer.add_rms_norm(down, x, layer.norm, 1e-5)
        results["unfused"] = x

    def fused() -> None:
        x, pending = x0, None
        for layer in layers:
            x, qkv = norm_gemv(x, pending, layer.norm, 1e-5, layer.qkv)
            attn = decode_gemv(qkv[:, :heads_width].contiguous(), layer.out)
            x, up = norm_gemv(x, reducer(attn), layer.post, 1e-5, layer.up)
            pending = reducer(gated_gemv(up, layer.down))
        assert pending is not None
        results["fused"] = x + pending

    def pushed(name: str, push_state: PushState) -> Callable[[], None]:
        def run() -> None:
            push_state.begin_step()
            x, partial, site = x0, None, -1
            for layer in layers:
                if partial is None:
                    x, qkv = norm_gemv(x, None, layer.norm, 1e-5, layer.qkv)
                else:
                    x, qkv = pull_norm_gemv(
                        push_state, site, x, partial, layer.norm, 1e-5, layer.qkv
                    )
                site += 1
                attn = qkv[:, :heads_width].contiguous()
                partial = push_gemv(push_state, site, PLAIN, attn, layer.out)
                x, up = pull_norm_gemv(push_state, site, x, partial, layer.post, 1e-5, layer.up)
                site += 1
                partial = push_gemv(push_state, site, GATED, up, layer.down)
            assert partial is not None
            results[name] = x + reducer(partial)  # the last sum, to compare with `fused`

        return run

    variants: dict[str, Callable[[], None]] = {"unfused": unfused, "fused": fused}
    variants["push"] = pushed("push", state)
    shapes = {  # (out_features, in_features): pulls
        (args.qkv // world, hidden): True,
        (hidden, heads_width): False,
        (2 * inter, hidden): True,
        (hidden, inter): False,
    }
    tweaks: dict[str, Callable[[Any, bool], Any]] = {
        "push:pull_block_n=x2": lambda c, pulls: (
            dataclasses.replace(c, block_n=2 * c.block_n) if pulls else c
        ),
        "push:pull_programs_per_sm=2": lambda c, pulls: (
            dataclasses.replace(c, programs_per_sm=2) if pulls else c
        ),
        "push:pull_programs_per_sm=4": lambda c, pulls: (
            dataclasses.replace(c, programs_per_sm=4) if pulls else c
        ),
        "push:push_block_n=x2": lambda c, pulls: (
            c if pulls else dataclasses.replace(c, block_n=2 * c.block_n)
        ),
        "push:prefetch": lambda c, pulls: dataclasses.replace(c, prefetch=True),
        "push:pull_prefetch": lambda c, pulls: dataclasses.replace(c, prefetch=pulls),
    }
    for name, tweak in [*tweaks.items(), ("push:pull_row_in_registers", lambda c, pulls: c)]:
        variant_state = PushState(
            state.recv, state.recv_ptrs, rank, world, state.sites, state.region_words
        )
        variant_state.step = state.step  # one counter: the regions are shared
        variant_state.error = state.error
        variant_state.row_in_registers = name == "push:pull_row_in_registers"
        for (out_features, in_features), pulls in shapes.items():
            base = default_config(out_features, in_features, device)
            variant_state.configs[(out_features, in_features, pulls)] = tweak(base, pulls)
        variants[name] = pushed(name, variant_state)
    for name, fn in variants.items():
        try:
            micros = graph_time_us(fn, args.replays) / args.layers
            torch.cuda.synchronize()
        except Exception as error:  # one variant's failure (a compile) must not end the rest
            if rank == 0:
                print(json.dumps({"variant": name, "failed": str(error)[:300]}), flush=True)
            continue
        row: dict[str, Any] = {
            "variant": name,
            "world": world,
            "us_per_layer": round(micros, 2),
            "weight_gb_per_s_per_gpu": round(layer_bytes / micros / 1e3, 1),
            "ms_per_32_layers": round(micros * 32 / 1e3, 3),
        }
        if name.startswith("push") and name in results and "fused" in results:
            diff = (results[name].float() - results["fused"].float()).abs().max().item()
            row["max_diff_vs_fused"] = diff
        if rank == 0:
            print(json.dumps(row), flush=True)
    if rank == 0:
        print(json.dumps({"push_error_flag": int(state.error.item())}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
