"""Hugging Face Mixtral sparse MoE blocks converted to MoE layers give the same outputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slipstream.moe import (
    ExpertParallelMixtralBlock,
    GroupedGatedFeedForwardExperts,
    LoopExperts,
    convert_mixtral_block,
    convert_mixtral_model,
)

transformers = pytest.importorskip("transformers")
from transformers import MixtralConfig, MixtralForCausalLM  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock  # noqa: E402


def _config(top_k: int = 2) -> MixtralConfig:
    config = MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=top_k,
        max_position_embeddings=32,
    )
    config._experts_implementation = "eager"
    return config


def _random_block(config: MixtralConfig) -> nn.Module:
    block = MixtralSparseMoeBlock(config).eval()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(std=0.3)  # the fused expert tensors start uninitialised
    return block


@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("grouped", [True, False])
def test_converted_block_matches(top_k, grouped):
    torch.manual_seed(top_k)
    block = _random_block(_config(top_k))
    converted = convert_mixtral_block(block, grouped_experts=grouped)
    assert isinstance(converted, ExpertParallelMixtralBlock)
    container = GroupedGatedFeedForwardExperts if grouped else LoopExperts
    assert isinstance(converted.moe.experts, container)
    x = torch.randn(3, 7, 16)
    with torch.no_grad():
        expected = block(x.clone())  # the block scales its input in place under jitter
        got = converted(x)
    expected = expected[0] if isinstance(expected, tuple) else expected
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert int(converted.moe.last_gate.num_dropped) == 0
    assert int(converted.last_exp_counts.sum()) == 21 * top_k


def test_converted_model_matches_and_trains():
    torch.manual_seed(0)
    model = MixtralForCausalLM(_config()).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, MixtralSparseMoeBlock):
                for param in module.parameters():
                    param.normal_(std=0.3)
    input_ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        expected = model(input_ids).logits
    assert convert_mixtral_model(model) == 2
    assert not any(isinstance(m, MixtralSparseMoeBlock) for m in model.modules())
    with torch.no_grad():
        got = model(input_ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    model.train()
    loss = model(input_ids, labels=input_ids).loss
    loss.backward()
    experts = [m.moe.experts for m in model.modules() if isinstance(m, ExpertParallelMixtralBlock)]
    assert all(e.gate_up_weight.grad is not None for e in experts)


class _LegacyExpert(nn.Module):
    """transformers 4.x's Mixtral expert: ``w2(act(w1 x) * w3 x)``."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(16, 24, bias=False)
        self.w3 = nn.Linear(16, 24, bias=False)
        self.w2 = nn.Linear(24, 16, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act_fn(self.w1(x)) * self.w3(x))


class _LegacyMixtralBlock(nn.Module):
    """transformers 4.x's block layout and routing, written out token by token."""

    def __init__(self) -> None:
        super().__init__()
        self.top_k = 2
        self.gate = nn.Linear(16, 4, bias=False)
        self.experts = nn.ModuleList(_LegacyExpert() for _ in range(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = x.reshape(-1, 16)
        logits = self.gate(tokens)
        weights, chosen = torch.softmax(logits.float(), dim=1).topk(self.top_k, dim=1)
        weights = weights / weights.sum(dim=1, keepdim=True)
        out = torch.zeros_like(tokens)
        for s in range(tokens.shape[0]):
            for j in range(self.top_k):
                out[s] += weights[s, j] * self.experts[int(chosen[s, j])](tokens[s])
        return out.reshape(x.shape), logits


def test_converts_the_transformers_4_layout():
    torch.manual_seed(7)
    block = _LegacyMixtralBlock()
    converted = convert_mixtral_block(block)
    assert converted.return_router_logits
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        expected, expected_logits = block(x)
        got, logits = converted(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, expected_logits)


def test_rejects_blocks_of_another_shape():
    with pytest.raises(TypeError, match="does not look like a Mixtral"):
        convert_mixtral_block(nn.Linear(4, 4))
