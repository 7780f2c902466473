"""The engine with slipstream.moe layers.

ep_size 1 trains like any model. With expert parallelism (ep_size 2, and ep_size = world for the
last layer: EP×DP on 4 ranks) an MoE transformer trained through ``slipstream.initialize`` at
ZeRO stage 0, 1, 2 and 3 (fp32, gradient clipping, GAS 2) matches the same model with every
expert local on one process trained by plain PyTorch on the global batch, step by step: losses,
the clipped gradient norm and every parameter. At stage 3 expert parameters are sharded over
their expert-data-parallel group, dense ones over the data-parallel group.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slipstream.comm.testing import run_distributed

VOCAB, HIDDEN, SEQ, BATCH, STEPS, GAS = 24, 12, 6, 2, 3, 2
MAX_NORM = 0.3


class TinyMoEModel(nn.Module):
    def __init__(self, ep_size: int) -> None:
        super().__init__()
        from slipstream.moe import FeedForwardExpert, MoE

        self.embed = nn.Linear(6, 8)
        self.moe = MoE(8, FeedForwardExpert(8, 16), num_experts=2, ep_size=ep_size, k=1)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hidden, l_aux, _ = self.moe(self.embed(x))
        return nn.functional.cross_entropy(self.head(hidden), y) + 0.01 * l_aux


class MoETransformer(nn.Module):
    """Embedding, two pre-norm blocks (causal attention + MoE: top-1 with `ep_size` experts
    split, top-2 with `last_ep_size`), head. No-drop mode, no noise: the routing is a function
    of the inputs (top-2's second expert is sampled, so the caller seeds each forward)."""

    def __init__(self, ep_size: int, last_ep_size: int) -> None:
        super().__init__()
        from slipstream.moe import FeedForwardExpert, MoE

        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.norms = nn.ModuleList([nn.LayerNorm(HIDDEN) for _ in range(4)])
        self.attentions = nn.ModuleList(
            [nn.MultiheadAttention(HIDDEN, 2, batch_first=True) for _ in range(2)]
        )
        self.moes = nn.ModuleList(
            [
                MoE(HIDDEN, FeedForwardExpert(HIDDEN, 16), 2, ep_size, k=1, drop_tokens=False),
                MoE(HIDDEN, FeedForwardExpert(HIDDEN, 16), 4, last_ep_size, k=2, drop_tokens=False),
            ]
        )
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)
        l_aux = x.new_zeros(())
        for i, (attention, moe) in enumerate(zip(self.attentions, self.moes)):
            h = self.norms[2 * i](x)
            x = x + attention(h, h, h, attn_mask=mask, need_weights=False)[0]
            out, aux, _ = moe(self.norms[2 * i + 1](x))
            x, l_aux = x + out, l_aux + aux
        logits = self.head(x)
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)) + (
            0.01 * l_aux
        )


def _batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    data = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return data[:, :-1], data[:, 1:]


def _seed(step: int, micro: int, rank: int) -> None:
    torch.manual_seed(7 + 1000 * step + 100 * micro + rank)


def _reference(world_size: int) -> tuple[MoETransformer, list[dict], list[float], list[float]]:
    """The all-experts-local model trained by plain PyTorch on the global batch: per step, the
    state dict after it, the clipped norm, and every (step, micro, rank) loss."""
    torch.manual_seed(0)
    reference = MoETransformer(1, 1)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # distinct experts (MoE starts them as copies of one module)
        for moe in reference.moes:
            for param in moe.experts.parameters():  # type: ignore[union-attr]
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    initial = {k: v.clone() for k, v in reference.state_dict().items()}
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    states, norms, losses = [], [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        for micro in range(GAS):
            for rank in range(world_size):
                _seed(step, micro, rank)
                loss = reference(*_batch(step, micro, rank))
                (loss / (world_size * GAS)).backward()
                losses.append(loss.item())
        norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)))
        optimizer.step()
        states.append({k: v.clone() for k, v in reference.state_dict().items()})
    reference.load_state_dict(initial)
    return reference, states, norms, losses


