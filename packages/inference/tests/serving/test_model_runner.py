"""Ragged batching over the paged cache equals one-request-at-a-time Hugging Face greedy
generation, token for token (fp32), with chunked prefill, prefix sharing and preemption."""

from __future__ import annotations

import pytest
import torch

from slipstream.inference.serving import SamplingParams, ServingConfig, ServingEngine

NEW_TOKENS = 12


def _prompts(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    shared = torch.randint(4, vocab, (20,), generator=generator).tolist()
    lengths = [3, 17, 41, 30, 9]
    prompts = [torch.randint(4, vocab, (n,), generator=generator).tolist() for n in lengths]
    return [*prompts, [*shared, 5, 6], [*shared, 7]]  # two share a 20-token prefix


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    ("model_type", "config"),
    [
        # Budget 24 splits the 41- and 30-token prompts across steps, fused with decodes.
        ("llama", {"max_num_batched_tokens": 24, "num_blocks": 64}),
        # 10 blocks of 16 cannot hold all seven requests: preemption with recompute.
        ("llama", {"max_num_batched_tokens": 64, "num_blocks": 10, "max_model_len": 160}),
        ("qwen2", {"max_num_batched_tokens": 32, "num_blocks": 64}),
    ],
    ids=["llama-splitfuse", "llama-preempt", "qwen2"],
)
def test_batched_serving_equals_hf_greedy(make_model, model_type: str, config: dict) -> None:
    model = make_model(model_type)
    prompts = _prompts(model.config.vocab_size)
    expected = [_hf_greedy(model, prompt) for prompt in prompts]
    engine = ServingEngine(model, None, ServingConfig(**config))
    outputs = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [out.new_token_ids for out in outputs] == expected
    assert all(out.finish_reason == "length" for out in outputs)
    assert engine.scheduler.kv.pool.num_free == engine.scheduler.kv.pool.num_blocks
    if config["num_blocks"] == 10:
        assert engine.stats.preemptions > 0
    else:
        assert outputs[-1].num_cached_tokens == 16  # one full block of the shared prefix


def test_unsupported_architecture_is_refused() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)
    gpt2 = transformers.GPT2LMHeadModel(config)
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        ServingEngine(gpt2, None, ServingConfig(num_blocks=8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_batched_serving_equals_hf_greedy_on_gpu(make_model) -> None:
    """The Triton paged-attention kernel in the loop (fp32, IEEE dots): same tokens as HF."""
    model = make_model("llama").cuda()
    prompts = _prompts(model.config.vocab_size)
    expected = []
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt], device="cuda"),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        expected.append(out[0, len(prompt) :].tolist())
    engine = ServingEngine(model, None, ServingConfig(max_num_batched_tokens=24, num_blocks=64))
    outputs = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [out.new_token_ids for out in outputs] == expected
