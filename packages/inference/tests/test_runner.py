"""The static-shape decode step that CUDA graphs capture, run eagerly on the CPU."""

from __future__ import annotations

import pytest
import torch

from slipstream.inference import from_hf
from slipstream.inference.generation import GenerationSettings, generate_tokens
from slipstream.inference.runner import StaticCacheRunner
from slipstream.inference.testing import tiny_hf_model

pytest.importorskip("transformers")


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_full_cache_width_step_equals_eager_decode(family: str) -> None:
    """The captured step attends over all max_len slots (stale ones masked): same tokens."""
    model = from_hf(tiny_hf_model(family))
    ids = torch.randint(3, 96, (3, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    settings = GenerationSettings(max_new_tokens=10, pad_token_id=0)
    eager = StaticCacheRunner(model, 40, cuda_graph=False)
    expected = generate_tokens(eager.prefill, eager.decode, ids, mask, settings)

    static = StaticCacheRunner(model, 40, cuda_graph=False)
    # Stale garbage in the unused slots must not leak through the mask.
    bucket = static._bucket(3)
    bucket.cache.keys.normal_()
    bucket.cache.values.normal_()

    def graph_step(tokens: torch.Tensor, positions: torch.Tensor, slot: int) -> torch.Tensor:
        bucket.key_valid[:, slot] = True
        bucket.tokens = tokens[:, None].clone()
        bucket.positions = positions[:, None].clone()
        bucket.slot = torch.tensor([slot])
        return static._graph_step(bucket)

    tokens = generate_tokens(static.prefill, graph_step, ids, mask, settings)
    assert torch.equal(tokens, expected)
