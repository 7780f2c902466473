"""Pipeline-parallel training throughput per schedule (the 1.3b model of BENCHMARKS.md, PP=2).

Run on two GPUs of one machine:

    torchrun --nproc_per_node 2 tools/bench/pipeline_bench.py
    torchrun --nproc_per_node 2 tools/bench/pipeline_bench.py --schedules 1f1b zero_bubble \
        --micro-batch 4 --micro-batches 8

Without installing, put the sources on the path first:
``export PYTHONPATH=kernels/src:packages/comm/src:packages/pipeline/src``. A CPU smoke run:
``torchrun --nproc_per_node 2 tools/bench/pipeline_bench.py --model tiny --steps 2 --warmup 1``.

Model: Llama-style decoder (pre-norm RMSNorm, fused QKV, causal SDPA, SwiGLU, no biases, untied
embedding and head, vocab 32000, sequence 2048), fp32 weights and AdamW (fused on GPU), bf16
autocast, cross-entropy in fp32: the setting of the DDP row of BENCHMARKS.md. Each schedule
trains ``--warmup`` untimed steps, then ``--steps`` timed ones on a fixed batch. FLOPs per
token = 6·N + 12·L·hidden·seq (attention counted in full). Printed per schedule: tokens/s over
the whole pipeline, TFLOP/s per GPU, peak GiB per GPU (the larger of the two stages), and the
step time.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.pipeline import PipelineModule, build_executor, build_schedule
from slipstream.pipeline.models import decoder_layer_specs, language_model_loss
from slipstream.pipeline.runtime import train_batch

MODELS = {
    # name: (hidden, layers, heads, ffn, vocab, seq)
    "1.3b": (2048, 24, 16, 5504, 32000, 2048),
    "7b": (4096, 32, 32, 11008, 32000, 2048),
    "tiny": (64, 4, 4, 128, 256, 32),
}


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="1.3b")
    parser.add_argument(
        "--schedules",
        nargs="+",
        default=["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"],
    )
    parser.add_argument("--micro-batch", type=int, default=4, help="samples per micro-batch")
    parser.add_argument("--micro-batches", type=int, default=8, help="micro-batches per step")
    parser.add_argument(
        "--virtual-stages", type=int, default=2, help="chunks per GPU (interleaved)"
    )
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--activation-checkpoint-interval", type=int, default=0)
    return parser.parse_args()


def _bench_one(args: argparse.Namespace, name: str, device: torch.device) -> dict[str, float]:
    hidden, layers, heads, ffn, vocab, seq = MODELS[args.model]
    world = dist.get_world_size()
    virtual = args.virtual_stages if name == "interleaved_1f1b" else 1
    specs = decoder_layer_specs(vocab, hidden, layers, heads, ffn)
    with torch.device(device):  # build each stage's layers directly on its GPU
        module = PipelineModule(
            specs,
            num_stages=world,
            loss_fn=language_model_loss,
            partition_method="parameters",
            virtual_stages=virtual,
            activation_checkpoint_interval=args.activation_checkpoint_interval,
        )
    on_gpu = device.type == "cuda"
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4, fused=on_gpu or None)
    executor = build_executor(module, device, autocast_dtype=torch.bfloat16 if on_gpu else None)
    schedule = build_schedule(name, world, args.micro_batches, virtual)
    gen = torch.Generator().manual_seed(0)
    batch = [
        (
            torch.randint(0, vocab, (args.micro_batch, seq), generator=gen).to(device),
            torch.randint(0, vocab, (args.micro_batch, seq), generator=gen).to(device),
        )
        for _ in range(args.micro_batches)
    ]

    def step() -> None:
        train_batch(executor, schedule, iter(batch), optimizer, max_grad_norm=1.0)

    for _ in range(args.warmup):
        step()
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    if on_gpu:
        torch.cuda.synchronize()
    dist.barrier()
    elapsed = (time.perf_counter() - start) / args.steps

    # Parameters of the whole model (each stage counts its own; one pipeline, no replicas).
    local = torch.tensor([float(sum(p.numel() for p in module.parameters()))], device=device)
    dist.all_reduce(local)
    n_params = local.item()
    peak = torch.tensor(
        [torch.cuda.max_memory_allocated(device) / 2**30 if on_gpu else 0.0], device=device
    )
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    tokens_per_step = args.micro_batch * args.micro_batches * seq
    tokens_per_s = tokens_per_step / elapsed
    flops_per_token = 6 * n_params + 12 * layers * hidden * seq
    return {
        "step_s": elapsed,
        "tokens_per_s": tokens_per_s,
        "tflops_per_gpu": tokens_per_s * flops_per_token / world / 1e12,
        "peak_gib": peak.item(),
        "params": n_params,
    }


def main() -> None:
    args = _parse()
    comm.init_distributed(verbose=False)
    rank = dist.get_rank()
    device = (
        torch.device("cuda", comm.get_local_rank())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    if rank == 0:
        print(
            f"model {args.model}, PP={dist.get_world_size()}, micro-batch {args.micro_batch} × "
            f"{args.micro_batches} micro-batches, {args.steps} timed steps after {args.warmup}",
            flush=True,
        )
        print(f"{'schedule':<18}{'step s':>9}{'tokens/s':>12}{'TFLOP/s/GPU':>13}{'peak GiB':>10}")
    for name in args.schedules:
        result = _bench_one(args, name, device)
        gc.collect()  # the previous schedule's model and optimizer are garbage now
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if rank == 0:
            print(
                f"{name:<18}{result['step_s']:>9.3f}{result['tokens_per_s']:>12,.0f}"
                f"{result['tflops_per_gpu']:>13.1f}{result['peak_gib']:>10.1f}",
                flush=True,
            )
    comm.destroy()


if __name__ == "__main__":
    main()
