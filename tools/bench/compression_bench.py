"""Compression quality, size and served decode speed on a small GPT trained by the benchmark itself.

1. A Llama-style GPT (random init, ``--preset``) is trained on a synthetic but learnable corpus:
   an order-2 Markov source over ``vocab`` tokens where each pair of previous tokens allows four
   next tokens with probabilities 0.55/0.25/0.15/0.05. The source's entropy is the best possible
   validation loss (``floor``); training stops at ``floor + --target-gap`` or ``--train-steps``.
2. Compressed copies, each with its validation perplexity (same held-out batches) and size:
   W8A8 ZeroQuant; W4 ZeroQuant without and with layer-by-layer distillation (LKD); XTC (layer
   reduction, then ternary weights, both with logit distillation); 50% structured pruning of
   heads and MLP rows (then distillation with the masks on, then ``redundancy_clean``). Sizes are the packed export's bytes
   against bf16 for the same tensors.
3. The W8 and W4 exports are loaded by ``init_inference`` (kernel injection, CUDA-graph decode,
   fp16 compute) and decode speed is compared with the bf16 model served the same way
   (tokens/s from ``generate`` of ``--new-tokens`` minus 1 token, batch 1); the served model's
   perplexity is reported too (it must match the fake-quantized one).

One JSON line per result. On one H100 (the lead's command; about 4-5 minutes):

    PYTHONPATH=$(ls -d kernels/src packages/*/src | tr '\\n' ':') python tools/bench/compression_bench.py

CPU smoke run of the harness: ``--preset tiny --device cpu``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from slipstream.compression import (
    CompressionScheduler,
    distill,
    init_compression,
    redundancy_clean,
    save_compressed,
    xtc,
    zeroquant,
    zeroquant_config,
)
from slipstream.inference import init_inference

PRESETS: dict[str, dict[str, Any]] = {
    # ~27M parameters in the blocks (the loss target is unverified on a GPU so far: the train
    # line reports whether it was reached within --train-steps).
    "small": {
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "intermediate_size": 1536,
        "vocab_size": 512,
        "max_position_embeddings": 512,
        "batch": 32,
        "seq": 256,
        "lr": 1e-3,
    },
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 64,
        "max_position_embeddings": 64,
        "batch": 8,
        "seq": 32,
        "lr": 3e-3,
    },
}
PROBS = torch.tensor([0.55, 0.25, 0.15, 0.05])
MODULES = ["self_attn", "mlp"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--train-steps", type=int, default=3000)
    parser.add_argument("--target-gap", type=float, default=0.15, help="stop at floor + this")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--lkd-steps", type=int, default=200, help="LKD steps per layer")
    parser.add_argument("--kd-steps", type=int, default=400, help="XTC/pruning distillation")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def emit(**row: Any) -> None:
    """One result as a JSON line."""
    print(json.dumps(row), flush=True)


class MarkovSource:
    """Order-2 Markov text: the next token's four candidates depend on the current token and on
    the previous one's residue mod 16 (so a model must attend two positions back)."""

    def __init__(self, vocab: int, device: torch.device, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.successors = torch.randint(0, vocab, (16, vocab, 4), generator=g).to(device)
        self.cumulative = PROBS.cumsum(0).to(device)
        self.device = device
        # The best achievable loss: the entropy of the next-token distribution (nats; exact
        # when a context's four candidates differ, which random draws make almost always).
        self.floor = float(-(PROBS * PROBS.log()).sum())

    def sample(self, rows: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """``(rows, length)`` token ids."""
        out = torch.randint(0, self.vocab, (rows, length), generator=generator).to(self.device)
        draws = torch.rand(rows, length, generator=generator).to(self.device)
        for t in range(2, length):
            choice = torch.searchsorted(self.cumulative, draws[:, t : t + 1].contiguous())
            options = self.successors[out[:, t - 2] % 16, out[:, t - 1]]
            out[:, t] = options.gather(1, choice.clamp(max=3)).squeeze(1)
        return out


@torch.no_grad()
def perplexity(
    forward: Callable[[torch.Tensor], torch.Tensor], batches: list[torch.Tensor]
) -> float:
    """exp of the mean loss over ``batches`` (``forward`` gives logits)."""
    total = 0.0
    for ids in batches:
        logits = forward(ids)
        total += F.cross_entropy(logits[:, 1:-1].flatten(0, 1).float(), ids[:, 2:].flatten()).item()
    return math.exp(total / len(batches))


def logits_fn(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda ids: model(ids).logits


def build_model(preset: dict[str, Any], device: torch.device) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        **{k: v for k, v in preset.items() if k not in ("batch", "seq", "lr")},
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config).to(device)


def train(args: argparse.Namespace, preset: dict[str, Any], source: MarkovSource,
          model: torch.nn.Module, val: list[torch.Tensor]) -> dict[str, Any]:  # fmt: skip
    """Train to ``floor + target_gap`` validation loss (or the step budget)."""
    g = torch.Generator().manual_seed(args.seed + 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=preset["lr"], weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer,
        max_lr=preset["lr"],
        total_steps=args.train_steps,
        pct_start=max(0.05, 4 / args.train_steps),
    )
    autocast = torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.device == "cuda")
    start = time.perf_counter()
    val_loss = float("inf")
    step = 0
    model.train()
    for step in range(1, args.train_steps + 1):
        ids = source.sample(preset["batch"], preset["seq"], g)
        with autocast:
            logits = model(ids).logits
        loss = F.cross_entropy(logits[:, 1:-1].flatten(0, 1).float(), ids[:, 2:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == args.train_steps:
            model.eval()
            val_loss = math.log(perplexity(logits_fn(model), val))
            model.train()
            if val_loss <= source.floor + args.target_gap:
                break
    model.eval()
    return {
        "steps": step,
        "val_loss": round(val_loss, 4),
        "floor": round(source.floor, 4),
        "target": round(source.floor + args.target_gap, 4),
        "reached": val_loss <= source.floor + args.target_gap,
        "seconds": round(time.perf_counter() - start, 1),
    }


def bf16_bytes(model: torch.nn.Module) -> int:
    """Bytes of every weight in bf16 (the dense baseline of the size ratios)."""
    return sum(t.numel() * 2 for t in model.state_dict().values())


def export(model: torch.nn.Module, config: dict[str, Any], folder: Path) -> dict[str, Any]:
    redundancy_clean(model, config)
    return save_compressed(model, folder, dense_dtype=torch.bfloat16)


def served_decode(
    folder_or_model: Path | torch.nn.Module, args: argparse.Namespace, ids: torch.Tensor,
    val: list[torch.Tensor],
) -> dict[str, Any]:  # fmt: skip
    """Decode tokens/s (batch 1) and perplexity of a model served by init_inference."""
    import transformers

    if isinstance(folder_or_model, Path):
        config = transformers.AutoConfig.from_pretrained(folder_or_model)
        model = transformers.AutoModelForCausalLM.from_config(config)
        dtype = "fp16" if args.device == "cuda" else "fp32"
        kwargs: dict[str, Any] = {"checkpoint": str(folder_or_model), "dtype": dtype}
    else:
        dtype = "bf16" if args.device == "cuda" else "fp32"
        model, kwargs = copy.deepcopy(folder_or_model).float().cpu(), {"dtype": dtype}
    engine = init_inference(
        model.eval(),
        replace_with_kernel_inject=True,
        enable_cuda_graph=args.device == "cuda",
        max_out_tokens=args.prompt + args.new_tokens + 8,
        **kwargs,
    )
    device = torch.device(args.device)

    def generate(new: int) -> None:
        engine.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=None)

    def timed(new: int) -> float:
        generate(new)
        best = float("inf")
        for _ in range(3):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            generate(new)
            if device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        return best

    step = (timed(args.new_tokens) - timed(1)) / max(args.new_tokens - 1, 1)
    ppl = perplexity(lambda x: engine(x).logits, val)
    return {"decode_tokens_per_s": round(1 / step, 1), "served_ppl": round(ppl, 4)}


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    preset = PRESETS[args.preset]
    device = torch.device(args.device)
    source = MarkovSource(preset["vocab_size"], device, args.seed)
    g_val = torch.Generator().manual_seed(args.seed + 2)
    val = [source.sample(preset["batch"], preset["seq"], g_val) for _ in range(4)]
    calibration = [source.sample(8, preset["seq"], g_val) for _ in range(8)]

    base = build_model(preset, device)
    emit(
        result="train",
        preset=args.preset,
        device=str(device),
        **train(args, preset, source, base, val),
    )
    base_ppl = perplexity(logits_fn(base), val)
    dense = bf16_bytes(base)
    emit(result="baseline", ppl=round(base_ppl, 4), bf16_bytes=dense)
    common = {"group_size": args.group_size, "modules": MODULES}
    tmp = Path(tempfile.mkdtemp(prefix="compression_bench_"))

    def report(name: str, model: torch.nn.Module, config: dict[str, Any], **extra: Any) -> Path:
        ppl = perplexity(logits_fn(model), val)
        folder = tmp / name
        summary = export(model, config, folder)
        emit(
            result=name,
            ppl=round(ppl, 4),
            ppl_change_pct=round(100 * (ppl / base_ppl - 1), 2),
            bytes=summary["bytes"],
            size_ratio_vs_bf16=round(dense / summary["bytes"], 2),
            **common,
            **extra,
        )
        return folder

    # W8A8 ZeroQuant (post-training, no data).
    start = time.perf_counter()
    w8 = zeroquant(copy.deepcopy(base), 8, args.group_size, 8, MODULES)
    w8_config = {"compression_training": zeroquant_config(8, args.group_size, 8, MODULES)}
    w8_dir = report("zeroquant_w8a8", w8, w8_config, seconds=round(time.perf_counter() - start, 1))

    # W4 ZeroQuant, without and with LKD (weight-only activations: W4A16).
    w4_config = {"compression_training": zeroquant_config(4, args.group_size, None, MODULES)}
    w4_plain = zeroquant(copy.deepcopy(base), 4, args.group_size, None, MODULES)
    report("zeroquant_w4", w4_plain, w4_config)
    start = time.perf_counter()
    w4 = zeroquant(
        copy.deepcopy(base), 4, args.group_size, None, MODULES, calibration=calibration,
        layers="model.layers", lkd_steps=args.lkd_steps, lr=1e-4,
    )  # fmt: skip
    w4_dir = report(
        "zeroquant_w4_lkd", w4, w4_config, lkd_steps=args.lkd_steps,
        seconds=round(time.perf_counter() - start, 1),
    )  # fmt: skip

    # XTC: keep 3/4 of the layers (evenly spread), then ternary weights.
    layers = preset["num_hidden_layers"]
    kept = max(1, (3 * layers) // 4)
    keep = [round(i * (layers - 1) / max(kept - 1, 1)) for i in range(kept)]
    train_batches = [source.sample(preset["batch"], preset["seq"], g_val) for _ in range(16)]
    start = time.perf_counter()
    student = xtc(
        base, keep_layers=keep, layers="model.layers", batches=train_batches,
        reduce_steps=args.kd_steps // 3, quantize_steps=args.kd_steps, weight_bits=2,
        group_size=args.group_size, modules=MODULES, lr=3e-4,
    )  # fmt: skip
    xtc_config = {
        "compression_training": {
            "weight_quantization": zeroquant_config(2, args.group_size, None, MODULES)[
                "weight_quantization"
            ]
        }
    }
    report("xtc_ternary", student, xtc_config, kept_layers=keep,
           seconds=round(time.perf_counter() - start, 1))  # fmt: skip

    # 50% structured pruning: half of every layer's attention heads and MLP rows (up_proj with
    # its sibling gate_proj and the follower down_proj), recovered by distillation.
    heads = preset["num_attention_heads"]
    prune_block = {
        "head_pruning": {
            "shared_parameters": {"enabled": True, "schedule_offset": 0, "method": "l1",
                                  "num_heads": heads},
            "different_groups": {
                "hp1": {"params": {"dense_ratio": 0.5}, "modules": ["self_attn.o_proj"],
                        "related_modules": [["q_proj", "k_proj", "v_proj"]]}
            },
        },
        "row_pruning": {
            "shared_parameters": {"enabled": True, "schedule_offset": 0, "method": "l1"},
            "different_groups": {
                "rp1": {"params": {"dense_ratio": 0.5}, "modules": ["mlp.up_proj"],
                        "related_modules": [["mlp.gate_proj", "mlp.down_proj"]]}
            },
        },
    }  # fmt: skip
    pruned = init_compression(copy.deepcopy(base), {"compression_training": prune_block})
    before = perplexity(logits_fn(pruned), val)
    scheduler = CompressionScheduler(pruned, prune_block)
    distill(pruned, base, train_batches, args.kd_steps, lr=3e-4,
            on_step=lambda step, loss: scheduler.step())  # fmt: skip
    report("structured_pruned_50pct", pruned, {"compression_training": prune_block},
           ppl_before_distillation=round(before, 4))  # fmt: skip

    # Serving: the W8 and W4 exports through init_inference, against the bf16 model.
    g_prompt = torch.Generator().manual_seed(args.seed + 3)
    ids = source.sample(1, args.prompt, g_prompt)
    baseline = served_decode(base, args, ids, val)
    emit(result="served_bf16", **baseline)
    for name, folder in (("served_w8", w8_dir), ("served_w4_lkd", w4_dir)):
        served = served_decode(folder, args, ids, val)
        speedup = served["decode_tokens_per_s"] / baseline["decode_tokens_per_s"]
        emit(result=name, decode_speedup_vs_bf16=round(speedup, 3), **served)


if __name__ == "__main__":
    main()
