"""The MoE layer on one process: outputs against a per-token reference, grouped vs loop experts,
DeepSpeed's dense einsum formulation, Residual MoE, optimizer groups and argument errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slipstream.moe import (
    FeedForwardExpert,
    GatedFeedForwardExpert,
    GroupedFeedForwardExperts,
    GroupedGatedFeedForwardExperts,
    LoopExperts,
    MoE,
    allreduce_gradients,
    clip_grad_norm_,
    is_moe_param,
    split_params_into_different_moe_groups_for_optimizer,
)

HIDDEN = 8


def _distinct_loop_moe(**kwargs) -> MoE:
    """A MoE with generic (loop) experts, each re-initialised so that they differ."""
    layer = MoE(HIDDEN, FeedForwardExpert(HIDDEN, 16), grouped_experts=False, **kwargs)
    assert isinstance(layer.experts, LoopExperts)
    for expert in layer.experts.local_experts:
        for param in expert.parameters():
            nn.init.normal_(param, std=0.5)
    return layer


def _reference_output(layer: MoE, tokens: torch.Tensor) -> torch.Tensor:
    """sum over a token's kept choices of weight * expert(token), one token at a time."""
    gate = layer.last_gate
    assert gate is not None
    out = torch.zeros_like(tokens)
    for s in range(tokens.shape[0]):
        for j in range(layer.k):
            if gate.kept[s, j]:
                expert = layer.experts.local_experts[int(gate.expert_index[s, j])]
                out[s] += gate.weights[s, j] * expert(tokens[s])
    return out


@pytest.mark.parametrize(
    ("k", "drop_tokens", "capacity_factor"), [(1, True, 0.5), (2, True, 0.6), (2, False, 1.0)]
)
def test_output_matches_per_token_reference(k, drop_tokens, capacity_factor):
    torch.manual_seed(0)
    layer = _distinct_loop_moe(
        num_experts=4, k=k, capacity_factor=capacity_factor, min_capacity=0, drop_tokens=drop_tokens
    )
    x = torch.randn(3, 7, HIDDEN)
    out, l_aux, counts = layer(x)
    assert out.shape == x.shape and l_aux.dim() == 0 and counts.shape == (4,)
    assert int(counts.sum()) == 21 * k
    if drop_tokens:
        assert int(layer.last_gate.num_dropped) > 0  # the case exercises dropping
    expected = _reference_output(layer, x.reshape(-1, HIDDEN))
    torch.testing.assert_close(out.reshape(-1, HIDDEN), expected, rtol=1e-5, atol=1e-6)


def test_matches_deepspeed_dense_einsum_formulation():
    torch.manual_seed(1)
    layer = _distinct_loop_moe(num_experts=4, k=2, capacity_factor=0.75, min_capacity=0)
    tokens = torch.randn(10, HIDDEN)
    out, _, _ = layer(tokens)
    gate = layer.last_gate
    dispatched = torch.einsum("sec,sm->ecm", gate.dispatch_mask().float(), tokens)
    expert_out = layer.experts(dispatched)
    expected = torch.einsum("sec,ecm->sm", gate.combine_weights(), expert_out)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def _copy_loop_into_grouped(loop: LoopExperts, grouped: nn.Module) -> None:
    experts = list(loop.local_experts)
    with torch.no_grad():
        if isinstance(grouped, GroupedFeedForwardExperts):
            grouped.fc1_weight.copy_(torch.stack([e.fc1.weight for e in experts]))
            grouped.fc1_bias.copy_(torch.stack([e.fc1.bias for e in experts]))
            grouped.fc2_weight.copy_(torch.stack([e.fc2.weight for e in experts]))
            grouped.fc2_bias.copy_(torch.stack([e.fc2.bias for e in experts]))
        else:
            fused = [torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in experts]
            grouped.gate_up_weight.copy_(torch.stack(fused))
            grouped.down_weight.copy_(torch.stack([e.down_proj.weight for e in experts]))


