"""Gating arithmetic on hand-made logits: capacity, drops, top-k choice, weights, aux loss, noise."""

from __future__ import annotations

import math

import pytest
import torch

from slipstream.moe import TopKGate, compute_capacity, top_k_gating


def _logits(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_capacity_arithmetic():
    assert compute_capacity(10, 4, 1.0, 0) == 3  # ceil(2.5)
    assert compute_capacity(8, 4, 1.0, 0) == 2  # exact split
    assert compute_capacity(10, 4, 1.0, 4) == 4  # floored at min_capacity
    assert compute_capacity(16, 4, 1.25, 0) == 5  # ceil(4 * 1.25)
    assert compute_capacity(16, 4, 1.5, 0, k=2) == 12  # top-2 doubles the slots
    assert compute_capacity(9, 4, 1.0, 0, k=3) == 7  # ceil(2.25 * 3)
    with pytest.raises(ValueError, match="num_experts=0"):
        compute_capacity(4, 0, 1.0, 0)


# Six tokens over two experts: tokens 0-4 prefer expert 0, token 5 prefers expert 1.
_TOP1 = [[2.0, 0.0], [1.0, 0.5], [3.0, -1.0], [0.5, 0.0], [1.5, 1.0], [0.0, 2.0]]


def test_top1_drops_latest_tokens_without_rts():
    logits = _logits(_TOP1)
    gate = top_k_gating(logits, 1, capacity_factor=1.0, min_capacity=0, use_rts=False)
    assert gate.capacity == 3  # ceil(6 / 2 * 1.0)
    assert gate.expert_index[:, 0].tolist() == [0, 0, 0, 0, 0, 1]
    assert gate.exp_counts.tolist() == [5, 1]  # counted before dropping
    assert gate.kept[:, 0].tolist() == [True, True, True, False, False, True]
    assert int(gate.num_dropped) == 2
    assert gate.location[gate.kept].tolist() == [0, 1, 2, 0]
    probs = torch.softmax(logits, dim=1)
    expected = torch.tensor([probs[0, 0], probs[1, 0], probs[2, 0], 0.0, 0.0, probs[5, 1]])
    torch.testing.assert_close(gate.weights[:, 0], expected)  # top-1: not renormalised
    # l_aux = E * sum_e mean_gate_e * fraction_of_tokens_e
    me = probs.mean(dim=0)
    ce = torch.tensor([5 / 6, 1 / 6])
    torch.testing.assert_close(gate.l_aux, 2 * torch.sum(me * ce))
    # The dense DeepSpeed form agrees with the sparse one.
    dense = gate.combine_weights()
    assert dense.shape == (6, 2, 3)
    assert dense[2, 0, 2] == probs[2, 0] and dense[5, 1, 0] == probs[5, 1]
    assert dense[3].abs().sum() == 0 and dense[4].abs().sum() == 0
    assert gate.dispatch_mask().sum() == 4


def test_top1_random_token_selection_keeps_random_subsets_of_capacity():
    logits = _logits(_TOP1)
    subsets = set()
    for seed in range(30):
        torch.manual_seed(seed)
        gate = top_k_gating(logits, 1, capacity_factor=1.0, min_capacity=0, use_rts=True)
        kept = gate.kept[:, 0].tolist()
        assert kept[5] is True  # expert 1 is under capacity: nothing dropped there
        chosen = tuple(i for i in range(5) if kept[i])
        assert len(chosen) == 3  # expert 0 keeps exactly its capacity
        # Kept tokens take slots 0..2 in token order.
        assert gate.location[list(chosen), 0].tolist() == [0, 1, 2]
        subsets.add(chosen)
        torch.manual_seed(seed)
        again = top_k_gating(logits, 1, capacity_factor=1.0, min_capacity=0, use_rts=True)
        assert again.kept.equal(gate.kept)  # reproducible under a seed
    assert len(subsets) > 3  # the choice is random, not positional
    assert set().union(*subsets) == {0, 1, 2, 3, 4}


def test_top2_choices_drops_and_renormalisation():
    # 4 tokens, 3 experts. First choices: 0, 0, 0, 1; second choices: 1, 2, 1, 0.
    logits = _logits([[3.0, 2.0, 0.0], [3.0, 0.0, 1.0], [2.0, 1.5, 0.0], [1.0, 3.0, 0.0]])
    gate = top_k_gating(
        logits, 2, capacity_factor=0.75, min_capacity=0, second_expert_sampling=False
    )
    assert gate.capacity == 2  # ceil(4 / 3 * 0.75 * 2)
    assert gate.expert_index.tolist() == [[0, 1], [0, 2], [0, 1], [1, 0]]
    assert gate.exp_counts.tolist() == [4, 3, 1]
    # Expert 0: first choices of tokens 0, 1 fill it; token 2's first choice and token 3's
    # second choice are dropped. Expert 1: token 3's first choice (slot 0) beats token 0's
    # second choice (slot 1); token 2's second choice is dropped.
    assert gate.kept.tolist() == [[True, True], [True, True], [False, False], [True, False]]
    assert gate.location[0].tolist() == [0, 1] and gate.location[3, 0] == 0
    probs = torch.softmax(logits, dim=1)
    w0 = probs[0, [0, 1]] / probs[0, [0, 1]].sum()
    w1 = probs[1, [0, 2]] / probs[1, [0, 2]].sum()
    torch.testing.assert_close(gate.weights[0], w0)
    torch.testing.assert_close(gate.weights[1], w1)
    # Token 3 lost its second choice: its first takes all the weight.
    torch.testing.assert_close(gate.weights[3], torch.tensor([1.0, 0.0]))
    assert gate.weights[2].abs().sum() == 0  # fully dropped
    # Top-2 aux loss counts first choices only: E * sum(me * ce).
    ce = torch.tensor([3 / 4, 1 / 4, 0.0])
    torch.testing.assert_close(gate.l_aux, 3 * torch.sum(probs.mean(0) * ce))


def test_top_k_selection_weights_and_aux_loss():
    torch.manual_seed(0)
    logits = torch.randn(12, 5)
    gate = top_k_gating(logits, 3, capacity_factor=2.0, min_capacity=0)
    probs = torch.softmax(logits, dim=1)
    top = probs.topk(3, dim=1)
    assert gate.expert_index.equal(top.indices)
    assert gate.capacity == math.ceil(12 / 5 * 2.0 * 3)  # large enough: nothing dropped
    assert bool(gate.kept.all())
    torch.testing.assert_close(gate.weights, top.values / top.values.sum(1, keepdim=True))
    counts = torch.zeros(5).index_add_(0, top.indices.reshape(-1), torch.ones(36))
    assert gate.exp_counts.tolist() == counts.long().tolist()
    # k > 2: the fraction counts all assignments, and the loss is divided by k.
    fraction = counts / 12
    torch.testing.assert_close(gate.l_aux, 5 / 3 * torch.sum(probs.mean(0) * fraction))


def test_aux_loss_is_one_for_a_balanced_router():
    logits = torch.zeros(8, 4)
    logits[torch.arange(8), torch.arange(8) % 4] = 10.0
    gate = top_k_gating(logits, 1, min_capacity=0, use_rts=False)
    torch.testing.assert_close(gate.l_aux, torch.tensor(1.0), atol=1e-3, rtol=0)
    skewed = top_k_gating(torch.zeros(8, 4).index_fill_(1, torch.tensor([0]), 10.0), 1)
    assert skewed.l_aux > 3.9  # everything on one expert: l_aux -> E


@pytest.mark.parametrize("k", [1, 2, 3])
def test_no_drop_mode_loses_no_token(k):
    torch.manual_seed(k)
    logits = torch.randn(40, 4)
    logits[:, 0] += 3.0  # heavily imbalanced towards expert 0
    gate = top_k_gating(logits, k, drop_tokens=False, min_capacity=0)
    assert bool(gate.kept.all())
    assert int(gate.kept.sum()) == 40 * k and int(gate.num_dropped) == 0
    assert gate.capacity == int(gate.exp_counts.max())
    # Every expert's slots are distinct and within capacity.
    slots = gate.expert_index * gate.capacity + gate.location
    assert slots.unique().numel() == 40 * k
    assert int(gate.location.max()) < gate.capacity
    weight_sums = gate.weights.sum(dim=1)
    expected = torch.ones(40) if k > 1 else torch.softmax(logits, 1).max(1).values
    torch.testing.assert_close(weight_sums, expected)
    # The same logits with dropping do lose tokens, so the test above is not vacuous.
    dropping = top_k_gating(logits, k, drop_tokens=True, min_capacity=0, use_rts=False)
    assert int(dropping.num_dropped) > 0


def test_used_token_mask_excludes_tokens():
    logits = _logits(_TOP1)
    used = torch.tensor([1, 0, 1, 1, 0, 1])
    for use_rts in (False, True):
        gate = top_k_gating(
            logits, 1, capacity_factor=1.0, min_capacity=0, use_rts=use_rts, used_token=used
        )
        assert gate.exp_counts.tolist() == [3, 1]
        assert gate.kept[:, 0].tolist() == [True, False, True, True, False, True]


def test_second_expert_sampling_never_repeats_the_first():
    torch.manual_seed(0)
    logits = torch.zeros(400, 4)
    logits[:, 0] = 1.0  # expert 0 is everyone's first choice; 1-3 tie for second
    gate = top_k_gating(logits, 2, drop_tokens=False, second_expert_sampling=True)
    assert bool((gate.expert_index[:, 0] == 0).all())
    second = gate.expert_index[:, 1]
    assert bool((second != 0).all())
    counts = torch.bincount(second, minlength=4)[1:]
    assert bool((counts > 80).all())  # roughly uniform over the three tied experts


def test_rsample_changes_choice_not_weights():
    torch.manual_seed(0)
    logits = torch.randn(200, 4) * 0.1  # near ties: noise flips many choices
    clean = top_k_gating(logits, 1, drop_tokens=False)
    noisy = top_k_gating(logits, 1, drop_tokens=False, rsample=True)
    changed = noisy.expert_index != clean.expert_index
    assert int(changed.sum()) > 20
    probs = torch.softmax(logits, dim=1)
    torch.testing.assert_close(noisy.weights, probs.gather(1, noisy.expert_index))


def test_gate_noise_policies_apply_in_training_only():
    torch.manual_seed(0)
    gate = TopKGate(4, 4, k=1, noisy_gate_policy="Jitter", drop_tokens=False, jitter_eps=0.05)
    with torch.no_grad():
        gate.wg.weight.copy_(torch.eye(4))  # logits = (jittered) input
    tokens = torch.rand(64, 4) + 0.5
    ratio = gate(tokens).logits.detach() / tokens
    assert bool(((ratio >= 0.95 - 1e-6) & (ratio <= 1.05 + 1e-6)).all())
    assert float((ratio - 1).abs().max()) > 0.01  # noise was applied
    gate.eval()
    torch.testing.assert_close(gate(tokens).logits, tokens)
    rsample = TopKGate(4, 4, k=1, noisy_gate_policy="RSample", drop_tokens=False).eval()
    first = rsample(tokens).expert_index
    assert rsample(tokens).expert_index.equal(first)  # deterministic in eval


def test_eval_capacity_factor_is_used_in_eval():
    gate = TopKGate(4, 2, k=1, capacity_factor=1.0, eval_capacity_factor=2.0, min_capacity=0)
    tokens = torch.randn(10, 4)
    assert gate(tokens).capacity == 5
    assert gate.eval()(tokens).capacity == 10


def test_invalid_arguments_say_what_to_do():
    with pytest.raises(ValueError, match="k=5 must be between 1"):
        top_k_gating(torch.randn(4, 4), 5)
    with pytest.raises(ValueError, match="noisy_gate_policy='Gaussian'"):
        TopKGate(4, 4, noisy_gate_policy="Gaussian")
    assert TopKGate(4, 4, noisy_gate_policy="None").noisy_gate_policy is None
