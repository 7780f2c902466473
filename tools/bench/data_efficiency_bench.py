"""Data efficiency benchmark: a small GPT trained with and without seqlen curriculum + random-LTD.

Both runs use the same model, seed, data order and training-token budget (tokens the model
reads; the curriculum run takes more, shorter steps early on). Every ``--eval-every`` steps the
validation loss is measured at the full sequence length (outside the timed region); the report
gives each run's training wall-clock to reach ``--target-loss`` (default: the higher of the two
final validation losses, which both runs reach), tokens/s, and the data-efficiency run's time as
a fraction of the baseline's.

    # GPU (about 4 minutes on one H100): a 12-layer, 768-wide byte-level GPT, seq 512
    python tools/bench/data_efficiency_bench.py
    # CPU smoke run of the harness (a minute)
    python tools/bench/data_efficiency_bench.py --size tiny --seq 64 --micro-batch 8 \\
        --token-budget 200000 --eval-every 20

Without the packages installed, put the sources on the path first:
``export PYTHONPATH=$(ls -d kernels/src packages/*/src | tr '\\n' ':')``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama import Block, Llama, LlamaShape

import slipstream
from slipstream.data import convert_to_random_ltd
from slipstream.examples.corpus import generate

SIZES = {
    "tiny": LlamaShape(hidden=64, layers=4, heads=4, ffn=128, vocab=256),
    "small": LlamaShape(hidden=512, layers=8, heads=8, ffn=1408, vocab=256),
    "base": LlamaShape(hidden=768, layers=12, heads=12, ffn=2048, vocab=256),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (defaults: the GPU run of the report)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="base")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--token-budget", type=int, default=40_000_000)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--target-loss", type=float, default=None)
    parser.add_argument(
        "--curriculum-fraction",
        type=float,
        default=0.3,
        help="share of the baseline's steps over which the seqlen grows",
    )
    parser.add_argument(
        "--ltd-fraction",
        type=float,
        default=0.6,
        help="share of the baseline's steps over which random-LTD's kept tokens grow",
    )
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--only", choices=["baseline", "data_efficiency"], default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    return parser.parse_args(argv)  # fmt: skip


def _windows(data: torch.Tensor, seq: int) -> torch.Tensor:
    count = (data.numel() - 1) // seq
    return torch.stack([data[i * seq : i * seq + seq + 1] for i in range(count)])


def _config(args: argparse.Namespace, baseline_steps: int, efficient: bool) -> dict[str, Any]:
    on_gpu = torch.cuda.is_available()
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "bf16": {"enabled": on_gpu},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.1}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_num_steps": max(baseline_steps // 20, 1), "warmup_max_lr": args.lr},
        },
    }
    if not efficient:
        return config
    step = 8 if args.seq >= 64 else 4
    config["curriculum_learning"] = {
        "enabled": True,
        "curriculum_type": "seqlen",
        "min_difficulty": step,
        "max_difficulty": args.seq,
        "schedule_type": "fixed_linear",
        "schedule_config": {
            "total_curriculum_step": max(int(baseline_steps * args.curriculum_fraction), 1),
            "difficulty_step": step,
        },
    }
    layers = SIZES[args.size].layers
    middle = list(range(1, layers - 1))  # first and last layers keep every token
    config["data_efficiency"] = {
        "enabled": True,
        "seed": args.seed,
        "data_routing": {
            "enabled": True,
            "random_ltd": {
                "enabled": True,
                "total_layer_num": layers,
                "random_ltd_layer_num": len(middle),
                "random_ltd_layer_id": middle,
                "model_mask_name": None,
                "model_type": "decoder",
                "hidden_state_order": "batch_seq_dim",
                "random_ltd_schedule": {
                    "min_value": max(args.seq // 4, step),
                    "max_value": args.seq,
                    "schedule_type": "fixed_linear",
                    "schedule_config": {
                        "require_steps": max(int(baseline_steps * args.ltd_fraction), 1),
                        "seq_per_step": step,
                    },
                },
            },
        },
    }
    return config


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@torch.no_grad()
def _validate(engine: Any, valid: torch.Tensor, args: argparse.Namespace) -> float:
    engine.module.eval()
    losses = []
    for i in range(args.eval_batches):
        batch = valid[i * args.micro_batch : (i + 1) * args.micro_batch].to(engine.device)
        losses.append(float(engine(batch[:, :-1], batch[:, 1:])))
    engine.module.train()
    return sum(losses) / len(losses)


def run(
    args: argparse.Namespace, train: torch.Tensor, valid: torch.Tensor, efficient: bool
) -> dict[str, Any]:
    """One training run; returns its validation curve over training time and its rates."""
    tokens_per_full_step = args.micro_batch * args.seq
    baseline_steps = math.ceil(args.token_budget / tokens_per_full_step)
    torch.manual_seed(args.seed)
    model = Llama(SIZES[args.size])
    if efficient:
        convert_to_random_ltd(model, Block)
    engine, *_ = slipstream.initialize(model=model, config=_config(args, baseline_steps, efficient))
    order = torch.randperm(train.shape[0], generator=torch.Generator().manual_seed(args.seed))
    tokens, step, train_seconds = 0, 0, 0.0
    curve: list[tuple[int, int, float, float]] = []  # (step, tokens, seconds, val loss)
    while tokens < args.token_budget:
        start = (step * args.micro_batch) % (train.shape[0] - args.micro_batch)
        batch = train[order[start : start + args.micro_batch]].to(engine.device)
        _sync()
        began = time.perf_counter()
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        _sync()
        train_seconds += time.perf_counter() - began
        step += 1
        seqlen = engine.data_efficiency.curriculum_difficulty() if efficient else args.seq
        tokens += args.micro_batch * int(seqlen or args.seq)
        if step % args.eval_every == 0 or tokens >= args.token_budget:
            curve.append((step, tokens, train_seconds, _validate(engine, valid, args)))
            print(
                f"{'data-eff' if efficient else 'baseline'} step {step} tokens {tokens} "
                f"train {train_seconds:.1f}s val {curve[-1][3]:.4f}",
                flush=True,
            )
    engine.destroy()
    return {
        "steps": step,
        "tokens": tokens,
        "train_seconds": train_seconds,
        "tokens_per_second": tokens / train_seconds,
        "final_val_loss": curve[-1][3],
        "curve": curve,
    }


def _time_to(curve: list[tuple[int, int, float, float]], target: float) -> float | None:
    for _, _, seconds, loss in curve:
        if loss <= target:
            return seconds
    return None


def main(argv: list[str] | None = None) -> int:
    """Run both configurations and print a markdown table."""
    args = parse_args(argv)
    data = torch.frombuffer(bytearray(generate(num_bytes=8_000_000)), dtype=torch.uint8).long()
    windows = _windows(data, args.seq)
    held_out = args.eval_batches * args.micro_batch
    train, valid = windows[:-held_out], windows[-held_out:]
    results: dict[str, Any] = {}
    for name in ("baseline", "data_efficiency"):
        if args.only in (None, name):
            results[name] = run(args, train, valid, efficient=name == "data_efficiency")
    target = args.target_loss
    if target is None and results:
        target = max(result["final_val_loss"] for result in results.values())
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(
        f"\n{args.size} GPT (byte vocab), seq {args.seq}, micro-batch {args.micro_batch}, "
        f"budget {args.token_budget:,} tokens, seed {args.seed}, {device}; "
        f"target validation loss {target:.4f}\n"
        if target is not None
        else ""
    )
    print("| run | steps | tokens/s | final val loss | time to target (s) |")
    print("|---|---|---|---|---|")
    for name, result in results.items():
        reached = _time_to(result["curve"], target) if target is not None else None
        result["time_to_target"] = reached
        print(
            f"| {name} | {result['steps']} | {result['tokens_per_second']:,.0f} | "
            f"{result['final_val_loss']:.4f} | "
            f"{'not reached' if reached is None else f'{reached:.1f}'} |"
        )
    if len(results) == 2 and target is not None:
        base, eff = (
            results["baseline"]["time_to_target"],
            results["data_efficiency"]["time_to_target"],
        )
        if base and eff:
            print(f"\ndata efficiency reaches the target in {eff / base:.2f}x the baseline's time")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "target": target, "results": results}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
