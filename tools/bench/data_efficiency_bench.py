"""Data efficiency benchmark: a byte-level GPT trained with and without seqlen curriculum + random-LTD.

Every run uses the same model, seed and data order; its LR follows linear warmup then cosine
over its own token budget, as a function of the tokens read. The comparison is at equal
validation loss, as DeepSpeed's data-efficiency papers make it, with both arms tuned:

1. **Baseline LR sweep** (``--lrs``) over the full budget; the best final validation loss is
   the target (``--target-loss`` overrides it).
2. **Data-efficiency LR sweep** (``--de-lrs``) at the first of ``--de-budget-fractions`` (a
   data-efficiency arm may be given fewer tokens: its LR, curriculum and random-LTD schedules
   then span its own, shorter budget), then the other fractions at its best LR.
3. **Controls** (``--controls on``): the baseline at its best LR on each reduced budget, so a
   win from simply training a shorter schedule is not credited to data efficiency.

The verdict divides the fastest data-efficiency run's training time to the target by the
fastest baseline-family run's (sweep and controls), at validation points every
``--eval-every`` steps (validation is not timed; goal of issue 28: <= 0.7). A run whose
validation loss goes non-finite or doubles is stopped as diverged.

The data-efficiency arm follows DeepSpeed's recipe for GPT pretraining, bucketed for the GPU:

* seqlen curriculum, ``fixed_root`` (square root) from ``--cl-min`` (64) tokens to the full
  length over ``--curriculum-fraction`` of its steps, ``difficulty_step`` 64 (so there are
  only seq/64 distinct shapes). The model takes ``curriculum_seqlen`` and folds each row into
  seq/c rows of c tokens (``--curriculum-mode fold``, the default: every step reads the same
  tokens as a baseline step, with a shorter context), or the engine truncates the batch as
  DeepSpeed's legacy curriculum does (``--curriculum-mode truncate``);
* random-LTD in every layer but the first and last, keeping ``--ltd-min`` (128) tokens at first
  and rising linearly to the full length over ``--ltd-fraction`` of its steps, in multiples of
  64 (``seq_per_step``). A layer drops nothing while the curriculum's length is at or below
  the kept count.

Before timing, each run does one forward/backward per distinct shape of its schedule on a
throwaway copy of the model (cuBLAS/cuDNN plans, allocator), so one-time warmup is out of
every clock. Without ``--token-budget``, a short probe of the baseline's rate sizes the budget
so that a baseline run trains for about ``--baseline-seconds``.

    # GPU (one H100, about 5 minutes): a 24-layer, 1024-wide byte-level GPT (~300M), seq 512,
    # on Python's standard library source (held-out files for validation); 4 + 3 LRs
    python tools/bench/data_efficiency_bench.py --baseline-seconds 25 --eval-every 15 \\
        --eval-batches 4 --lrs 6e-4,1.2e-3,2.4e-3,4.8e-3 --de-lrs 1.2e-3,2.4e-3,4.8e-3 \\
        --de-budget-fractions 0.7,1.0 --de-lr-clock layer-tokens
    # CPU smoke run of the harness (under a minute)
    python tools/bench/data_efficiency_bench.py --size tiny --seq 128 --micro-batch 4 \\
        --token-budget 40960 --eval-every 20 --eval-batches 2 --corpus-bytes 2000000 \\
        --lrs 1e-3,3e-3 --de-lrs 3e-3,6e-3 --de-budget-fractions 0.7,1.0

Without the packages installed, put the sources on the path first:
``export PYTHONPATH=$(ls -d kernels/src packages/*/src | tr '\\n' ':')``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import sys
import sysconfig
import time
import zlib
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama import SHAPES, Block, Llama, LlamaShape

import slipstream
from slipstream.data import (
    RandomLTDConfig,
    RandomLTDScheduler,
    attach_random_ltd,
    convert_to_random_ltd,
)
from slipstream.examples.corpus import generate

SIZES = {
    "tiny": LlamaShape(hidden=64, layers=4, heads=4, ffn=128, vocab=256),
    "small": LlamaShape(hidden=512, layers=8, heads=8, ffn=1408, vocab=256),
    "base": LlamaShape(hidden=768, layers=12, heads=12, ffn=2048, vocab=256),
    "medium": LlamaShape(hidden=1024, layers=24, heads=16, ffn=2816, vocab=256),
    "1.3b": dataclasses.replace(SHAPES["1.3b"], vocab=256),
}
BUCKET = 64  # curriculum and random-LTD lengths are multiples of it (few distinct shapes)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (defaults: the GPU run of the report)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="medium")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument(
        "--token-budget",
        type=int,
        default=None,
        help="training tokens of the baseline (default: sized by a rate probe)",
    )
    parser.add_argument(
        "--baseline-seconds",
        type=float,
        default=150.0,
        help="without --token-budget: the baseline's training time to aim for",
    )
    parser.add_argument(
        "--lrs",
        "--lr",
        dest="lrs",
        default="6e-4",
        help="baseline peak LRs, comma-separated: a sweep; the best final loss is the target",
    )
    parser.add_argument(
        "--de-lrs",
        default=None,
        help="data-efficiency arm peak LRs, comma-separated (default: --lrs)",
    )
    parser.add_argument(
        "--de-budget-fractions",
        default="1.0",
        help="the data-efficiency arm's token budget as fractions of the baseline's, comma-"
        "separated; the LR sweep runs at the first, the others at its best LR. Its LR, "
        "curriculum and random-LTD schedules span its own budget",
    )
    parser.add_argument(
        "--controls",
        choices=["on", "off"],
        default="on",
        help="also train the baseline (best LR) on each reduced budget: the honest reference "
        "for a data-efficiency arm given fewer tokens",
    )
    parser.add_argument("--min-lr-ratio", type=float, default=0.1)
    parser.add_argument("--warmup-fraction", type=float, default=0.02)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument(
        "--target-loss",
        type=float,
        default=None,
        help="default: the best baseline's final validation loss",
    )
    parser.add_argument("--curriculum-mode", choices=["fold", "truncate", "off"], default="fold")
    parser.add_argument("--cl-min", type=int, default=64)
    parser.add_argument(
        "--curriculum-fraction",
        type=float,
        default=0.3,
        help="share of the arm's steps over which the seqlen grows",
    )
    parser.add_argument("--ltd", choices=["on", "off"], default="on")
    parser.add_argument("--ltd-min", type=int, default=128)
    parser.add_argument(
        "--ltd-fraction",
        type=float,
        default=0.7,
        help="share of the arm's steps over which random-LTD's kept tokens grow",
    )
    parser.add_argument(
        "--de-lr-clock",
        choices=["tokens", "layer-tokens"],
        default="tokens",
        help="the data-efficiency arm's LR schedule runs over tokens read (as the baseline's) "
        "or over layer-tokens (DeepSpeed's pairing with random-LTD: warmup and decay follow "
        "the tokens the layers actually processed)",
    )
    parser.add_argument("--token-backend", choices=["auto", "torch", "triton"], default="auto")
    parser.add_argument("--corpus", choices=["stdlib", "grammar"], default="stdlib")
    parser.add_argument("--corpus-bytes", type=int, default=64_000_000)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    return parser.parse_args(argv)  # fmt: skip


# ---------------------------------------------------------------------------- data
def _corpus(args: argparse.Namespace) -> tuple[bytes, bytes, str]:
    """(train bytes, validation bytes, description)."""
    if args.corpus == "grammar":
        data = generate(num_bytes=min(args.corpus_bytes, 8_000_000))
        cut = len(data) * 49 // 50
        return data[:cut], data[cut:], f"generated grammar corpus, {len(data):,} bytes"
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    train, valid, size, used = [], [], 0, 0
    for path in files:
        used += 1
        text = path.read_bytes()
        # One file in 50 (by a hash of its path) is held out for validation.
        target = valid if zlib.crc32(str(path.relative_to(root)).encode()) % 50 == 0 else train
        target.append(text)
        size += len(text)
        if size >= args.corpus_bytes:
            break
    if not valid:  # a small --corpus-bytes may hold no hashed-out file: hold out the last one
        valid.append(train.pop())
    description = (
        f"Python {sys.version_info.major}.{sys.version_info.minor} standard library source "
        f"({used} files, {size:,} bytes, 1 file in 50 held out)"
    )
    return b"\n".join(train), b"\n".join(valid), description


def _windows(data: bytes, seq: int) -> torch.Tensor:
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    count = (tokens.numel() - 1) // seq
    starts = torch.arange(count) * seq
    return tokens[starts.unsqueeze(1) + torch.arange(seq + 1)]


# ---------------------------------------------------------------------------- model
class FoldingLlama(Llama):
    """The benchmark Llama taking DeepSpeed's ``curriculum_seqlen``: each row of the batch is
    folded into ``seq // c`` rows of ``c`` tokens, so a curriculum step reads as many tokens as
    a full one (only the context is shorter)."""

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        curriculum_seqlen: int | None = None,
    ) -> torch.Tensor:
        seq = input_ids.shape[1]
        if curriculum_seqlen is not None and curriculum_seqlen < seq:
            keep = seq // curriculum_seqlen * curriculum_seqlen
            input_ids = input_ids[:, :keep].reshape(-1, curriculum_seqlen)
            labels = labels[:, :keep].reshape(-1, curriculum_seqlen)
        return super().forward(input_ids, labels)


def _model(args: argparse.Namespace, efficient: bool) -> Llama:
    shape = SIZES[args.size]
    fold = efficient and args.curriculum_mode == "fold"
    model = FoldingLlama(shape) if fold else Llama(shape)
    if efficient and args.ltd == "on":
        convert_to_random_ltd(model, Block)
    return model


def _tokens_read(args: argparse.Namespace, seqlen: int) -> int:
    if args.curriculum_mode == "fold":
        return args.micro_batch * (args.seq // seqlen * seqlen)
    return args.micro_batch * seqlen


# ---------------------------------------------------------------------------- configs
def _random_ltd_block(args: argparse.Namespace, steps: int) -> dict[str, Any]:
    layers = SIZES[args.size].layers
    middle = list(range(1, layers - 1))  # first and last layers keep every token
    return {
        "enabled": True,
        "total_layer_num": layers,
        "random_ltd_layer_num": len(middle),
        "random_ltd_layer_id": middle,
        "model_mask_name": None,
        "model_type": "decoder",
        "hidden_state_order": "batch_seq_dim",
        "random_ltd_schedule": {
            "min_value": min(args.ltd_min, args.seq),
            "max_value": args.seq,
            "schedule_type": "fixed_linear",
            "schedule_config": {
                "require_steps": max(int(steps * args.ltd_fraction), 1),
                "seq_per_step": min(BUCKET, args.seq),
            },
        },
    }


def _config(
    args: argparse.Namespace, steps: int, efficient: bool, lr: float = 6e-4
) -> dict[str, Any]:
    on_gpu = torch.cuda.is_available()
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "bf16": {"enabled": on_gpu},
        # The LR is set per step from the tokens read (_lr_at), the same function in both arms.
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": lr, "betas": [0.9, 0.95], "weight_decay": 0.1},
        },
    }
    if not efficient:
        return config
    if args.curriculum_mode != "off":
        step = min(BUCKET, args.seq)
        config["curriculum_learning"] = {
            "enabled": True,
            "curriculum_type": "seqlen",
            "min_difficulty": min(args.cl_min, args.seq),
            "max_difficulty": args.seq,
            "schedule_type": "fixed_root",
            "schedule_config": {
                "total_curriculum_step": max(int(steps * args.curriculum_fraction), 1),
                "difficulty_step": step,
                "root_degree": 2,
            },
        }
    if args.ltd == "on":
        config["data_efficiency"] = {
            "enabled": True,
            "seed": args.seed,
            "data_routing": {
                "enabled": True,
                "random_ltd": _random_ltd_block(args, steps),
            },
        }
    return config


def _lr_at(args: argparse.Namespace, lr: float, tokens: int, budget: int) -> float:
    """Linear warmup over the first warmup-fraction of the budget, cosine to min-lr after."""
    warmup = max(args.warmup_fraction * budget, 1.0)
    if tokens < warmup:
        return lr * (tokens + 1) / warmup
    progress = min((tokens - warmup) / max(budget - warmup, 1.0), 1.0)
    floor = lr * args.min_lr_ratio
    return floor + (lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


# ---------------------------------------------------------------------------- timing
def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _schedule_shapes(engine: Any, args: argparse.Namespace, steps: int) -> list[tuple[int, int]]:
    """Distinct (curriculum seqlen, random-LTD kept) pairs over ``steps`` steps."""
    runtime = engine.data_efficiency
    curriculum = runtime.curriculum if runtime is not None else None
    random_ltd = runtime.random_ltd if runtime is not None else None
    shapes = set()
    for step in range(steps):
        seqlen = curriculum.get_difficulty(step + 1) if curriculum is not None else args.seq
        kept = random_ltd.get_value(step) if random_ltd is not None else args.seq
        shapes.add((int(seqlen), int(min(kept, args.seq))))
    return sorted(shapes)


def _warm_up(args: argparse.Namespace, engine: Any, efficient: bool, steps: int) -> float:
    """One forward/backward per distinct shape on a throwaway bf16 model; returns seconds."""
    began = time.perf_counter()
    with torch.device(engine.device):
        model = _model(args, efficient)
    if torch.cuda.is_available():
        model = model.to(torch.bfloat16)
    scheduler = None
    if efficient and args.ltd == "on":
        config = RandomLTDConfig.from_dict(_random_ltd_block(args, steps))
        scheduler = RandomLTDScheduler(config, args.micro_batch)
        attach_random_ltd(model, config, scheduler, backend=args.token_backend)
    shapes = _schedule_shapes(engine, args, steps) if efficient else [(args.seq, args.seq)]
    batch = torch.randint(0, 256, (args.micro_batch, args.seq + 1), device=engine.device)
    for seqlen, kept in shapes:
        if scheduler is not None:
            scheduler.set_current_seq(kept)
            scheduler.sample_indices = None
        inputs, labels = batch[:, :-1], batch[:, 1:]
        kwargs: dict[str, Any] = {}
        if isinstance(model, FoldingLlama):
            kwargs["curriculum_seqlen"] = seqlen
        else:
            inputs, labels = inputs[:, :seqlen], labels[:, :seqlen]
        model(inputs, labels, **kwargs).backward()
    del model
    _sync()
    return time.perf_counter() - began


@torch.no_grad()
def _validate(engine: Any, valid: torch.Tensor, args: argparse.Namespace) -> float:
    engine.module.eval()
    losses = []
    for i in range(args.eval_batches):
        batch = valid[i * args.micro_batch : (i + 1) * args.micro_batch]
        losses.append(engine(batch[:, :-1], batch[:, 1:]))
    engine.module.train()
    return float(torch.stack(losses).float().mean())  # host sync, outside the timed region


def _layer_token_plan(engine: Any, args: argparse.Namespace, steps: int) -> list[int]:
    """Layer-tokens each planned step processes (folded rows of the curriculum length; the
    random-LTD layers keep at most their scheduled count of each row)."""
    runtime = engine.data_efficiency
    curriculum = runtime.curriculum if runtime is not None else None
    random_ltd = runtime.random_ltd if runtime is not None else None
    layers = SIZES[args.size].layers
    dropping = layers - 2 if random_ltd is not None else 0
    plan = []
    for step in range(steps):
        seqlen = curriculum.get_difficulty(step + 1) if curriculum is not None else args.seq
        kept = random_ltd.get_value(step) if random_ltd is not None else seqlen
        rows = _tokens_read(args, seqlen) // seqlen
        plan.append(rows * ((layers - dropping) * seqlen + dropping * min(kept, seqlen)))
    return plan


def run(
    args: argparse.Namespace,
    train: torch.Tensor,
    valid: torch.Tensor,
    efficient: bool,
    budget: int,
    lr: float,
    label: str,
) -> dict[str, Any]:
    """One training run over ``budget`` tokens at peak ``lr``; its validation curve and rates.

    The LR schedule and (data-efficiency arm) the curriculum and random-LTD schedules span
    this run's own budget.
    """
    steps_planned = math.ceil(budget / (args.micro_batch * args.seq))
    torch.manual_seed(args.seed)
    with torch.device(train.device):  # built in place: a 300M model's CPU init takes seconds
        model = _model(args, efficient)
    engine, *_ = slipstream.initialize(
        model=model, config=_config(args, steps_planned, efficient, lr)
    )
    if efficient and args.ltd == "on" and args.token_backend != "auto":
        runtime = engine.data_efficiency
        attach_random_ltd(
            engine.module,
            runtime.config.data_routing.random_ltd,
            runtime.random_ltd,
            backend=args.token_backend,
        )
    warmup_seconds = _warm_up(args, engine, efficient, steps_planned)
    order = torch.randperm(train.shape[0], generator=torch.Generator().manual_seed(args.seed))
    order = order.to(train.device)
    tokens, step, train_seconds = 0, 0, 0.0
    # DeepSpeed's layer-token LR clock (data-efficiency arm, --de-lr-clock layer-tokens).
    plan = (
        _layer_token_plan(engine, args, steps_planned)
        if efficient and args.de_lr_clock == "layer-tokens"
        else None
    )
    layer_tokens = 0
    curve: list[tuple[int, int, float, float]] = []  # (step, tokens, seconds, val loss)
    diverged = False
    _sync()
    began = time.perf_counter()
    while tokens < budget:
        start = (step * args.micro_batch) % (train.shape[0] - args.micro_batch)
        batch = train[order[start : start + args.micro_batch]]
        if plan is None:
            step_lr = _lr_at(args, lr, tokens, budget)
        else:
            step_lr = _lr_at(args, lr, layer_tokens, sum(plan))
            layer_tokens += plan[min(step, len(plan) - 1)]
        for group in engine.optimizer.param_groups:
            group["lr"] = step_lr
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        step += 1
        runtime = engine.data_efficiency
        seqlen = runtime.curriculum_difficulty() if runtime is not None else None
        tokens += _tokens_read(args, seqlen) if seqlen else budget_step(args)
        if step % args.eval_every == 0 or tokens >= budget:
            _sync()  # the timed segment ends here; validation is not timed
            train_seconds += time.perf_counter() - began
            val = _validate(engine, valid, args)
            curve.append((step, tokens, train_seconds, val))
            print(
                f"{label} lr {lr:.1e} step {step} tokens {tokens:,} train {train_seconds:.1f}s "
                f"lr_now {step_lr:.2e} val {val:.4f}",
                flush=True,
            )
            if not math.isfinite(val) or (len(curve) > 2 and val > 2 * curve[0][3]):
                diverged = True  # no point spending the rest of the budget
                print(f"{label} lr {lr:.1e}: diverged (val {val}), stopped", flush=True)
                break
            _sync()
            began = time.perf_counter()
    engine.destroy()
    del engine, model
    gc.collect()  # the next run's engine starts from an empty device
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    final = curve[-1][3] if not diverged else float("inf")
    print(
        f"done: {label} lr {lr:.1e} budget {budget:,} tokens, {step} steps, "
        f"{train_seconds:.1f} s, {tokens / max(train_seconds, 1e-9):,.0f} tokens/s, "
        f"final val {final:.4f}",
        flush=True,
    )
    return {
        "label": label,
        "lr": lr,
        "budget": budget,
        "steps": step,
        "tokens": tokens,
        "train_seconds": train_seconds,
        "warmup_seconds": warmup_seconds,
        "tokens_per_second": tokens / max(train_seconds, 1e-9),
        "final_val_loss": final,
        "diverged": diverged,
        "curve": curve,
    }


def budget_step(args: argparse.Namespace) -> int:
    """Tokens a full-length step reads."""
    return args.micro_batch * args.seq


def _probe_budget(args: argparse.Namespace, train: torch.Tensor) -> tuple[int, float]:
    """Time a few baseline steps; the budget that fills ``--baseline-seconds`` at that rate."""
    torch.manual_seed(args.seed)
    with torch.device(train.device):
        model = _model(args, False)
    engine, *_ = slipstream.initialize(model=model, config=_config(args, 1000, False))
    batch = train[: args.micro_batch]
    rates = []
    for step in range(8):
        _sync()
        began = time.perf_counter()
        for _ in range(3):
            engine.backward(engine(batch[:, :-1], batch[:, 1:]))
            engine.step()
        _sync()
        if step >= 2:  # the first steps pay one-time costs
            rates.append(3 * budget_step(args) / (time.perf_counter() - began))
    engine.destroy()
    rate = sorted(rates)[len(rates) // 2]
    steps = max(int(rate * args.baseline_seconds) // budget_step(args), 1)
    return steps * budget_step(args), rate


def _time_to(curve: list[tuple[int, int, float, float]], target: float) -> float | None:
    """Training seconds at the first validation point at or below ``target`` (None: never)."""
    for _, _, seconds, loss in curve:
        if loss <= target:
            return seconds
    return None


def _floats(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part.strip()]


def _describe(args: argparse.Namespace, budget: int, description: str) -> str:
    params = sum(p.numel() for p in Llama(SIZES[args.size]).parameters())
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return (
        f"{args.size} GPT ({params / 1e6:.0f}M parameters, byte vocabulary), seq {args.seq}, "
        f"micro-batch {args.micro_batch} (GAS 1, 1 GPU), baseline budget {budget:,} tokens, "
        f"seed {args.seed}, {gpu}, bf16={torch.cuda.is_available()}; {description}; AdamW "
        f"(0.9, 0.95), wd 0.1, clip 1.0, warmup {args.warmup_fraction:.0%} then cosine to "
        f"{args.min_lr_ratio}x over each run's own token budget; validation every "
        f"{args.eval_every} steps on {args.eval_batches * args.micro_batch} held-out windows; "
        f"data-efficiency arm: curriculum {args.curriculum_mode} (seqlen fixed_root from "
        f"{args.cl_min} over {args.curriculum_fraction:.0%} of its steps), random-LTD "
        f"{args.ltd} (kept tokens from {args.ltd_min} over {args.ltd_fraction:.0%} of its "
        f"steps, token ops {args.token_backend}), LR clock {args.de_lr_clock}"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the sweep, the data-efficiency arms and the controls; print a markdown table."""
    args = parse_args(argv)
    wall = time.perf_counter()
    base_lrs = _floats(args.lrs)
    de_lrs = _floats(args.de_lrs) if args.de_lrs else base_lrs
    fractions = _floats(args.de_budget_fractions)
    if not base_lrs or not de_lrs or not fractions or not all(0 < f <= 1 for f in fractions):
        raise SystemExit("--lrs/--de-lrs need LRs and --de-budget-fractions values in (0, 1]")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    train_bytes, valid_bytes, description = _corpus(args)
    train = _windows(train_bytes, args.seq).to(device)
    valid = _windows(valid_bytes, args.seq)
    valid = valid[torch.randperm(valid.shape[0], generator=torch.Generator().manual_seed(0))]
    valid = valid[: args.eval_batches * args.micro_batch].to(device)
    if valid.shape[0] < args.eval_batches * args.micro_batch:
        raise SystemExit(
            f"the held-out set has only {valid.shape[0]} windows; lower --eval-batches"
        )
    probe_rate = None
    budget = args.token_budget
    if budget is None:
        budget, probe_rate = _probe_budget(args, train)
        print(f"probe: baseline {probe_rate:,.0f} tokens/s -> budget {budget:,} tokens", flush=True)
    print(_describe(args, budget, description), flush=True)
    print(
        f"plan: baseline LRs {base_lrs}; data-efficiency LRs {de_lrs} at budget fraction "
        f"{fractions[0]}, then fractions {fractions[1:]} at its best LR; controls {args.controls}",
        flush=True,
    )

    def tokens_for(fraction: float) -> int:
        return max(int(budget * fraction) // budget_step(args), 1) * budget_step(args)

    results: list[dict[str, Any]] = []
    for lr in base_lrs:
        results.append(run(args, train, valid, False, budget, lr, "baseline"))
    baselines = [r for r in results if not r["diverged"]]
    if not baselines:
        raise SystemExit("every baseline LR diverged; lower --lrs")
    best_base = min(baselines, key=lambda r: r["final_val_loss"])
    target = args.target_loss if args.target_loss is not None else best_base["final_val_loss"]
    first = tokens_for(fractions[0])
    de_runs = [run(args, train, valid, True, first, lr, "data-eff") for lr in de_lrs]
    results += de_runs

    def rank(r: dict[str, Any]) -> tuple[float, float]:
        reached = _time_to(r["curve"], target)
        return (reached if reached is not None else math.inf, r["final_val_loss"])

    best_de = min(de_runs, key=rank)
    for fraction in fractions[1:]:
        results.append(
            run(args, train, valid, True, tokens_for(fraction), best_de["lr"], "data-eff")
        )
    if args.controls == "on":
        for fraction in sorted(set(fractions)):
            if fraction < 1:
                short = tokens_for(fraction)
                results.append(
                    run(args, train, valid, False, short, best_base["lr"], "baseline-short")
                )

    print("\n" + _describe(args, budget, description))
    print(f"target validation loss {target:.4f} (best baseline: lr {best_base['lr']:.1e})\n")
    print(
        "| run | peak LR | budget | steps | tokens/s | final val loss | time to target (s) "
        "| vs best baseline |"
    )
    print("|---|---|---|---|---|---|---|---|")
    base_time = _time_to(best_base["curve"], target)
    for result in results:
        reached = _time_to(result["curve"], target)
        result["time_to_target"] = reached
        ratio = reached / base_time if reached is not None and base_time else None
        result["ratio"] = ratio
        print(
            f"| {result['label']} | {result['lr']:.1e} | {result['budget'] / budget:.2f}x | "
            f"{result['steps']} | {result['tokens_per_second']:,.0f} | "
            f"{result['final_val_loss']:.4f}{' (diverged)' if result['diverged'] else ''} | "
            f"{'not reached' if reached is None else f'{reached:.1f}'} | "
            f"{'-' if ratio is None else f'{ratio:.2f}x'} |"
        )
    # The honest reference: the fastest baseline-family run (any LR, any budget) to the target.
    base_family = [r for r in results if r["label"].startswith("baseline")]
    base_best_time = min(
        (r["time_to_target"] for r in base_family if r["time_to_target"] is not None),
        default=None,
    )
    de_best = min(
        (r for r in results if r["label"] == "data-eff"),
        key=lambda r: r["time_to_target"] if r["time_to_target"] is not None else math.inf,
    )
    verdict: dict[str, Any] = {"target": target, "baseline_time": base_best_time}
    if de_best["time_to_target"] is None or base_best_time is None:
        print("\nverdict: no data-efficiency run reached the target validation loss")
        verdict["ratio"] = None
    else:
        ratio = de_best["time_to_target"] / base_best_time
        verdict["ratio"] = ratio
        print(
            f"\nverdict: fastest data-efficiency run (lr {de_best['lr']:.1e}, budget "
            f"{de_best['budget'] / budget:.2f}x) reaches {target:.4f} in "
            f"{de_best['time_to_target']:.1f} s; fastest baseline run (sweep and controls) in "
            f"{base_best_time:.1f} s: ratio {ratio:.2f}x (goal <= 0.70: "
            f"{'met' if ratio <= 0.7 else 'not met'})"
        )
    for name, lrs, best in (
        ("baseline", base_lrs, best_base["lr"]),
        ("data-efficiency", de_lrs, best_de["lr"]),
    ):
        if len(lrs) > 1 and best in (min(lrs), max(lrs)):
            print(
                f"note: the {name} arm's best LR {best:.1e} is at the edge of its sweep "
                f"{lrs}: widen the sweep before trusting the comparison"
            )
    print(f"(whole invocation: {time.perf_counter() - wall:.0f} s)")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "budget": budget, "probe_rate": probe_rate,
                                         "verdict": verdict, "results": results}, indent=1))  # fmt: skip
    from slipstream import comm

    comm.destroy()  # the process group initialize() made: no leak warning at exit
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
