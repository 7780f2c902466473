"""``slipstream compress``: a model and a DeepSpeed config in, a packed compressed export out."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import torch

__all__ = ["Progress", "build_parser", "main"]

STAGES = ("load", "compress", "distill", "clean", "export")


class Progress:
    """A one-line progress bar on a terminal (a line per update elsewhere), like tqdm's."""

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 24) -> None:
        self.total, self.done, self.width = total, 0, width
        self.stream = stream if stream is not None else sys.stderr
        self.start = time.perf_counter()
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def update(self, label: str) -> None:
        """Count one finished stage and show the bar with ``label``."""
        self.done += 1
        filled = self.width * self.done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.perf_counter() - self.start
        line = f"compress [{bar}] {self.done}/{self.total} {label} ({elapsed:.1f}s)"
        if self.tty:
            end = "\n" if self.done == self.total else ""
            self.stream.write("\r" + line.ljust(78) + end)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def build_parser() -> argparse.ArgumentParser:
    """The ``slipstream compress`` options."""
    parser = argparse.ArgumentParser(
        prog="slipstream compress",
        description="Compress a Hugging Face causal LM with a DeepSpeed compression_training "
        "config (init_compression, optional layer-by-layer distillation, redundancy_clean) "
        "and write the packed safetensors export that slipstream.init_inference serves.",
    )
    parser.add_argument("model", help="local Hugging Face model folder (config + safetensors)")
    parser.add_argument("--config", required=True, help="DeepSpeed JSON config")
    parser.add_argument("--output", required=True, help="folder for the compressed export")
    parser.add_argument(
        "--calibration",
        help="token ids for layer-by-layer distillation: a .pt file holding a (batches, tokens) "
        "LongTensor; needs --lkd-steps",
    )
    parser.add_argument("--lkd-steps", type=int, default=0, help="LKD steps per layer (0: none)")
    parser.add_argument("--lkd-lr", type=float, default=1e-4, help="LKD learning rate")
    parser.add_argument(
        "--layers", default="model.layers", help="the ModuleList of layers (for LKD)"
    )
    parser.add_argument("--batch-size", type=int, default=4, help="calibration rows per step")
    return parser


def run(args: argparse.Namespace, progress: Progress) -> dict[str, Any]:
    """Every stage of ``slipstream compress``; returns the export summary."""
    import copy

    from transformers import AutoModelForCausalLM

    from slipstream.compression.compress import init_compression, redundancy_clean
    from slipstream.compression.config import compression_config
    from slipstream.compression.distillation import layerwise_distillation
    from slipstream.compression.export import save_compressed

    config = compression_config(json.loads(Path(args.config).read_text()))
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).eval()
    progress.update(f"loaded {args.model}")
    teacher = copy.deepcopy(model) if args.lkd_steps > 0 else None
    init_compression(model, config)
    progress.update("compression-aware modules in place")
    if teacher is not None:
        if not args.calibration:
            raise SystemExit("slipstream compress: --lkd-steps needs --calibration FILE.pt")
        tokens = torch.load(args.calibration)
        batches = list(tokens.long().split(args.batch_size))
        layerwise_distillation(model, teacher, args.layers, batches, args.lkd_steps, args.lkd_lr)
        progress.update(f"distilled layer by layer ({args.lkd_steps} steps each)")
    else:
        progress.update("no distillation (--lkd-steps 0)")
    redundancy_clean(model, config)
    progress.update("pruned shapes cut, weights on their grid")
    summary = save_compressed(model, args.output)
    progress.update(f"wrote {args.output}")
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``slipstream compress``."""
    args = build_parser().parse_args(argv)
    summary = run(args, Progress(len(STAGES)))
    ratio = summary["dense_bytes"] / max(summary["bytes"], 1)
    print(
        f"{len(summary['packed'])} weights packed; {summary['bytes'] / 2**20:.2f} MiB "
        f"(dense: {summary['dense_bytes'] / 2**20:.2f} MiB, {ratio:.2f}x smaller) in {args.output}"
    )
    return 0
