"""Logits processors and sampling against Hugging Face's own processors."""

from __future__ import annotations

import pytest
import torch

from slipstream.inference import init_inference
from slipstream.inference.generation import (
    GenerationSettings,
    StopStrings,
    process_logits,
    select_tokens,
)
from slipstream.inference.testing import tiny_hf_model

transformers = pytest.importorskip("transformers")


def test_processors_equal_hf() -> None:
    from transformers import (
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(4, 50, generator=generator) * 3
    sequences = torch.randint(0, 50, (4, 7), generator=generator)
    settings = GenerationSettings(
        do_sample=True, temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.3
    )
    expected = scores.clone()
    for processor in (
        RepetitionPenaltyLogitsProcessor(1.3),
        TemperatureLogitsWarper(0.7),
        TopKLogitsWarper(20),
        TopPLogitsWarper(0.8),
    ):
        expected = processor(sequences, expected)
    assert torch.equal(process_logits(scores, sequences, 0, settings), expected)


def test_greedy_without_processors_keeps_the_logits() -> None:
    """Plain greedy search takes the argmax of the logits as they come (no fp32 copy of the
    vocabulary); a processor turns them into fp32 scores first, as Hugging Face does."""
    logits = torch.randn(2, 40, dtype=torch.bfloat16)
    sequences = torch.zeros(2, 3, dtype=torch.long)
    assert process_logits(logits, sequences, 0, GenerationSettings()) is logits
    banned = GenerationSettings(min_new_tokens=2, eos_token_id=[5])
    scores = process_logits(logits, sequences, 0, banned)
    assert scores.dtype == torch.float32 and scores[:, 5].eq(-float("inf")).all()
    assert torch.equal(scores[:, :5], logits[:, :5].float())
    assert process_logits(logits, sequences, 2, banned) is logits  # minimum reached
    penalty = GenerationSettings(repetition_penalty=1.2)
    assert process_logits(logits, sequences, 0, penalty).dtype == torch.float32
    assert torch.equal(select_tokens(logits, GenerationSettings()), logits.float().argmax(-1))


def test_sampling_with_penalty_and_min_tokens() -> None:
    model = tiny_hf_model("llama", layers=1)
    engine = init_inference(
        model, dtype=torch.float32, replace_with_kernel_inject=True, max_out_tokens=40
    )
    ids = torch.randint(3, 96, (2, 6))
    # top_k=1 sampling is greedy; with a repetition penalty it must equal HF's greedy + penalty.
    kwargs = {"max_new_tokens": 10, "repetition_penalty": 1.5, "pad_token_id": 0}
    expected = model.generate(ids, do_sample=False, eos_token_id=None, **kwargs)
    sampled = engine.generate(ids, do_sample=True, top_k=1, eos_token_id=None, **kwargs)
    assert torch.equal(sampled, expected)
    # Sampling is reproducible from a generator and stays inside the top-k set.
    one = engine.generate(ids, do_sample=True, top_k=3, generator=torch.Generator().manual_seed(5))
    two = engine.generate(ids, do_sample=True, top_k=3, generator=torch.Generator().manual_seed(5))
    assert torch.equal(one, two)
    # min_new_tokens bans EOS until reached; HF does the same.
    eos = int(expected[0, 6])
    kwargs = {"max_new_tokens": 6, "min_new_tokens": 3, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(
        engine.generate(ids, eos_token_id=eos, **kwargs),
        model.generate(ids, eos_token_id=eos, **kwargs),
    )


def test_refused_generate_arguments() -> None:
    engine = init_inference(
        tiny_hf_model("llama", layers=1), dtype=torch.float32, replace_with_kernel_inject=True
    )
    ids = torch.randint(3, 96, (1, 4))
    with pytest.raises(NotImplementedError, match="num_beams=4"):
        engine.generate(ids, num_beams=4)
    with pytest.raises(TypeError, match="max_new_tokenz"):
        engine.generate(ids, max_new_tokenz=4)
    mask = torch.tensor([[1, 1, 1, 0]])
    with pytest.raises(ValueError, match="left-padded"):
        engine.generate(ids, attention_mask=mask)


class _TagTokenizer:
    """Decodes token ``i`` as ``<i>``: stop strings can then start inside one token."""

    def decode(self, ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)


def test_stop_strings_end_rows() -> None:
    engine = init_inference(
        tiny_hf_model("llama", layers=1), dtype=torch.float32, replace_with_kernel_inject=True
    )
    ids = torch.randint(3, 96, (2, 5), generator=torch.Generator().manual_seed(3))
    kwargs = {"max_new_tokens": 10, "do_sample": False}
    full = engine.generate(ids, eos_token_id=None, **kwargs)
    tokenizer = _TagTokenizer()
    # A stop string spanning row 0's 3rd and 4th new tokens, starting inside the 3rd.
    stop = tokenizer.decode(full[0, 7:9].tolist())[2:]

    def first_hit(row: torch.Tensor) -> int | None:  # new tokens kept, by plain scanning
        for new in range(1, 11):
            if tokenizer.decode(row[: 5 + new].tolist()).endswith(stop):
                return new
        return None

    hits = [first_hit(full[0]), first_hit(full[1])]
    assert hits[0] is not None and hits[0] <= 4 and hits[1] != hits[0]
    # Without EOS ids (Hugging Face pads only with EOS criteria): the rows run until all stop.
    out = engine.generate(ids, eos_token_id=None, stop_strings=stop, tokenizer=tokenizer, **kwargs)
    last = 10 if None in hits else max(h for h in hits if h is not None)
    assert torch.equal(out, full[:, : 5 + last])
    # With EOS ids: a row that hit a stop string is padded from then on.
    out = engine.generate(
        ids, eos_token_id=95, pad_token_id=0, stop_strings=[stop], tokenizer=tokenizer, **kwargs
    )
    expected = full[:, : out.shape[1]].clone()
    for row, hit in enumerate(hits):
        if hit is not None:
            expected[row, 5 + hit :] = 0
    assert not bool((full == 95).any())  # the EOS id never comes: only the stop string ends
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="needs the tokenizer"):
        engine.generate(ids, stop_strings=stop, **kwargs)
    with pytest.raises(ValueError, match="non-empty"):
        StopStrings([""], tokenizer)
