"""Expert parallelism on 2 and 4 spawned gloo ranks against all experts local on one process.

Each rank trains an MoE transformer whose experts are sharded (ep_size 2, and ep_size = world for
the last layer) beside a reference with every expert local. The reference replays every rank's
micro-batch (same seeds, so the same random token selection and second-expert samples) and
averages the losses, which is what data parallelism computes. Every step compares the losses,
aux losses, expert counts, which assignments were kept (same drops), the clipped gradient norm
and all parameters.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slipstream import comm
from slipstream.comm.testing import run_distributed
from slipstream.moe import (
    FeedForwardExpert,
    MoE,
    allreduce_gradients,
    clip_grad_norm_,
    convert_mixtral_block,
    expert_parallel_state_dict,
    full_state_dict,
    split_params_into_different_moe_groups_for_optimizer,
)

pytestmark = pytest.mark.slow

VOCAB, HIDDEN, SEQ, BATCH, STEPS = 32, 16, 8, 2, 3
MAX_NORM = 0.5


class Block(nn.Module):
    """Pre-norm causal attention + MoE feed-forward."""

    def __init__(self, moe: MoE) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(HIDDEN)
        self.attention = nn.MultiheadAttention(HIDDEN, 2, batch_first=True)
        self.norm2 = nn.LayerNorm(HIDDEN)
        self.moe = moe

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.norm1(x)
        mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)
        x = x + self.attention(h, h, h, attn_mask=mask, need_weights=False)[0]
        moe_out, l_aux, _ = self.moe(self.norm2(x))
        return x + moe_out, l_aux


class TinyMoETransformer(nn.Module):
    """Three MoE layers, PR-MoE style (2, 4 and 4 experts), covering the gating variants:
    top-1 with random token selection and drops (loop experts), top-2 Residual MoE with drops
    (grouped experts), top-2 in no-drop mode with ep_size = `last_ep_size`."""

    def __init__(self, ep_size: int, last_ep_size: int) -> None:
        super().__init__()
        generic = nn.Sequential(nn.Linear(HIDDEN, 24), nn.GELU(), nn.Linear(24, HIDDEN))
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(
            [
                Block(MoE(HIDDEN, generic, 2, ep_size, k=1, capacity_factor=0.8, min_capacity=0)),
                Block(
                    MoE(
                        HIDDEN,
                        FeedForwardExpert(HIDDEN, 24),
                        4,
                        ep_size,
                        k=2,
                        capacity_factor=0.75,
                        min_capacity=0,
                        use_residual=True,
                    )
                ),
                Block(
                    MoE(
                        HIDDEN,
                        FeedForwardExpert(HIDDEN, 24),
                        4,
                        last_ep_size,
                        k=2,
                        drop_tokens=False,
                    )
                ),
            ]
        )
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(tokens)
        l_aux = x.new_zeros(())
        for block in self.blocks:
            x, aux = block(x)
            l_aux = l_aux + aux
        logits = self.head(x)
        task = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        return task + 0.01 * l_aux, l_aux


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    data = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return data[:, :-1], data[:, 1:]


def _moe_layers(model: TinyMoETransformer) -> list[MoE]:
    return [block.moe for block in model.blocks]


def _check_parity(world_size: int) -> dict:
    # The harness sets OMP_NUM_THREADS=1 only after `slipstream.comm` (hence torch) is imported
    # in the child, so torch keeps one thread per core; with more ranks than cores, every op
    # then waits for a descheduled OpenMP worker (about 10 ms per op on a loaded 2-core box).
    torch.set_num_threads(1)
    rank = comm.get_rank()
    comm.comms_logger.configure(enabled=True, prof_all=True)
    torch.manual_seed(0)
    reference = TinyMoETransformer(ep_size=1, last_ep_size=1)
    # Distinct experts (each MoE starts its experts as copies of one module, like DeepSpeed).
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in _moe_layers(reference):
            for param in layer.experts.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    model = TinyMoETransformer(ep_size=2, last_ep_size=world_size)
    model.load_state_dict(expert_parallel_state_dict(reference.state_dict(), model))
    layers, ref_layers = _moe_layers(model), _moe_layers(reference)
    assert [layer.num_local_experts for layer in layers] == [1, 2, 4 // world_size]

    groups = split_params_into_different_moe_groups_for_optimizer(model)
    assert {g.get("name") for g in groups} == {None, "ep_size_2", f"ep_size_{world_size}"}
    optimizer = torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)

    worst = 0.0
    dropped = clipped = 0
    for step in range(STEPS):
        optimizer.zero_grad()
        torch.manual_seed(1000 * step + rank)
        loss, l_aux = model(*_batch(step, rank))
        loss.backward()
        allreduce_gradients(model)
        norm = clip_grad_norm_(model, MAX_NORM)
        optimizer.step()
        decisions = [layer.last_gate for layer in layers]

        ref_optimizer.zero_grad()
        for replica in range(world_size):
            torch.manual_seed(1000 * step + replica)
            ref_loss, ref_aux = reference(*_batch(step, replica))
            (ref_loss / world_size).backward()
            if replica == rank:
                torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(l_aux, ref_aux, rtol=1e-5, atol=1e-6)
                worst = max(worst, abs(loss.item() - ref_loss.item()))
                for gate, ref_layer in zip(decisions, ref_layers):
                    ref_gate = ref_layer.last_gate
                    assert gate.expert_index.equal(ref_gate.expert_index), f"step {step}: routing"
                    assert gate.kept.equal(ref_gate.kept), f"step {step}: drops differ"
                    assert gate.exp_counts.equal(ref_gate.exp_counts)
                    dropped += int(ref_gate.num_dropped)
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-6)
        clipped += int(ref_norm > MAX_NORM)
        ref_optimizer.step()

        expected = expert_parallel_state_dict(reference.state_dict(), model)
        for name, value in model.state_dict().items():
            torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6, msg=name)
            worst = max(worst, float((value - expected[name]).abs().max()))

    # Gathering every expert back gives the reference's state (to the parity tolerance).
    gathered = full_state_dict(model)
    assert gathered.keys() == reference.state_dict().keys()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(gathered[name], value, rtol=1e-5, atol=1e-6, msg=name)

    records = comm.comms_logger.records
    for name in ("moe_dispatch", "moe_combine", "moe_dispatch_backward", "moe_combine_backward"):
        assert name in records, f"{name} not logged: {sorted(records)}"
    assert "expert_grad_allreduce" in records and "dense_grad_allreduce" in records
    assert "moe_capacity" in records  # the no-drop layer agreed its capacity across the group
    assert "moe_grad_norm" in records and "moe_gather_experts" in records
    _check_mixtral_conversion()
    return {"worst": worst, "dropped": dropped, "clipped": clipped}


class FusedMixtralBlock(nn.Module):
    """The weight layout of transformers 5's MixtralSparseMoeBlock (router ``gate.weight``, fused
    ``experts.gate_up_proj`` / ``experts.down_proj``), without importing transformers: the
    conversion of the real block is checked against its own forward in test_hf.py."""

    def __init__(self, num_experts: int = 4, inter: int = 24, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(HIDDEN, num_experts, bias=False)
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.randn(num_experts, 2 * inter, HIDDEN) * 0.3)
        self.experts.down_proj = nn.Parameter(torch.randn(num_experts, HIDDEN, inter) * 0.3)
        self.experts.act_fn = nn.SiLU()


def _check_mixtral_conversion() -> None:
    """A Mixtral-layout block converted with ep_size = world matches its conversion with every
    expert local; each rank passes a different number of tokens (the no-drop capacity is agreed
    across the group)."""
    world_size, rank = comm.get_world_size(), comm.get_rank()
    torch.manual_seed(5)
    block = FusedMixtralBlock()
    local = convert_mixtral_block(block, ep_size=1)
    sharded = convert_mixtral_block(block, ep_size=world_size)
    assert sharded.moe.num_local_experts == 4 // world_size
    x = torch.randn(1, 5 + 2 * rank, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(sharded(x), local(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world_size", [2, 4])
def test_expert_parallel_matches_all_experts_local(world_size):
    results = run_distributed(_check_parity, world_size, world_size, timeout=240)
    assert all(result["dropped"] > 0 for result in results)  # drops were exercised
    assert all(result["clipped"] > 0 for result in results)  # so was clipping
    assert results[0]["worst"] < 1e-5
    print(f"world {world_size}: worst abs difference {results[0]['worst']:.2e}, {results}")
