"""What quantizing the LM head (``quant.weight.lm_head``) costs in accuracy, on a trained model.

Trains a small Llama (Hugging Face ``LlamaForCausalLM``, random init) on a synthetic corpus with
learnable structure (a random first-order Markov chain: each token has a few likely
successors), then serves it through ``init_inference`` with int8 and int4 weights (group 128),
with and without the head quantized (at the blocks' width, and int4 blocks with an 8-bit head:
``quant.weight.lm_head_bits``), and prints one JSON line per arm: held-out perplexity, its
change against the unquantized model, the share of positions whose greedy next token equals the
unquantized model's, and the max |logit| difference. Accuracy does not depend on the device (the
GPU kernels compute the same dequantized weights within fp32 rounding); it trains and serves on
the GPU when there is one (about 30 s), else on the CPU (slow: use ``--steps 100``)::

    PYTHONPATH=$(ls -d kernels/src packages/*/src | tr '\\n' ':') python tools/bench/head_quant_accuracy.py
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
import torch.nn.functional as F


def parse_args() -> argparse.Namespace:
    """Command-line options (defaults: about a minute on two CPU cores)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--successors", type=int, default=4, help="likely next tokens per pair")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def emit(**row: Any) -> None:
    """One JSON result line."""
    print(json.dumps(row), flush=True)


class MarkovCorpus:
    """Token streams from a random first-order Markov chain over ``vocab`` tokens."""

    def __init__(self, vocab: int, successors: int, generator: torch.Generator) -> None:
        self.vocab = vocab
        table = vocab  # one context per previous token
        self.next = torch.randint(0, vocab, (table, successors), generator=generator)
        weights = torch.rand(table, successors, generator=generator) ** 2 + 0.05
        self.probs = weights / weights.sum(-1, keepdim=True)
        self.table = table

    def sample(self, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
        ids = torch.empty(batch, length, dtype=torch.long)
        ids[:, :1] = torch.randint(0, self.vocab, (batch, 1), generator=generator)
        for t in range(1, length):
            context = ids[:, t - 1]
            pick = torch.multinomial(self.probs[context], 1, generator=generator).squeeze(1)
            ids[:, t] = self.next[context, pick]
        return ids


def perplexity_and_logits(forward: Any, data: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Held-out perplexity of next-token predictions, and the logits (for comparisons)."""
    with torch.no_grad():
        logits = torch.cat([forward(chunk).float() for chunk in data.split(16)])
    targets = data[:, 1:].reshape(-1)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets)
    return float(torch.exp(loss)), logits


def main() -> None:
    """Train, then serve and score each arm."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from slipstream.inference import init_inference

    args = parse_args()
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    corpus = MarkovCorpus(args.vocab, args.successors, generator)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 128 or 1,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
    )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = LlamaForCausalLM(config).to(device)
    train = corpus.sample(args.steps * args.batch, args.seq, generator).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, total_steps=args.steps)
    started = time.perf_counter()
    for step in range(args.steps):
        ids = train[step * args.batch : (step + 1) * args.batch]
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == args.steps - 1:
            emit(phase="train", step=step, loss=round(loss.item(), 4))
    emit(phase="trained", seconds=round(time.perf_counter() - started, 1))
    model.eval()
    held_out = corpus.sample(128, args.seq, torch.Generator().manual_seed(args.seed + 1))
    held_out = held_out.to(device)

    exact = init_inference(model, dtype=torch.float32, replace_with_kernel_inject=True)
    base, base_logits = perplexity_and_logits(lambda ids: exact(ids).logits, held_out)
    emit(arm="fp32", perplexity=round(base, 4))
    # (blocks' bits, head's bits; None: the head stays fp32): the last arm is int4 blocks
    # with an 8-bit head (quant.weight.lm_head_bits)
    for bits, head in ((8, None), (8, 8), (4, None), (4, 4), (4, 8)):
        weight: dict[str, Any] = {"num_bits": bits, "group_size": 128, "compute_dtype": "fp32"}
        if head is not None:
            weight.update(lm_head=True, lm_head_bits=head)
        engine = init_inference(
            model, dtype="int8", replace_with_kernel_inject=True, quant={"weight": weight}
        )
        ppl, logits = perplexity_and_logits(lambda ids, e=engine: e(ids).logits, held_out)
        agree = (logits.argmax(-1) == base_logits.argmax(-1)).float().mean().item()
        emit(
            arm=f"int{bits}" + (f" + int{head} lm_head" if head else ""),
            perplexity=round(ppl, 4),
            change_vs_fp32=f"{(ppl / base - 1) * 100:+.2f}%",
            top1_agreement_vs_fp32=round(agree, 4),
            logits_max_abs_diff_vs_fp32=round((logits - base_logits).abs().max().item(), 4),
            logits_max_abs_fp32=round(base_logits.abs().max().item(), 4),
        )


if __name__ == "__main__":
    main()
