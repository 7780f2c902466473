"""Logits processors and sampling against Hugging Face's own processors."""

from __future__ import annotations

import pytest
import torch

from slipstream.inference import init_inference
from slipstream.inference.generation import GenerationSettings, process_logits
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