@pytest.mark.parametrize(
    "expert",
    [FeedForwardExpert(HIDDEN, 12, activation="gelu"), GatedFeedForwardExpert(HIDDEN, 12)],
    ids=["ffn", "gated"],
)
def test_grouped_experts_match_the_loop(expert):
    torch.manual_seed(2)
    kwargs = dict(num_experts=4, k=2, min_capacity=0, top2_2nd_expert_sampling=False)
    loop = MoE(HIDDEN, expert, grouped_experts=False, **kwargs)
    for param in loop.experts.parameters():
        nn.init.normal_(param, std=0.5)
    grouped = MoE(HIDDEN, expert, **kwargs)
    expected_type = (
        GroupedFeedForwardExperts
        if isinstance(expert, FeedForwardExpert)
        else GroupedGatedFeedForwardExperts
    )
    assert isinstance(grouped.experts, expected_type)
    grouped.gate.load_state_dict(loop.gate.state_dict())
    _copy_loop_into_grouped(loop.experts, grouped.experts)
    x = torch.randn(20, HIDDEN)
    out_loop, aux_loop, _ = loop(x)
    out_grouped, aux_grouped, _ = grouped(x)
    torch.testing.assert_close(out_grouped, out_loop, rtol=1e-5, atol=1e-6)
    ((out_loop**2).sum() + aux_loop).backward()
    ((out_grouped**2).sum() + aux_grouped).backward()
    torch.testing.assert_close(grouped.gate.wg.weight.grad, loop.gate.wg.weight.grad)
    loop_grads = {name: p.grad for name, p in loop.experts.named_parameters()}
    if isinstance(expert, FeedForwardExpert):
        stacked = torch.stack([loop_grads[f"local_experts.{i}.fc1.weight"] for i in range(4)])
        torch.testing.assert_close(grouped.experts.fc1_weight.grad, stacked, rtol=1e-5, atol=1e-6)
    else:
        stacked = torch.stack([loop_grads[f"local_experts.{i}.down_proj.weight"] for i in range(4)])
        torch.testing.assert_close(grouped.experts.down_weight.grad, stacked, rtol=1e-5, atol=1e-6)


def test_residual_moe_mixes_dense_and_expert_outputs():
    torch.manual_seed(3)
    layer = MoE(HIDDEN, FeedForwardExpert(HIDDEN, 16), num_experts=2, use_residual=True)
    plain = MoE(HIDDEN, FeedForwardExpert(HIDDEN, 16), num_experts=2)
    plain.load_state_dict(
        {k: v for k, v in layer.state_dict().items() if k.startswith(("gate.", "experts."))}
    )
    x = torch.randn(6, HIDDEN)
    torch.manual_seed(4)
    out, _, _ = layer(x)
    torch.manual_seed(4)
    moe_out, _, _ = plain(x)
    mix = torch.softmax(layer.coefficient(x), dim=-1)
    expected = moe_out * mix[:, :1] + layer.mlp(x) * mix[:, 1:]
    torch.testing.assert_close(out, expected)
    assert not any(is_moe_param(p) for p in layer.mlp.parameters())  # the dense MLP is dense


def test_optimizer_groups_split_expert_params():
    model = nn.Sequential(
        nn.Linear(HIDDEN, HIDDEN),
        MoE(HIDDEN, FeedForwardExpert(HIDDEN, 16), num_experts=2),
        MoE(HIDDEN, nn.Linear(HIDDEN, HIDDEN), num_experts=4),  # PR-MoE: another expert count
    )
    groups = split_params_into_different_moe_groups_for_optimizer(
        [{"params": list(model.parameters()), "lr": 0.1, "weight_decay": 0.01}]
    )
    dense, moe = groups
    assert not dense.get("moe") and moe["moe"] and moe["name"] == "ep_size_1"
    assert moe["lr"] == 0.1 and moe["weight_decay"] == 0.01
    expert_ids = {id(p) for p in model[1].experts.parameters()} | {
        id(p) for p in model[2].experts.parameters()
    }
    assert {id(p) for p in moe["params"]} == expert_ids
    assert len(dense["params"]) + len(moe["params"]) == len(list(model.parameters()))
    # A cap on group size splits the MoE group; a module stands for one group.
    capped = split_params_into_different_moe_groups_for_optimizer(model, max_group_size=300)
    moe_groups = [g for g in capped if g.get("moe")]
    assert len(moe_groups) > 1 and all(
        sum(p.numel() for p in g["params"]) <= 300 for g in moe_groups
    )
    torch.optim.AdamW(capped)  # accepted by a torch optimizer
    with pytest.raises(ValueError, match="'params'"):
        split_params_into_different_moe_groups_for_optimizer([{"lr": 1.0}])
    allreduce_gradients(model)  # no process group: nothing to do, no error


