"""The demo job: a small GPT trained with `slipstream.initialize`, checkpointed and resumed.

Run it under the launcher (2 processes; gloo on CPU, NCCL/RCCL when GPUs are present)::

    slipstream run --num_procs 2 --module slipstream.examples.gpt -- --out runs/demo

It trains a byte-level GPT on a generated corpus for ``--steps`` optimizer steps, saves a
checkpoint at ``--save_at``, then builds a fresh model and engine, loads that checkpoint and
trains on to the end, as a job restarted after a failure would. It exits non-zero if the loss
did not fall.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from importlib import resources
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import slipstream
from slipstream import comm
from slipstream.examples.corpus import generate

logger = logging.getLogger("slipstream.examples.gpt")


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(
            nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=-1)
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """A small GPT with tied input embedding and output head."""

    def __init__(
        self, vocab: int = 256, hidden: int = 128, layers: int = 4, heads: int = 4, seq: int = 128
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Parameter(torch.zeros(seq, hidden))
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + self.pos[: input_ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))


class ByteWindows(torch.utils.data.Dataset):
    """(input, next-byte target) windows of ``seq`` bytes over the corpus."""

    def __init__(self, data: bytes, seq: int) -> None:
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.seq = seq

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.seq
        chunk = self.data[start : start + self.seq + 1]
        return chunk[:-1], chunk[1:]


def _config(steps: int) -> dict:
    """The shipped config, with the schedule's length set and bf16 on when a GPU supports it."""
    text = resources.files("slipstream.examples").joinpath("gpt_config.json").read_text()
    config = json.loads(
        "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("//"))
    )
    config["scheduler"]["params"]["total_num_steps"] = steps
    from slipstream.kernels import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_type != "cpu" and accelerator.is_bf16_supported():
        config["bf16"] = {"enabled": True}
    return config


def _train(engine, loader, until_step: int, position: dict) -> list[float]:
    """Train until ``engine.global_steps == until_step``; returns the losses the engine logged.

    ``position`` is the data cursor (epoch, micro-batches consumed in it), saved in the
    checkpoint's client state so that a resumed run continues with the next unseen batch.
    """
    losses: list[float] = []
    last_report = engine.last_report
    while engine.global_steps < until_step:
        loader.sampler.set_epoch(position["epoch"])
        for index, (inputs, targets) in enumerate(loader):
            if index < position["batch"]:
                continue  # consumed before the checkpoint
            loss = engine(inputs.to(engine.device), targets.to(engine.device))
            engine.backward(loss)
            engine.step()
            position["batch"] = index + 1
            if engine.last_report is not last_report and engine.last_report.loss is not None:
                last_report = engine.last_report
                losses.append(last_report.loss)
            if engine.global_steps >= until_step:
                return losses
        position["epoch"] += 1
        position["batch"] = 0
    return losses


def main(argv: list[str] | None = None) -> int:
    """Train, checkpoint, resume, train on; return 0 when the loss fell."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=Path("runs/demo"), help="checkpoint directory root"
    )
    parser.add_argument("--steps", type=int, default=160, help="optimizer steps in total")
    parser.add_argument(
        "--save_at", type=int, default=None, help="step to checkpoint and resume at (default: half)"
    )
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--local_rank", type=int, default=0, help="set by the launcher")
    slipstream.add_config_arguments(parser)
    args = parser.parse_args(argv)
    save_at = args.save_at if args.save_at is not None else args.steps // 2

    torch.manual_seed(0)
    dataset = ByteWindows(generate(), args.seq)
    config = args.deepspeed_config or _config(args.steps)
    checkpoints = args.out / "checkpoints"

    model = GPT(seq=args.seq)
    engine, _, loader, _ = slipstream.initialize(
        model=model, model_parameters=model.parameters(), training_data=dataset, config=config
    )
    logger.info("phase 1: training to step %d, then saving a checkpoint", save_at)
    position = {"epoch": 0, "batch": 0}
    losses = _train(engine, loader, save_at, position)
    engine.save_checkpoint(checkpoints, client_state={"position": position})

    # A restarted job: new model (different random init), new engine, state from the checkpoint.
    torch.manual_seed(1)
    model = GPT(seq=args.seq)
    engine, _, loader, _ = slipstream.initialize(
        model=model, model_parameters=model.parameters(), training_data=dataset, config=config
    )
    path, client_state = engine.load_checkpoint(checkpoints)
    position = client_state["position"]
    logger.info(
        "phase 2: resumed from %s at step %d; training to step %d",
        path,
        engine.global_steps,
        args.steps,
    )
    losses += _train(engine, loader, args.steps, position)

    if not losses:
        logger.error("no loss was logged; run more steps than steps_per_print")
        return 1
    fell = losses[-1] < losses[0] * 0.8 and math.isfinite(losses[-1])
    logger.info(
        "loss %.4f at the first log line -> %.4f at step %d: %s",
        losses[0],
        losses[-1],
        engine.global_steps,
        "falling, as it should" if fell else "NOT falling",
    )
    comm.destroy()
    return 0 if fell else 1


if __name__ == "__main__":
    raise SystemExit(main())
