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
   win from simply training a shorter schedule is not credited to data efficiency
   (``--controls both``: also at the data-efficiency arm's best LR, since DeepSpeed raises the
   baseline's LR on a reduced budget too; ``--controls first``: on the first fraction only).
   With ``--batch-control D``, a data-efficiency run that reaches the target in <= 0.7x the
   baseline family's time also triggers the baseline at micro-batch / D on the full budget:
   the curriculum's short early steps are small token batches, and this tells that gain apart.
   ``--de-variants cl`` (or ``ltd``) also runs one technique alone at the arm's best LR.

The verdict divides the fastest data-efficiency run's training time to the target by the
fastest baseline-family run's (sweep and controls), at validation points every
``--eval-every`` steps (validation is not timed; goal of issue 28: <= 0.7). A run whose
validation loss goes non-finite or doubles is stopped as diverged. The summary prints each
run's validation loss against its training seconds, so a crossing is measured, not
extrapolated. ``--max-seconds`` skips (and lists) later runs that would not fit.

The data-efficiency arm (defaults: the 2026-11-25 runs):

* seqlen curriculum, ``--cl-schedule`` (``fixed_root``, square root) from ``--cl-min`` (64)
  tokens to the full length over ``--curriculum-fraction`` of budget / (micro-batch x seq)
  steps, lengths in multiples of ``--difficulty-step`` (64). The model takes
  ``curriculum_seqlen`` and folds each row into seq/c rows of c tokens (``--curriculum-mode
  fold``: a step reads as many tokens as a baseline step, with a shorter context), or the
  engine truncates the batch as DeepSpeed's ``seqlen_truncate`` does (``truncate``: early
  steps read fewer tokens and cost less);
* random-LTD in every layer but the first and last, keeping ``--ltd-min`` (128) tokens at first
  and rising linearly to the full length over ``--ltd-fraction`` of those steps, in multiples
  of ``--ltd-seq-per-step`` (64). A layer drops nothing while the curriculum's length is at or
  below the kept count;
* ``--de-lr-clock deepspeed``: Megatron-DeepSpeed's ``consumed_train_tokens`` (rows x the
  curriculum length, averaged over the layers with the random-LTD layers counting their kept
  tokens) drives the warmup/cosine LR and ends the run at its budget, as ``train_tokens`` and
  ``lr_decay_tokens`` do there; so a truncating arm takes more, cheaper steps.

DeepSpeed's GPT-3 1.3B data-efficiency run script (Megatron-DeepSpeed's data-efficiency GPT
examples) uses seq 2048, ``seqlen_truncate`` from 80, ``difficulty_step`` 8, root
1 (linear) over 110K steps (~38% of the baseline's 286K steps of 1M tokens), random-LTD from
128 with ``seq_per_step`` 16 over 200K steps (~70%), token-based warmup and cosine decay over
the run's token budget, and raises the peak LR as the budget shrinks (2e-4 at 300B tokens,
4e-4 at 150B, for baseline and data-efficiency runs alike). The decisive run of issue 28 takes
those settings to a one-GPU scale (the 85M model, 20 MB corpus file from
``make_text_corpus.py``; about 5.5 minutes on one H100)::

    python tools/bench/make_text_corpus.py --out .device/de_corpus.bin --bytes 20000000
    python tools/bench/data_efficiency_bench.py --size base --seq 2048 --micro-batch 16 \\
        --corpus file --corpus-file .device/de_corpus.bin --holdout 20 \\
        --baseline-seconds 30 --warmup-fraction 0.05 --eval-every 20 --eval-batches 6 \\
        --lrs 3e-4,6e-4,1.2e-3 --de-lr-multipliers 1,2,4 --de-budget-fractions 0.6,0.8 \\
        --curriculum-mode truncate --cl-schedule fixed_linear --cl-min 80 \\
        --difficulty-step 8 --curriculum-fraction 0.38 --ltd-min 128 --ltd-seq-per-step 16 \\
        --ltd-fraction 0.7 --de-lr-clock deepspeed --controls both --de-variants cl \\
        --batch-control 4 --max-seconds 320 --json de4.json

Before timing, each run does one forward/backward per distinct shape of its schedule that this
process has not run yet (or ``--warm-shapes`` of them, evenly spread) on a throwaway copy of the
model (attention and GEMM plan selection, allocator blocks, Triton compiles: whatever a new
shape costs the first time), so one-time per-shape costs stay out of every clock. They are real but amortized in a long run;
in a 30-second run they are not: the 2026-11-26 03:10 call warmed 16 of 151 shapes and its
first truncating run took 33.8 s where the same schedule later took 19.4 s. Use the default
(all shapes). Without
``--token-budget``, a short probe of the baseline's rate sizes the budget so that a baseline
run trains for about ``--baseline-seconds``.

    # the 2026-11-25/26 run 1 (309M, seq 512, folded curriculum)
    python tools/bench/data_efficiency_bench.py --baseline-seconds 25 --eval-every 15 \\
        --eval-batches 4 --lrs 6e-4,1.2e-3,2.4e-3,4.8e-3 --de-lrs 1.2e-3,2.4e-3,4.8e-3 \\
        --de-budget-fractions 0.7,1.0 --de-lr-clock layer-tokens
    # CPU smoke run of the whole harness (truncation, DeepSpeed's clock, every control)
    python tools/bench/data_efficiency_bench.py --preset smoke

``--data-sampling voc`` adds DeepSpeed's other curriculum, over a difficulty metric of the data:
slipstream.data's DataAnalyzer indexes every training window's vocabulary rarity (sum of -log
unigram frequency, before any clock) and the engine's difficulty loader
(``data_efficiency.data_sampling``, built by ``slipstream.initialize(training_data=...)``)
draws the arm's batches from the easiest percentiles first (1 -> 100, ``fixed_root`` 2, over the
seqlen curriculum's steps): the "CL + random-LTD" composition of Megatron-DeepSpeed's GPT-3
data-efficiency runs (their ``voc`` metric beside ``seqlen_truncate``).