def test_layer_arguments_are_validated():
    with pytest.raises(ValueError, match="not divisible by ep_size=2"):
        MoE(HIDDEN, nn.Linear(HIDDEN, HIDDEN), num_experts=3, ep_size=2)
    with pytest.raises(RuntimeError, match="init_distributed"):
        MoE(HIDDEN, nn.Linear(HIDDEN, HIDDEN), num_experts=2, ep_size=2)
    layer = MoE(HIDDEN, nn.Linear(HIDDEN, HIDDEN), num_experts=2)
    with pytest.raises(ValueError, match="hidden size 8"):
        layer(torch.randn(3, HIDDEN + 1))
    with pytest.raises(ValueError, match="unknown activation 'tanhh'"):
        FeedForwardExpert(HIDDEN, 4, activation="tanhh")


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_norm_matches_torch_on_one_process(norm_type):
    torch.manual_seed(5)
    layers = [MoE(HIDDEN, FeedForwardExpert(HIDDEN, 16), num_experts=2) for _ in range(2)]
    for layer in layers:
        layer(torch.randn(6, HIDDEN))[0].square().sum().backward()
    grads = [p.grad.clone() for p in layers[0].parameters()]
    for p, g in zip(layers[1].parameters(), grads):
        p.grad = g.clone()
    norm = clip_grad_norm_(layers[0], 0.1, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(layers[1].parameters(), 0.1, norm_type)
    assert expected > 0.1  # clipping is active
    torch.testing.assert_close(norm, expected)
    for p, q in zip(layers[0].parameters(), layers[1].parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_bf16_model_still_routes_in_float32():
    torch.manual_seed(6)
    layer = MoE(HIDDEN, FeedForwardExpert(HIDDEN, 16), num_experts=4, k=2).to(torch.bfloat16)
    x = torch.randn(2, 5, HIDDEN, dtype=torch.bfloat16)
    out, l_aux, _ = layer(x)
    assert out.dtype == torch.bfloat16 and l_aux.dtype == torch.float32
    assert layer.last_gate.logits.dtype == torch.float32
    expected = torch.nn.functional.linear(
        x.reshape(-1, HIDDEN).float(), layer.gate.wg.weight.float()
    )
    torch.testing.assert_close(layer.last_gate.logits, expected)
    out.float().sum().backward()
    assert layer.gate.wg.weight.grad is not None


def test_group_lookups_and_resharding_errors_are_clear():
    from slipstream.moe import (
        expert_parallel_state_dict,
        full_state_dict,
        get_expert_data_parallel_group,
        get_expert_parallel_groups,
    )

    with pytest.raises(ValueError, match="ep_size=0 must be >= 1"):
        get_expert_parallel_groups(0)
    layer = MoE(HIDDEN, FeedForwardExpert(HIDDEN, 16), num_experts=2)
    assert get_expert_data_parallel_group("ep_size_1") is None  # the world
    with pytest.raises(KeyError, match="no expert groups named 'ep_size_7'"):
        get_expert_data_parallel_group("ep_size_7")
    full = layer.state_dict()
    assert expert_parallel_state_dict(full, layer).keys() == full.keys()
    loop = _distinct_loop_moe(num_experts=3)
    gathered = full_state_dict(nn.Sequential(loop))
    for key, value in nn.Sequential(loop).state_dict().items():
        assert gathered[key].equal(value), key
    del full["experts.fc1_weight"]
    with pytest.raises(KeyError, match=r"experts\.fc1_weight"):
        expert_parallel_state_dict(full, layer)
