"""tools/bench/data_efficiency_bench.py and make_text_corpus.py on CPU: DeepSpeed's token clock,
the corpus file, and one short end-to-end run of the harness."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest


def test_consumed_tokens_follow_megatron_deepspeed(bench_script) -> None:
    """Megatron-DeepSpeed counts rows x the curriculum length, layer-averaged over the random-LTD
    layers' kept tokens when they keep fewer than the length (integer division)."""
    bench = bench_script("data_efficiency_bench")
    args = bench.parse_args(["--preset", "smoke"])  # tiny: 4 layers, 2 of them dropping
    # truncation: 4 rows of 80 tokens, random-LTD keeps 32 -> (80*2 + 32*2)//4 = 56
    assert bench._consumed_tokens(args, 80, 32) == 4 * 56
    assert bench._consumed_tokens(args, 80, 128) == 4 * 80  # keeps all: the plain length
    assert bench._consumed_tokens(args, 128, None) == 4 * 128
    # Every run's bf16 block: Slipstream's default (the vote rides on the norm) unless asked.
    assert bench._config(args, 10, False)["bf16"]["check_grad_overflow"] is True
    off = bench.parse_args(["--preset", "smoke", "--check-grad-overflow", "off"])
    assert bench._config(off, 10, True)["bf16"]["check_grad_overflow"] is False
    args.ltd = "off"
    assert bench._consumed_tokens(args, 80, 32) == 4 * 80
    args.ltd, args.curriculum_mode = "on", "fold"  # folded rows: 128 // 40 = 3 rows per row
    assert bench._consumed_tokens(args, 40, 16) == 12 * ((40 * 2 + 16 * 2) // 4)
    # seqlen_reshape: 4 windows of 129 tokens in rows of 41 -> ceil(516 / 41) = 13 -> 12 rows
    args.curriculum_mode = "reshape"
    assert bench._consumed_tokens(args, 40, 16) == 12 * ((40 * 2 + 16 * 2) // 4)
    assert bench._tokens_read(args, 16) == 30 * 16  # ceil(516 / 17) = 31 -> 30 rows
    assert bench._tokens_read(args, 128) == 4 * 128  # full length: the batch as it is


def test_reshape_mode_gives_the_model_megatron_deepspeeds_rows(bench_script) -> None:
    """Through the engine: the legacy curriculum hands the model curriculum_seqlen, and the
    reshaping model's layers receive exactly reshape_batch(text, c + 1)'s inputs and labels;
    training steps see one row count per length, the rows the token clock counts."""
    import torch

    import slipstream
    from slipstream.data import reshape_batch

    bench = bench_script("data_efficiency_bench")
    args = bench.parse_args(["--preset", "smoke", "--curriculum-mode", "reshape"])
    torch.manual_seed(0)
    model = bench._model(args, True)
    assert isinstance(model, bench.ReshapingLlama)
    engine, *_ = slipstream.initialize(model=model, config=bench._config(args, 40, True))
    seen: list[torch.Tensor] = []
    model.embed.register_forward_pre_hook(lambda _, inputs: seen.append(inputs[0].clone()))
    text = torch.randint(0, 256, (args.micro_batch, args.seq + 1))
    lengths = []
    for _ in range(3):
        loss = engine(text[:, :-1], text[:, 1:])
        engine.backward(loss)
        engine.step()
        lengths.append(engine.data_efficiency.curriculum_difficulty())
    assert 16 <= lengths[0] < lengths[2] < args.seq  # three different row counts
    rows = reshape_batch(text, lengths[0] + 1)
    assert torch.equal(seen[0], rows[:, :-1])
    assert [ids.shape for ids in seen] == [
        (bench._rows(args, c), c) for c in lengths
    ]  # fmt: skip
    # The loss is the plain model's on those rows (eval: random-LTD off).
    engine.module.eval()
    with torch.no_grad():
        reshaped = model(text[:, :-1], text[:, 1:], curriculum_seqlen=lengths[0])
        plain = bench.Llama.forward(model, rows[:, :-1], rows[:, 1:])
    assert torch.equal(reshaped, plain)
    engine.destroy()


def test_vocabulary_rarity_sampling_draws_common_windows_first(tmp_path, bench_script) -> None:
    """--data-sampling voc: DataAnalyzer indexes DeepSpeed's vocabulary rarity of every window
    and the engine's difficulty loader (data_efficiency.data_sampling, percentile from 1)
    draws the first batches from the windows of the most common bytes only, every window
    once the schedule reaches 100."""
    import torch

    import slipstream

    bench = bench_script("data_efficiency_bench")
    args = bench.parse_args(["--preset", "smoke", "--data-sampling", "voc", "--ds-min", "10"])
    windows = torch.randint(0, 8, (200, args.seq + 1))  # common bytes
    rare = torch.arange(0, 200, 5)
    windows[rare, : args.seq // 2] = torch.randint(200, 256, (rare.numel(), args.seq // 2))
    args.voc_index = bench._vocabulary_rarity_index(args, windows)
    config = bench._config(args, 40, True)
    metric = config["data_efficiency"]["data_sampling"]["curriculum_learning"]
    assert metric["curriculum_metrics"]["vocabularyrarity"]["difficulty_type"] == "percentile"
    torch.manual_seed(0)
    engine, _, loader, _ = slipstream.initialize(
        model=bench._model(args, True),
        config=config,
        training_data=bench._WindowIndices(windows.shape[0]),
        collate_fn=torch.tensor,
    )
    try:
        batches = list(itertools.islice(iter(loader), 60))
    finally:
        engine.destroy()
    first = torch.cat(batches[:2])
    assert not set(first.tolist()) & set(rare.tolist())  # percentile 10: 20 common windows
    later = torch.cat(batches[-20:])
    assert set(later.tolist()) & set(rare.tolist())  # past the schedule: every window


def test_troff_to_text(bench_script) -> None:
    corpus = bench_script("make_text_corpus")
    page = (
        '.\\" a comment\n.TH CAT 1\n.SH NAME\ncat \\- concatenate files\n.SH SYNOPSIS\n'
        ".B cat\n[\\fIOPTION\\fR]... [\\fIFILE\\fR]...\n.IP \\(bu 2\nfirst item\n.PP\nplain\n"
    )
    assert corpus.troff_to_text(page) == (
        "NAME\ncat - concatenate files\nSYNOPSIS\ncat\n[OPTION]... [FILE]...\n*\nfirst item\n"
        "plain\n"
    )


def test_harness_end_to_end_with_a_corpus_file(tmp_path, bench_script) -> None:
    """One baseline LR, one truncating-curriculum + random-LTD run on DeepSpeed's clock at 0.7x,
    the curriculum alone, controls at both LRs, read from a NUL-joined corpus file."""
    bench = bench_script("data_efficiency_bench")
    text = Path(bench.__file__).read_bytes() + Path(json.__file__).read_bytes()
    docs = [b"%d\n" % i + text[i : i + 3000] for i in range(0, len(text), 300)]
    corpus = tmp_path / "corpus.bin"
    corpus.write_bytes(b"\x00".join(docs))
    out = tmp_path / "de.json"
    argv = ["--preset", "smoke", "--corpus", "file", "--corpus-file", str(corpus),
            "--lrs", "3e-3", "--de-lr-multipliers", "2", "--de-budget-fractions", "0.7",
            "--token-budget", "8192", "--eval-every", "4", "--eval-late-every", "2",
            "--de-extra", "rs:curriculum_mode=reshape", "--profile-shapes", "128:128,128:32",
            "--profile-steps", "1", "--profile-table", "128:32", "--json", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    report = json.loads(out.read_text())
    runs = {(r["label"], round(r["lr"], 9)) for r in report["results"]}
    arm = next(r for r in report["results"] if r["label"] == "data-eff")
    expected = {("baseline", 3e-3), ("data-eff", 6e-3), ("baseline-short", 3e-3),
                ("baseline-short", 6e-3), ("data-eff-cl", 6e-3), ("data-eff-rs", 6e-3)}  # fmt: skip

    def best(prefix: str) -> float:
        times = [r["time_to_target"] for r in report["results"]
                 if r["label"].startswith(prefix) and not r["label"].startswith("baseline-mb")]  # fmt: skip
        return min((t for t in times if t is not None), default=float("inf"))

    if best("data-eff") <= 0.7 * best("baseline"):  # then the half-batch baselines run
        expected |= {("baseline-mb2", 3e-3), ("baseline-mb2", round(3e-3 / 2**0.5, 9))}
    assert runs == expected
    # Truncation: early steps read fewer than micro-batch x seq tokens, so the arm takes more
    # steps than its budget / (4 x 128) while its DeepSpeed clock reaches the budget.
    assert arm["tokens"] < arm["steps"] * 4 * 128
    assert arm["steps"] > arm["budget"] // (4 * 128)
    assert all(loss == loss for *_, loss in arm["curve"])  # finite validation points
    # With random-LTD the clock counts fewer tokens than were read; without it (the curriculum
    # alone) the clock is the tokens read, so that run stops within a step of its budget.
    alone = next(r for r in report["results"] if r["label"] == "data-eff-cl")
    assert arm["tokens"] > arm["budget"] + 4 * 128
    assert alone["budget"] <= alone["tokens"] < alone["budget"] + 4 * 128
    # Per-shape first-use costs are paid once per process, outside the clocks: the controls
    # (the baseline's one shape) and every shape run before are not warmed again.
    warmed = {(r["label"], round(r["lr"], 9)): r["warmed_shapes"] for r in report["results"]}
    assert warmed[("baseline", 3e-3)] == 1
    assert warmed[("baseline-short", 3e-3)] == warmed[("baseline-short", 6e-3)] == 0
    assert arm["warmed_shapes"] > 1
    # The extra arm reshapes (DeepSpeed's seqlen_reshape): full-sized early steps, so fewer
    # steps than the truncating arm on the same budget; validation every 2 steps late in a run.
    reshaped = next(r for r in report["results"] if r["label"] == "data-eff-rs")
    assert reshaped["steps"] < arm["steps"]
    steps = [point[0] for point in reshaped["curve"]]
    assert steps[:2] == [4, 8] and 2 in {b - a for a, b in itertools.pairwise(steps)}
    # The fixed-shape profile: one row per shape, outside every run.
    assert [(r["length"], r["kept"]) for r in report["profile"]] == [(128, 128), (128, 32)]
    assert all(r["step_ms"] > 0 and 0 < r["host_ms"] for r in report["profile"])
    with pytest.raises(SystemExit, match="not an option"):
        bench._parse_extra("x:no_such=1", bench.parse_args([]))
    assert bench._parse_extra("b:difficulty_step=64,ltd=off@0.6,0.7", bench.parse_args([])) == (
        "b", {"difficulty_step": 64, "ltd": "off"}, [0.6, 0.7])  # fmt: skip
    assert report["verdict"]["target"] == pytest.approx(
        next(r for r in report["results"] if r["label"] == "baseline")["final_val_loss"]
    )