def _engine_parity(world_size: int) -> dict:
    import slipstream
    from slipstream import comm
    from slipstream.moe import (
        expert_parallel_state_dict,
        split_params_into_different_moe_groups_for_optimizer,
    )
    from slipstream.zero import (
        GatheredParameters,
        register_external_parameter,
        sharded_state_of,
    )

    torch.set_num_threads(1)  # more ranks than cores: see packages/moe/tests
    rank = comm.get_rank()
    initial, states, ref_norms, ref_losses = _reference(world_size)
    worst = 0.0
    for stage in (0, 1, 2, 3):
        model = MoETransformer(2, world_size)
        model.load_state_dict(expert_parallel_state_dict(initial.state_dict(), model))
        if stage == 3:
            # MultiheadAttention's forward reads out_proj's parameters without calling it.
            for attention in model.attentions:
                for param in attention.out_proj.parameters():
                    register_external_parameter(attention, param)
        optimizer = torch.optim.SGD(
            split_params_into_different_moe_groups_for_optimizer(model), lr=0.1, momentum=0.9
        )
        config = {
            "train_micro_batch_size_per_gpu": BATCH,
            "gradient_accumulation_steps": GAS,
            "gradient_clipping": MAX_NORM,
            # Small buckets: several dense and expert buckets per reduction.
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 500},
        }
        engine, *_ = slipstream.initialize(model=model, optimizer=optimizer, config=config)
        if stage > 0:
            # dense + one part per expert group
            assert len(engine.gradient_path.parts) == (2 if world_size == 2 else 3)
        if stage == 3:
            # Experts shard over their expert-data-parallel group, dense weights over all.
            expert = next(iter(engine.module.moes[0].experts.parameters()))
            assert sharded_state_of(expert).group.world_size == world_size // 2
            assert sharded_state_of(engine.module.head.weight).group.world_size == world_size
        for step in range(STEPS):
            for micro in range(GAS):
                _seed(step, micro, rank)
                loss = engine(*_batch(step, micro, rank))
                expected_loss = ref_losses[(step * GAS + micro) * world_size + rank]
                assert abs(loss.item() - expected_loss) <= 1e-5 * abs(expected_loss)
                engine.backward(loss)
                engine.step()
            norm = engine.get_global_grad_norm()
            assert norm is not None
            assert abs(norm - ref_norms[step]) <= 1e-5 * ref_norms[step], (stage, step, norm)
            expected = expert_parallel_state_dict(states[step], engine.module)
            with GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
                current = {k: v.clone() for k, v in engine.module.state_dict().items()}
            for name, value in current.items():
                torch.testing.assert_close(
                    value, expected[name], rtol=1e-5, atol=1e-6, msg=f"stage {stage}: {name}"
                )
                worst = max(worst, float((value - expected[name]).abs().max()))
    # Checkpoints of expert-parallel models, across layouts: test_partitioned_checkpoint.py.
    fp16 = _fp16_smoke(initial) if world_size == 2 else {}
    return {
        **fp16,
        "worst": worst,
        "clipped": sum(n > MAX_NORM for n in ref_norms),
    }


def _fp16_smoke(initial: MoETransformer) -> dict:
    """fp16 with fp32 masters at stage 0 and 2: the overflow decision is agreed (equal skip
    counts), dense weights stay replicated, and both stages give about the same losses."""
    import slipstream
    from slipstream import comm
    from slipstream.moe import expert_parallel_state_dict

    rank = comm.get_rank()
    losses: dict[int, list[float]] = {}
    skipped: dict[int, int] = {}
    for stage in (0, 2):
        model = MoETransformer(2, 2)
        model.load_state_dict(expert_parallel_state_dict(initial.state_dict(), model))
        config = {
            "train_micro_batch_size_per_gpu": BATCH,
            "gradient_accumulation_steps": GAS,
            "gradient_clipping": MAX_NORM,
            "fp16": {"enabled": True, "initial_scale_power": 18, "hysteresis": 1},
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": stage},
        }
        engine, *_ = slipstream.initialize(model=model, config=config)
        losses[stage] = []
        for step in range(STEPS + 2):
            for micro in range(GAS):
                _seed(step, micro, rank)
                tokens, targets = _batch(step, micro, rank)
                loss = engine(tokens, targets)
                losses[stage].append(loss.item())
                engine.backward(loss)
                engine.step()
        skipped[stage] = engine.skipped_steps
        dense = engine.module.head.weight.detach().float()
        others = [torch.zeros_like(dense) for _ in range(2)]
        torch.distributed.all_gather(others, dense)
        assert torch.equal(others[0], others[1]), f"stage {stage}: dense weights diverged"
    counts = [torch.zeros(2, dtype=torch.long) for _ in range(2)]
    torch.distributed.all_gather(counts, torch.tensor([skipped[0], skipped[2]]))
    assert torch.equal(counts[0], counts[1]), "ranks disagreed on fp16 overflow"
    torch.testing.assert_close(
        torch.tensor(losses[0]), torch.tensor(losses[2]), rtol=2e-2, atol=2e-2
    )
    return {"fp16_skipped": skipped, "fp16_last_loss": losses[0][-1]}


@pytest.mark.parametrize("world_size", [2, 4])
def test_expert_parallel_engine_matches_all_experts_local(world_size: int) -> None:
    results = run_distributed(_engine_parity, world_size, world_size, timeout=240)
    assert all(result["clipped"] > 0 for result in results)  # clipping was active
    assert results[0]["worst"] < 1e-5
    if world_size == 2:
        for result in results:
            assert result["fp16_skipped"][0] >= 1  # a 2**18 scale overflows fp16 gradients
            assert result["fp16_skipped"][0] < STEPS + 2  # and training went on


def _worker(ep_size: int) -> str:
    import slipstream
    from slipstream import comm

    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    engine, *_ = slipstream.initialize(model=TinyMoEModel(ep_size), config=config)
    g = torch.Generator().manual_seed(comm.get_rank())
    x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
    engine.backward(engine(x, y))
    engine.step()
    weight = engine.module.moe.experts.parameters().__next__().detach().clone()
    gathered = [torch.zeros_like(weight) for _ in range(comm.get_world_size())]
    torch.distributed.all_gather(gathered, weight)
    return "agree" if torch.equal(gathered[0], gathered[1]) else "differ"


def test_moe_without_expert_parallelism_trains_replicated() -> None:
    assert run_distributed(_worker, 2, 1) == ["agree", "agree"]
