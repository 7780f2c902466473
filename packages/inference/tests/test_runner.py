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


def test_moe_decode_path_equals_the_expert_loop() -> None:
    """The GPU decode path of a MoE layer (moe_gemv per (token, expert) row, no host sync),
    run here through the ops' torch references, equals the expert loop (fp32)."""
    from slipstream.inference import init_inference
    from slipstream.inference.testing import tiny_hf_model

    engine = init_inference(
        tiny_hf_model("mixtral"), dtype=torch.float32, replace_with_kernel_inject=True
    )
    assert engine.fused is not None
    moe = engine.fused.blocks[0].moe
    x = torch.randn(3, moe.router.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        probs = torch.softmax(moe.router(x).float(), dim=-1)
        weights, experts = torch.topk(probs, moe.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        torch.testing.assert_close(moe._decode(x, weights, experts), moe(x), rtol=1e-5, atol=1e-6)