``--curriculum-mode reshape`` cuts the batch as DeepSpeed's ``seqlen_reshape`` does (rows of
c+1 tokens, about a full step's tokens at every length); ``--de-extra NAME:KEY=VALUE,...@F``
runs further arms in the same call; ``--eval-late-every`` validates more often near the end of
every run; ``--profile-shapes LENGTH:KEPT[:BACKEND]`` times fixed-shape steps before the runs
(where the arm's time goes; outside every clock).

Without the packages installed, put the sources on the path first:
``export PYTHONPATH=$(ls -d kernels/src packages/*/src | tr '\\n' ':')``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
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
    reshape_batch,
    reshaped_rows,
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
# --preset smoke: the whole harness on CPU in well under a minute (DeepSpeed-style arm: truncating
# fixed_linear curriculum, DeepSpeed's token clock, controls at both LRs).
SMOKE: dict[str, Any] = {
    "size": "tiny", "seq": 128, "micro_batch": 4, "token_budget": 24576, "eval_every": 8,
    "eval_batches": 2, "corpus_bytes": 1_000_000, "lrs": "1e-3,3e-3",
    "de_lr_multipliers": "1,2", "de_budget_fractions": "0.7,1.0",
    "curriculum_mode": "truncate", "cl_min": 16, "cl_schedule": "fixed_linear",
    "difficulty_step": 8, "ltd_min": 32, "ltd_seq_per_step": 16, "de_lr_clock": "deepspeed",
    "controls": "both", "warm_shapes": 4, "batch_control": 2, "de_variants": "cl",
}  # fmt: skip


# --de-variants: the data-efficiency arm with one technique only.
VARIANTS: dict[str, dict[str, str]] = {"cl": {"ltd": "off"}, "ltd": {"curriculum_mode": "off"}}


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
        choices=["on", "both", "first", "off"],
        default="on",
        help="also train the baseline on each reduced budget (on: at the best baseline LR; "
        "both: also at the data-efficiency arm's best LR; first: at the best baseline LR, on "
        "the first fraction only): the honest reference for a data-efficiency arm given "
        "fewer tokens",
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
    parser.add_argument(
        "--de-lr-multipliers",
        default=None,
        help="data-efficiency arm peak LRs as multiples of the best baseline LR, comma-"
        "separated (replaces --de-lrs): the grid follows the tuned baseline",
    )
    parser.add_argument(
        "--curriculum-mode",
        choices=["fold", "truncate", "reshape", "off"],
        default="fold",
        help="how the seqlen curriculum shortens a step: fold each row into seq/c rows of c "
        "tokens, truncate the batch (DeepSpeed's seqlen_truncate), or reshape it exactly as "
        "Megatron-DeepSpeed's seqlen_reshape does (rows of c+1 token windows, about as many "
        "tokens per step as a full step)",
    )
    parser.add_argument("--cl-min", type=int, default=64)
    parser.add_argument(
        "--cl-schedule",
        choices=["fixed_root", "fixed_linear"],
        default="fixed_root",
        help="the seqlen curriculum's schedule_type (fixed_root: square root)",
    )
    parser.add_argument(
        "--difficulty-step",
        type=int,
        default=BUCKET,
        help="curriculum lengths are multiples of it (DeepSpeed's GPT examples: 8)",
    )
    parser.add_argument(
        "--ltd-seq-per-step",
        type=int,
        default=BUCKET,
        help="random-LTD's kept counts are multiples of it (seq_per_step)",
    )
    parser.add_argument(
        "--warm-shapes",
        type=int,
        default=0,
        help="warm up at most this many of a run's distinct shapes, evenly spread (0: all); "
        "the others pay their first-use cost inside the clock. A shape already run in this "
        "process is not warmed again",
    )
    parser.add_argument(
        "--curriculum-fraction",
        type=float,
        default=0.3,
        help="the seqlen grows over this share of budget / (micro-batch x seq) steps (the "
        "arm's steps, unless truncation with the deepspeed clock makes it take more)",
    )
    parser.add_argument("--ltd", choices=["on", "off"], default="on")
    parser.add_argument("--ltd-min", type=int, default=128)
    parser.add_argument(
        "--ltd-fraction",
        type=float,
        default=0.7,
        help="random-LTD's kept tokens grow over this share of budget / (micro-batch x seq) steps",
    )
    parser.add_argument(
        "--de-lr-clock",
        choices=["tokens", "layer-tokens", "deepspeed"],
        default="tokens",
        help="the data-efficiency arm's LR schedule runs over tokens read (as the baseline's), "
        "over layer-tokens (warmup and decay follow the tokens the layers processed; the run "
        "still ends on tokens read), or 'deepspeed': Megatron-DeepSpeed's "
        "consumed_train_tokens (rows x the curriculum length, layer-averaged over the random-"
        "LTD layers' kept count) drives both the LR and the end of the run, as its "
        "train_tokens / lr_decay_tokens do",
    )
    parser.add_argument("--token-backend", choices=["auto", "torch", "triton"], default="auto")
    parser.add_argument(
        "--check-grad-overflow",
        choices=["on", "off"],
        default="on",
        help="bf16.check_grad_overflow for every run (Slipstream's default is on, DeepSpeed's "
        "off). Since the stage-0 vote rides on the gradient norm it costs a few dispatches a "
        "step; before, an isfinite/all pass per gradient tensor (host work that a run of many "
        "small steps paid more often)",
    )
    parser.add_argument(
        "--data-sampling",
        choices=["off", "voc"],
        default="off",
        help="voc: the data-efficiency arm also draws its batches through slipstream.data's "
        "difficulty sampler (data_efficiency.data_sampling) over DeepSpeed's vocabulary-rarity "
        "metric (the sum of -log unigram frequency of a window's tokens, computed by "
        "DataAnalyzer before any clock), percentile-based from --ds-min to 100 with a "
        "fixed_root schedule over the seqlen curriculum's steps: the 'CL+random-LTD' "
        "composition of DeepSpeed's GPT-3 data-efficiency runs (voc + seqlen_truncate)",
    )
    parser.add_argument("--ds-min", type=int, default=1, help="voc: starting percentile")
    parser.add_argument("--ds-root", type=int, default=2, help="voc: fixed_root root_degree")
    parser.add_argument("--corpus", choices=["stdlib", "grammar", "file"], default="stdlib")
    parser.add_argument(
        "--corpus-file",
        type=Path,
        default=Path(".device/de_corpus.bin"),
        help="with --corpus file: documents joined by NUL bytes (tools/bench/make_text_corpus.py)",
    )
    parser.add_argument("--corpus-bytes", type=int, default=64_000_000)
    parser.add_argument(
        "--holdout",
        type=int,
        default=50,
        help="with --corpus file: one document in this many (by a hash of its text) is "
        "held out for validation",
    )
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--de-variants",
        default="",
        help="comma-separated, from 'cl' (curriculum without random-LTD) and 'ltd' (random-"
        "LTD without curriculum): also run these at the first budget fraction and the arm's "
        "best LR",
    )
    parser.add_argument(
        "--batch-control",
        type=int,
        default=0,
        help="once a data-efficiency run reaches the target in <= 0.7x the fastest baseline-"
        "family run's time: also train the baseline with "
        "micro-batch / this divisor on the full budget (at the best LR and at it / sqrt("
        "divisor)), so a gain from smaller early batches is not credited to the curriculum "
        "(0: off)",
    )
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=0.0,
        help="skip later runs (data-efficiency LRs after the first, controls, other "
        "fractions) that would end past this many seconds of the invocation; the summary "
        "lists them (0: no limit)",
    )
    parser.add_argument(
        "--de-extra",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE[,KEY=VALUE...][@FRACTION[,FRACTION...]]",
        help="another data-efficiency arm, run after the others at the arm's best LR: the "
        "options KEY (an option's name with underscores, e.g. curriculum_mode=reshape, "
        "difficulty_step=64) changed, at these budget fractions (default: the first of "
        "--de-budget-fractions); labelled data-eff-NAME. Repeatable",
    )
    parser.add_argument(
        "--eval-late-every",
        type=int,
        default=0,
        help="validate every this many steps once a run's clock passes --eval-late-from of its "
        "budget (0: --eval-every throughout): a finer time-to-target near the crossing, for "
        "every run alike",
    )
    parser.add_argument("--eval-late-from", type=float, default=0.6)
    parser.add_argument(
        "--profile-shapes",
        default="",
        help="comma-separated LENGTH:KEPT[:BACKEND] shapes timed before the runs (fixed shape, "
        "fresh engine, --profile-steps steps; KEPT < LENGTH: random-LTD in the middle layers, "
        "token ops BACKEND or --token-backend): where a step's time goes, outside every run's "
        "clock",
    )
    parser.add_argument("--profile-steps", type=int, default=10)
    parser.add_argument(
        "--profile-table",
        default="",
        help="LENGTH:KEPT shapes (of --profile-shapes) to also run under torch.profiler: the "
        "top kernels of two steps",
    )
    parser.add_argument("--profile-rows", type=int, default=14)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument(
        "--preset",
        choices=["none", "smoke"],
        default="none",
        help="smoke: a CPU check of the whole harness in well under a minute (tiny model, "
        "truncating curriculum, DeepSpeed clock, controls at both LRs)",
    )
    if parser.parse_known_args(argv)[0].preset == "smoke":
        parser.set_defaults(**SMOKE)  # options given on the command line still win
    args = parser.parse_args(argv)
    args.voc_index = None  # --data-sampling voc: the DataAnalyzer's index prefix (main sets it)
    return args


# ---------------------------------------------------------------------------- data
def _corpus(args: argparse.Namespace) -> tuple[bytes, bytes, str]:
    """(train bytes, validation bytes, description)."""
    if args.corpus == "file":
        if not args.corpus_file.is_file():
            raise SystemExit(
                f"--corpus-file {args.corpus_file} does not exist; make it with "
                "python tools/bench/make_text_corpus.py --out " + str(args.corpus_file)
            )
        data = args.corpus_file.read_bytes()
        documents = data.split(b"\x00")
        # One document in --holdout (by a hash of its text) is held out for validation.
        held = [zlib.crc32(doc) % args.holdout == 0 for doc in documents]
        train_docs = [d for d, h in zip(documents, held, strict=True) if not h]
        valid_docs = [d for d, h in zip(documents, held, strict=True) if h]
        while sum(map(len, valid_docs)) * args.holdout < len(data) and len(train_docs) > 1:
            valid_docs.append(train_docs.pop())  # a small file may hash too little out
        return (
            b"\n".join(train_docs),
            b"\n".join(valid_docs),
            f"{args.corpus_file.name} ({len(documents):,} documents, {len(data):,} bytes, "
            f"crc32 {zlib.crc32(data):08x}, 1 document in {args.holdout} held out: "
            f"{sum(map(len, valid_docs)):,} bytes)",
        )
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


class ReshapingLlama(Llama):
    """The benchmark Llama taking ``curriculum_seqlen`` the way Megatron-DeepSpeed's
    ``seqlen_reshape`` metric shapes a batch: the ``(batch, seq + 1)`` text behind the inputs
    and labels is cut into rows of ``c + 1`` tokens (:func:`slipstream.data.reshape_batch`),
    each giving ``c`` inputs and their next-token labels."""

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        curriculum_seqlen: int | None = None,
    ) -> torch.Tensor:
        if curriculum_seqlen is not None and curriculum_seqlen < input_ids.shape[1]:
            # labels are the inputs shifted by one: the text is the inputs and the last label
            text = torch.cat((input_ids, labels[:, -1:]), dim=1)
            rows = reshape_batch(text, curriculum_seqlen + 1)
            input_ids, labels = rows[:, :-1], rows[:, 1:]
        return super().forward(input_ids, labels)


# Models of the curriculum modes in which the model takes curriculum_seqlen itself.
SEQLEN_MODELS: dict[str, type[Llama]] = {"fold": FoldingLlama, "reshape": ReshapingLlama}


def _model(args: argparse.Namespace, efficient: bool) -> Llama:
    shape = SIZES[args.size]
    kind = SEQLEN_MODELS.get(args.curriculum_mode, Llama) if efficient else Llama
    model = kind(shape)
    if efficient and args.ltd == "on":
        convert_to_random_ltd(model, Block)
    return model


def _rows(args: argparse.Namespace, seqlen: int) -> int:
    """Rows of ``seqlen`` tokens the model receives in a step."""
    if seqlen >= args.seq:
        return args.micro_batch
    if args.curriculum_mode == "fold":
        return args.micro_batch * (args.seq // seqlen)
    if args.curriculum_mode == "reshape":
        return reshaped_rows(args.micro_batch, args.seq + 1, seqlen + 1)
    return args.micro_batch


def _tokens_read(args: argparse.Namespace, seqlen: int) -> int:
    """Input tokens the model receives in a step at curriculum length ``seqlen``."""
    return _rows(args, seqlen) * min(seqlen, args.seq)


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
                "seq_per_step": min(args.ltd_seq_per_step, args.seq),
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
        "bf16": {"enabled": on_gpu, "check_grad_overflow": args.check_grad_overflow == "on"},
        # The LR is set per step from the tokens read (_lr_at), the same function in both arms.
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": lr, "betas": [0.9, 0.95], "weight_decay": 0.1},
        },
    }
    if not efficient:
        return config
    if args.curriculum_mode != "off":
        schedule_config: dict[str, Any] = {
            "total_curriculum_step": max(int(steps * args.curriculum_fraction), 1),
            "difficulty_step": min(args.difficulty_step, args.seq),
        }
        if args.cl_schedule == "fixed_root":
            schedule_config["root_degree"] = 2
        config["curriculum_learning"] = {
            "enabled": True,
            "curriculum_type": "seqlen",
            "min_difficulty": min(args.cl_min, args.seq),
            "max_difficulty": args.seq,
            "schedule_type": args.cl_schedule,
            "schedule_config": schedule_config,
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
    if args.data_sampling != "off" and args.voc_index is not None:
        block = config.setdefault("data_efficiency", {"enabled": True, "seed": args.seed})
        block["data_sampling"] = {
            "enabled": True,
            "curriculum_learning": {
                "enabled": True,
                "curriculum_metrics": {
                    "vocabularyrarity": {
                        "index_to_sample_path": f"{args.voc_index}_index_to_sample",
                        "index_to_metric_path": f"{args.voc_index}_index_to_metric",
                        "difficulty_type": "percentile",
                        "clustering_type": "schedule_based",
                        "min_difficulty": args.ds_min,
                        "max_difficulty": 100,
                        "schedule_type": "fixed_root",
                        "schedule_config": {
                            # DeepSpeed's GPT-3 runs: as many steps as the seqlen curriculum's
                            "total_curriculum_step": max(int(steps * args.curriculum_fraction), 1),
                            "difficulty_step": 1,
                            "root_degree": args.ds_root,
                        },
                    }
                },
            },
        }
    return config


class _WindowIndices(torch.utils.data.Dataset):
    """The training windows as their indices (the batch itself is gathered on the device)."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> int:
        return index


def _vocabulary_rarity_index(args: argparse.Namespace, train: torch.Tensor) -> str:
    """DeepSpeed's ``vocab_rarity`` metric of every training window, indexed by
    slipstream.data.DataAnalyzer (untimed, as DeepSpeed's offline analysis is); returns the
    index files' prefix."""
    import tempfile

    from slipstream.data import DataAnalyzer

    windows = train.cpu()
    counts = torch.bincount(windows[:, :-1].reshape(-1), minlength=256).double()
    neg_log = -(counts.clamp(min=1) / counts.sum()).log()

    def rarity(batch: torch.Tensor) -> Any:
        # Scaled to integers (the index files hold integers); only the order matters here.
        return (neg_log[batch[:, :-1]].sum(dim=1) * 100).round().long().numpy()

    directory = Path(tempfile.mkdtemp(prefix="de_voc_"))
    DataAnalyzer(
        windows,  # type: ignore[arg-type]
        metric_names=["vocabularyrarity"],
        metric_functions=[rarity],
        metric_types=["single_value_per_sample"],
        save_path=directory,
        batch_size=256,
    ).run_map_reduce()
    return str(directory / "vocabularyrarity" / "vocabularyrarity")


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
        shapes.add((int(seqlen), int(min(kept, seqlen))))  # a layer keeping >= seqlen drops none
    return sorted(shapes)


# Shapes already run in this process: per-shape first-use costs (plan selection, allocator
# blocks, compiles) are process-wide, so a shape is warmed up once.
_WARMED: set[tuple[Any, ...]] = set()


def _warm_up(
    args: argparse.Namespace, engine: Any, efficient: bool, steps: int
) -> tuple[float, int]:
    """One forward/backward per distinct shape not yet run in this process, on a throwaway
    bf16 model; returns (seconds, shapes warmed)."""
    began = time.perf_counter()
    shapes = _schedule_shapes(engine, args, steps) if efficient else [(args.seq, args.seq)]
    if 0 < args.warm_shapes < len(shapes):  # evenly spread, the first and last included
        picks = {
            round(i * (len(shapes) - 1) / (args.warm_shapes - 1)) for i in range(args.warm_shapes)
        }
        shapes = [shapes[i] for i in sorted(picks)] if args.warm_shapes > 1 else shapes[-1:]
    ltd = efficient and args.ltd == "on"
    mode = args.curriculum_mode if efficient else "off"
    keys = [(mode, ltd, args.token_backend, args.micro_batch, *shape) for shape in shapes]
    shapes = [shape for shape, key in zip(shapes, keys, strict=True) if key not in _WARMED]
    if not shapes:
        return time.perf_counter() - began, 0
    with torch.device(engine.device):
        model = _model(args, efficient)
    if torch.cuda.is_available():
        model = model.to(torch.bfloat16)
    scheduler = None
    if efficient and args.ltd == "on":
        config = RandomLTDConfig.from_dict(_random_ltd_block(args, steps))
        scheduler = RandomLTDScheduler(config, args.micro_batch)
        attach_random_ltd(model, config, scheduler, backend=args.token_backend)
    batch = torch.randint(0, 256, (args.micro_batch, args.seq + 1), device=engine.device)
    for seqlen, kept in shapes:
        if scheduler is not None:
            scheduler.set_current_seq(kept)
            scheduler.sample_indices = None
        inputs, labels = batch[:, :-1], batch[:, 1:]
        kwargs: dict[str, Any] = {}
        if isinstance(model, (FoldingLlama, ReshapingLlama)):
            kwargs["curriculum_seqlen"] = seqlen
        else:
            inputs, labels = inputs[:, :seqlen], labels[:, :seqlen]
        model(inputs, labels, **kwargs).backward()
    del model
    _sync()
    _WARMED.update(keys)
    return time.perf_counter() - began, len(shapes)


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
        rows = _rows(args, seqlen)
        plan.append(rows * ((layers - dropping) * seqlen + dropping * min(kept, seqlen)))
    return plan


def _consumed_tokens(args: argparse.Namespace, seqlen: int, kept: int | None) -> int:
    """Megatron-DeepSpeed's ``consumed_train_tokens`` increment for one step: rows of the
    curriculum length, and with random-LTD the length averaged over the layers (the dropping
    layers count their kept tokens), rounded down as its training loop does."""
    layers = SIZES[args.size].layers
    dropping = layers - 2 if args.ltd == "on" else 0
    actual = seqlen
    if kept is not None and kept < seqlen:
        actual = (seqlen * (layers - dropping) + kept * dropping) // layers
    return _rows(args, seqlen) * actual


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
    run_began = time.perf_counter()
    steps_planned = math.ceil(budget / (args.micro_batch * args.seq))
    torch.manual_seed(args.seed)
    with torch.device(train.device):  # built in place: a 300M model's CPU init takes seconds
        model = _model(args, efficient)
    sampling = efficient and args.data_sampling != "off"
    engine, _, loader, _ = slipstream.initialize(
        model=model,
        config=_config(args, steps_planned, efficient, lr),
        training_data=_WindowIndices(train.shape[0]) if sampling else None,
        collate_fn=torch.tensor if sampling else None,
    )
    if efficient and args.ltd == "on" and args.token_backend != "auto":
        runtime = engine.data_efficiency
        attach_random_ltd(
            engine.module,
            runtime.config.data_routing.random_ltd,
            runtime.random_ltd,
            backend=args.token_backend,
        )
    warmup_seconds, warmed = _warm_up(args, engine, efficient, steps_planned)
    order = torch.randperm(train.shape[0], generator=torch.Generator().manual_seed(args.seed))
    if sampling:
        # The difficulty sampler's micro-batches, drawn ahead (host work like a prefetching
        # loader's; the baseline's permutation is made ahead too): enough for the most steps
        # a run of this budget can take (every step at the shortest curriculum length).
        most = budget // (args.micro_batch * max(min(args.cl_min, args.seq), 1)) + 1
        drawn, batches = 0, []
        for indices in loader:
            batches.append(indices)
            drawn += 1
            if drawn >= min(most, 4 * steps_planned):
                break
        order = torch.cat(batches)
    order = order.to(train.device)
    tokens, step, train_seconds = 0, 0, 0.0
    # DeepSpeed's layer-token LR clock (data-efficiency arm, --de-lr-clock layer-tokens).
    plan = (
        _layer_token_plan(engine, args, steps_planned)
        if efficient and args.de_lr_clock == "layer-tokens"
        else None
    )
    layer_tokens = 0
    # The clock the run ends on and (unless a layer-token plan) its LR follows: tokens read,
    # or DeepSpeed's consumed tokens for the data-efficiency arm with --de-lr-clock deepspeed.
    deepspeed_clock = efficient and args.de_lr_clock == "deepspeed"
    clock = 0
    curve: list[tuple[int, int, float, float]] = []  # (step, tokens, seconds, val loss)
    diverged = False
    _sync()
    began = time.perf_counter()
    while clock < budget:
        start = (step * args.micro_batch) % (order.shape[0] - args.micro_batch)
        batch = train[order[start : start + args.micro_batch]]
        if plan is None:
            step_lr = _lr_at(args, lr, clock, budget)
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
        read = _tokens_read(args, seqlen) if seqlen else budget_step(args)
        tokens += read
        if deepspeed_clock:
            kept = runtime.random_ltd.get_current_seq() if runtime.random_ltd else None
            clock += _consumed_tokens(args, seqlen or args.seq, kept)
        else:
            clock = tokens
        late = args.eval_late_every > 0 and clock >= args.eval_late_from * budget
        every = args.eval_late_every if late else args.eval_every
        if step % every == 0 or clock >= budget:
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
        f"final val {final:.4f} (untimed warm-up {warmup_seconds:.1f} s, {warmed} new shapes)",
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
        "warmed_shapes": warmed,
        "wall_seconds": time.perf_counter() - run_began,
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


def _fixed_step(engine: Any, batch: torch.Tensor, length: int, kept: int, scheduler: Any) -> None:
    """One training step on ``batch`` cut to ``length``, random-LTD (if any) keeping ``kept``."""
    if scheduler is not None:
        scheduler.set_current_seq(kept)
        scheduler.sample_indices = None
    engine.backward(engine(batch[:, :length], batch[:, 1 : length + 1]))
    engine.step()


def _synchronizing_calls(step: Any) -> list[str]:
    """Where one call of ``step`` makes the host wait on the device (CUDA's sync debug mode:
    the Python lines of the synchronizing operations; empty on the CPU)."""
    if not torch.cuda.is_available():
        return []
    import warnings

    _sync()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    _sync()
    found: dict[str, None] = {}
    for record in caught:
        if "synchroniz" in str(record.message):
            found[f"{Path(record.filename).name}:{record.lineno}"] = None
    return list(found)


def _profile_spec(spec: str, backend: str) -> tuple[int, int, str]:
    """``LENGTH:KEPT[:BACKEND]`` -> (length, kept, backend)."""
    parts = spec.split(":")
    if len(parts) not in (2, 3):
        raise SystemExit(f"--profile-shapes/--profile-table: {spec!r} is not LENGTH:KEPT[:BACKEND]")
    return int(parts[0]), int(parts[1]), parts[2] if len(parts) == 3 else backend


def _profile_shapes(args: argparse.Namespace, train: torch.Tensor) -> list[dict[str, Any]]:
    """Per-step cost at fixed ``(length, kept)`` shapes, each on a fresh engine (untimed
    towards any run): the synchronized step time, the host's time to issue a step, and for
    ``--profile-table`` shapes the top device kernels of two steps. Length ``c`` truncates the
    batch; ``kept < c`` wraps the middle layers in random-LTD keeping ``kept`` tokens."""
    rows = []
    batch = train[: args.micro_batch]
    tables = {
        _profile_spec(spec, args.token_backend) for spec in _floats_or_names(args.profile_table)
    }
    for spec in _floats_or_names(args.profile_shapes):
        length, kept, backend = _profile_spec(spec, args.token_backend)
        torch.manual_seed(args.seed)
        with torch.device(train.device):
            model = Llama(SIZES[args.size])
        scheduler = None
        if kept < length:
            convert_to_random_ltd(model, Block)
        engine, *_ = slipstream.initialize(model=model, config=_config(args, 1000, False))
        if kept < length:
            config = RandomLTDConfig.from_dict(_random_ltd_block(args, 1000))
            scheduler = RandomLTDScheduler(config, args.micro_batch)
            attach_random_ltd(engine.module, config, scheduler, backend=backend)

        step = functools.partial(_fixed_step, engine, batch, length, kept, scheduler)
        for _ in range(3):
            step()
        _sync()
        host, began = 0.0, time.perf_counter()
        for _ in range(args.profile_steps):
            issued = time.perf_counter()
            step()
            host += time.perf_counter() - issued
        _sync()
        ms = (time.perf_counter() - began) * 1e3 / args.profile_steps
        # From an idle device: the host's time to issue forward + backward, and their time to
        # finish. Issuing that takes as long as finishing means the host waited on the device
        # (a synchronization) or is the bottleneck.
        issue, finish = [], []
        for _ in range(3):
            _sync()
            began = time.perf_counter()
            if scheduler is not None:
                scheduler.set_current_seq(kept)
                scheduler.sample_indices = None
            engine.backward(engine(batch[:, :length], batch[:, 1 : length + 1]))
            issue.append(time.perf_counter() - began)
            _sync()
            finish.append(time.perf_counter() - began)
            engine.step()
        _sync()
        syncs = _synchronizing_calls(step)
        row = {"length": length, "kept": kept, "backend": backend, "step_ms": ms,
               "host_ms": host * 1e3 / args.profile_steps,
               "issue_fb_ms": min(issue) * 1e3, "fb_ms": min(finish) * 1e3,
               "synchronizing_calls": syncs}  # fmt: skip
        rows.append(row)
        print(
            f"profile: length {length} kept {kept}{f' ({backend})' if kept < length else ''}: "
            f"{ms:.2f} ms/step ({args.micro_batch * length * 1e3 / ms:,.0f} tokens/s), host "
            f"in step() calls {row['host_ms']:.2f} ms; from idle: forward+backward issued in "
            f"{row['issue_fb_ms']:.2f} ms, done in {row['fb_ms']:.2f} ms; synchronizing calls in "
            f"a step: {'; '.join(syncs) if syncs else 'none'}",
            flush=True,
        )
        if (length, kept, backend) in tables:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
            key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
            try:  # a diagnostic: a profiler that cannot start must not cost the runs
                with profile(activities=activities) as prof:
                    step()
                    step()
                    _sync()
                table = prof.key_averages().table(sort_by=key, row_limit=args.profile_rows)
            except Exception as error:
                table = f"(torch.profiler failed: {type(error).__name__}: {error})"
            print(f"profile table (two steps), length {length} kept {kept}:\n{table}", flush=True)
        engine.destroy()
        del engine, model
        gc.collect()
    return rows


def _time_to(curve: list[tuple[int, int, float, float]], target: float) -> float | None:
    """Training seconds at the first validation point at or below ``target`` (None: never)."""
    for _, _, seconds, loss in curve:
        if loss <= target:
            return seconds
    return None


def _floats_or_names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _floats(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part.strip()]


def _describe(args: argparse.Namespace, budget: int, description: str) -> str:
    params = sum(p.numel() for p in Llama(SIZES[args.size]).parameters())
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return (
        f"{args.size} GPT ({params / 1e6:.0f}M parameters, byte vocabulary), seq {args.seq}, "
        f"micro-batch {args.micro_batch} (GAS 1, 1 GPU), baseline budget {budget:,} tokens, "
        f"seed {args.seed}, {gpu}, bf16={torch.cuda.is_available()} (check_grad_overflow {args.check_grad_overflow}); {description}; AdamW "
        f"(0.9, 0.95), wd 0.1, clip 1.0, warmup {args.warmup_fraction:.0%} then cosine to "
        f"{args.min_lr_ratio}x over each run's own token budget; validation every "
        f"{args.eval_every} steps"
        + (
            f" (every {args.eval_late_every} after {args.eval_late_from:.0%} of each budget)"
            if args.eval_late_every
            else ""
        )
        + f" on {args.eval_batches * args.micro_batch} held-out windows; "
        f"data-efficiency arm: curriculum {args.curriculum_mode} (seqlen {args.cl_schedule} "
        f"from {args.cl_min}, difficulty_step {args.difficulty_step}, over "
        f"{args.curriculum_fraction:.0%} of budget/(micro-batch x seq) steps), random-LTD "
        f"{args.ltd} (kept tokens from {args.ltd_min}, seq_per_step {args.ltd_seq_per_step}, "
        f"over {args.ltd_fraction:.0%} of those steps, token ops {args.token_backend}), LR "
        f"clock {args.de_lr_clock}; data sampling {args.data_sampling}"
        + (
            f" (vocabulary rarity, percentile from {args.ds_min}, fixed_root {args.ds_root})"
            if args.data_sampling != "off"
            else ""
        )
        + "; warm-up shapes "
        f"{args.warm_shapes if args.warm_shapes else 'all'}"
        + "".join(f"; extra arm {spec}" for spec in args.de_extra)
    )


def _parse_extra(spec: str, args: argparse.Namespace) -> tuple[str, dict[str, Any], list[float]]:
    """``NAME:KEY=VALUE,...[@F,...]`` -> (name, option overrides typed as the options, fractions)."""
    head, _, tail = spec.partition("@")
    name, _, assignments = head.partition(":")
    if not name or not assignments:
        raise SystemExit(f"--de-extra {spec!r}: write NAME:KEY=VALUE[,KEY=VALUE...][@FRACTIONS]")
    overrides: dict[str, Any] = {}
    for item in assignments.split(","):
        key, _, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if key not in vars(args) or not value:
            raise SystemExit(f"--de-extra {spec!r}: {key!r} is not an option of this bench")
        current = getattr(args, key)
        overrides[key] = type(current)(value) if current is not None else value
    fractions = _floats(tail) if tail else []
    if not all(0 < f <= 1 for f in fractions):
        raise SystemExit(f"--de-extra {spec!r}: budget fractions must be in (0, 1]")
    return name, overrides, fractions


def main(argv: list[str] | None = None) -> int:
    """Run the sweep, the data-efficiency arms and the controls; print a markdown table."""
    args = parse_args(argv)
    wall = time.perf_counter()
    base_lrs = _floats(args.lrs)
    de_lrs = _floats(args.de_lrs) if args.de_lrs else base_lrs
    multipliers = _floats(args.de_lr_multipliers) if args.de_lr_multipliers else None
    fractions = _floats(args.de_budget_fractions)
    unknown = set(_floats_or_names(args.de_variants)) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"--de-variants: unknown {sorted(unknown)}; use {sorted(VARIANTS)}")
    extras = [_parse_extra(spec, args) for spec in args.de_extra]
    if multipliers == []:
        raise SystemExit("--de-lr-multipliers needs at least one multiplier")
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
    if args.data_sampling != "off" or any(
        o.get("data_sampling", "off") != "off" for _, o, _ in extras
    ):
        began = time.perf_counter()
        args.voc_index = _vocabulary_rarity_index(args, train)
        print(f"vocabulary-rarity index of {train.shape[0]:,} windows in "
              f"{time.perf_counter() - began:.1f} s (untimed)", flush=True)  # fmt: skip
    profile = _profile_shapes(args, train) if args.profile_shapes else []
    probe_rate = None
    budget = args.token_budget
    if budget is None:
        budget, probe_rate = _probe_budget(args, train)
        print(f"probe: baseline {probe_rate:,.0f} tokens/s -> budget {budget:,} tokens", flush=True)
    print(_describe(args, budget, description), flush=True)
    if multipliers is not None:
        de_plan = f"the best baseline LR x {multipliers}"
    else:
        de_plan = str(de_lrs)
    print(
        f"plan: baseline LRs {base_lrs}; data-efficiency LRs {de_plan} at budget fraction "
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
    if multipliers is not None:
        de_lrs = [best_base["lr"] * m for m in multipliers]
    skipped: list[str] = []
    base_wall = max(r["wall_seconds"] for r in results)

    def fits(fraction: float, what: str) -> bool:
        """Whether a run of this budget fraction fits in --max-seconds (estimated from the
        slowest baseline run's wall time); a skipped run is listed in the summary."""
        if not args.max_seconds:
            return True
        if time.perf_counter() - wall + 1.1 * fraction * base_wall <= args.max_seconds:
            return True
        skipped.append(what)
        print(f"skipped (--max-seconds {args.max_seconds:.0f}): {what}", flush=True)
        return False

    def rank(r: dict[str, Any]) -> tuple[float, float]:
        reached = _time_to(r["curve"], target)
        return (reached if reached is not None else math.inf, r["final_val_loss"])

    def controls(fraction: float, de_lr: float) -> None:
        if args.controls == "off" or fraction >= 1:
            return
        if args.controls == "first" and fraction != fractions[0]:
            return
        control_lrs = [best_base["lr"]]
        if args.controls == "both" and not math.isclose(de_lr, best_base["lr"]):
            control_lrs.append(de_lr)
        for control_lr in control_lrs:
            if fits(fraction, f"baseline-short lr {control_lr:.1e} at {fraction}x"):
                results.append(
                    run(args, train, valid, False, tokens_for(fraction), control_lr,
                        "baseline-short")
                )  # fmt: skip

    first = tokens_for(fractions[0])
    de_runs = []
    for i, lr in enumerate(de_lrs):
        if i == 0 or fits(fractions[0], f"data-eff lr {lr:.1e} at {fractions[0]}x"):
            de_runs.append(run(args, train, valid, True, first, lr, "data-eff"))
    results += de_runs
    best_de = min(de_runs, key=rank)
    controls(fractions[0], best_de["lr"])
    for variant in _floats_or_names(args.de_variants):
        # One technique alone, at the first fraction and the arm's best LR.
        alone = argparse.Namespace(**{**vars(args), **VARIANTS[variant]})
        if fits(fractions[0], f"data-eff-{variant} lr {best_de['lr']:.1e} at {fractions[0]}x"):
            results.append(
                run(alone, train, valid, True, first, best_de["lr"], f"data-eff-{variant}")
            )
    batch_control_done = False

    def batch_control() -> None:
        """Once the goal looks met: would a plain baseline with a smaller batch (more, cheaper
        steps, as the curriculum's short early steps are) do as well?"""
        nonlocal batch_control_done
        if args.batch_control <= 1 or batch_control_done:
            return
        arm = [_time_to(r["curve"], target) for r in results if r["label"].startswith("data-eff")]
        base = [_time_to(r["curve"], target) for r in results if r["label"].startswith("baseline")]
        arm_best = min((t for t in arm if t is not None), default=None)
        base_best = min((t for t in base if t is not None), default=None)
        if arm_best is None or base_best is None or arm_best > 0.7 * base_best:
            return
        batch_control_done = True
        divisor = args.batch_control
        small = argparse.Namespace(**{**vars(args), "micro_batch": args.micro_batch // divisor,
                                      "eval_batches": args.eval_batches * divisor,
                                      "eval_every": args.eval_every * divisor,
                                      "eval_late_every": args.eval_late_every * divisor})  # fmt: skip
        for lr in (best_base["lr"], best_base["lr"] / math.sqrt(divisor)):
            if fits(1.0, f"baseline micro-batch {small.micro_batch} lr {lr:.1e}"):
                result = run(small, train, valid, False, budget, lr, "baseline")
                result["label"] = f"baseline-mb{small.micro_batch}"
                results.append(result)

    batch_control()
    for fraction in fractions[1:]:
        if fits(fraction, f"data-eff lr {best_de['lr']:.1e} at {fraction}x"):
            results.append(
                run(args, train, valid, True, tokens_for(fraction), best_de["lr"], "data-eff")
            )
        controls(fraction, best_de["lr"])
        batch_control()

    for name, overrides, extra_fractions in extras:
        variant = argparse.Namespace(**{**vars(args), **overrides})
        for fraction in extra_fractions or fractions[:1]:
            what = f"data-eff-{name} lr {best_de['lr']:.1e} at {fraction}x"
            if fits(fraction, what):
                results.append(
                    run(variant, train, valid, True, tokens_for(fraction), best_de["lr"],
                        f"data-eff-{name}")
                )  # fmt: skip
        batch_control()

    print("\n" + _describe(args, budget, description))
    print(f"target validation loss {target:.4f} (best baseline: lr {best_base['lr']:.1e})\n")
    print(
        "| run | peak LR | budget | steps | tokens read | train s | tokens/s | final val loss "
        "| time to target (s) | vs best baseline |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    base_time = _time_to(best_base["curve"], target)
    for result in results:
        reached = _time_to(result["curve"], target)
        result["time_to_target"] = reached
        ratio = reached / base_time if reached is not None and base_time else None
        result["ratio"] = ratio
        print(
            f"| {result['label']} | {result['lr']:.1e} | {result['budget'] / budget:.2f}x | "
            f"{result['steps']} | {result['tokens']:,} | {result['train_seconds']:.1f} | "
            f"{result['tokens_per_second']:,.0f} | "
            f"{result['final_val_loss']:.4f}{' (diverged)' if result['diverged'] else ''} | "
            f"{'not reached' if reached is None else f'{reached:.1f}'} | "
            f"{'-' if ratio is None else f'{ratio:.2f}x'} |"
        )
    print("\nvalidation loss against training seconds (at most 12 points a run):")
    for result in results:
        curve = result["curve"]
        every = max(math.ceil(len(curve) / 12), 1)
        points = curve[every - 1 :: every]
        if curve and points[-1] is not curve[-1]:
            points.append(curve[-1])
        print(
            f"  {result['label']} {result['lr']:.1e} {result['budget'] / budget:.2f}x: "
            + " ".join(f"{seconds:.1f}s:{loss:.3f}" for _, _, seconds, loss in points)
        )
    # The honest reference: the fastest baseline-family run (any LR, any budget) to the target.
    base_family = [r for r in results if r["label"].startswith("baseline")]
    base_best_time = min(
        (r["time_to_target"] for r in base_family if r["time_to_target"] is not None),
        default=None,
    )
    de_best = min(
        (r for r in results if r["label"].startswith("data-eff")),
        key=lambda r: r["time_to_target"] if r["time_to_target"] is not None else math.inf,
    )
    verdict: dict[str, Any] = {"target": target, "baseline_time": base_best_time}
    if de_best["time_to_target"] is None or base_best_time is None:
        print("\nverdict: no data-efficiency run reached the target validation loss")
        verdict["ratio"] = None
    else:
        ratio = de_best["time_to_target"] / base_best_time
        verdict["ratio"] = ratio
        outcome = "met" if ratio <= 0.7 else "not met"
        if ratio <= 0.7 and len(base_lrs) > 1 and best_base["lr"] == max(base_lrs):
            # A target from a baseline whose best LR is its grid's largest is not a tuned one.
            outcome = (
                f"met, but inconclusive: the baseline's best LR {best_base['lr']:.1e} is the "
                "largest it tried"
            )
        verdict["outcome"] = outcome
        print(
            f"\nverdict: fastest data-efficiency run ({de_best['label']}, lr "
            f"{de_best['lr']:.1e}, budget {de_best['budget'] / budget:.2f}x) reaches "
            f"{target:.4f} in {de_best['time_to_target']:.1f} s; fastest baseline run (sweep "
            f"and controls) in {base_best_time:.1f} s: ratio {ratio:.2f}x (goal <= 0.70: "
            f"{outcome})"
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
    if skipped:
        print(f"skipped for time (--max-seconds): {'; '.join(skipped)}")
    print(f"(whole invocation: {time.perf_counter() - wall:.0f} s)")
    if args.json is not None:
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"args": settings, "budget": budget,
                                         "probe_rate": probe_rate, "verdict": verdict, "profile": profile,
                                         "results": results}, indent=1))  # fmt: skip
    from slipstream import comm

    comm.destroy()  # the process group initialize() made: no leak warning at exit
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
