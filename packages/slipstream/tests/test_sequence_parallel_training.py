"""Ulysses sequence parallelism through slipstream.initialize: SP=2 × DP=2 with ZeRO-3 (and
ZeRO-2) trains a tiny Llama exactly like a single-process run on the whole batch."""

from __future__ import annotations

import copy

import pytest
import torch

from slipstream.comm.testing import run_distributed

STEPS, SEQ, SP = 3, 16, 2


def _tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _train(stage: int) -> float:
    import slipstream
    from slipstream import comm
    from slipstream.comm.sequence import sequence_parallel_cross_entropy, shard_sequence
    from slipstream.comm.sequence_hf import apply_ulysses_attention

    world, rank = comm.get_world_size(), comm.get_rank()
    dp = world // SP
    model = _tiny_llama()
    reference = copy.deepcopy(model)
    # SGD with momentum: Adam's first steps divide by |grad| + 1e-8 and so turn fp32 rounding
    # in near-zero gradients (unused embedding rows) into visible weight differences.
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "sequence_parallel_size": SP,
        "optimizer": {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000},
        "steps_per_print": 1000,
    }
    engine, _, _, _ = slipstream.initialize(model=model, config=config)
    assert engine.train_batch_size() == dp  # the batch counts DP replicas, not SP ranks
    group = engine.seq_parallel_group
    apply_ulysses_attention(engine.module, group)
    generator = torch.Generator().manual_seed(7)
    worst = 0.0
    for _ in range(STEPS):
        tokens = torch.randint(0, 64, (dp, SEQ), generator=generator)
        mine = tokens[rank // SP : rank // SP + 1]  # this rank's DP replica's sequence
        piece = shard_sequence(mine, mine, group)
        logits = engine(input_ids=piece["input_ids"], position_ids=piece["position_ids"]).logits
        loss = sequence_parallel_cross_entropy(logits, piece["shift_labels"], group)
        engine.backward(loss)
        engine.step()

        ref_opt.zero_grad()
        reference(input_ids=tokens, labels=tokens).loss.backward()
        ref_opt.step()

        from slipstream.zero import GatheredParameters

        with GatheredParameters(list(engine.module.parameters())):
            for p, q in zip(engine.module.parameters(), reference.parameters()):
                diff = (p.detach() - q.detach()).abs().max() / q.detach().abs().max()
                worst = max(worst, float(diff))
    return worst


def _sp_world() -> list[float]:
    return [_train(3), _train(2)]


def test_sp2_dp2_zero3_and_zero2_equal_single_process_training() -> None:
    results = run_distributed(_sp_world, 4, timeout=300)
    for worst in (value for ranks in results for value in ranks):
        assert worst <= 1e-5, results


def test_sequence_parallel_size_must_divide_the_world() -> None:
    import slipstream

    with pytest.raises(ValueError, match="does not divide the world size"):
        slipstream.initialize(
            model=torch.nn.Linear(2, 2),
            config={"train_batch_size": 1, "sequence_parallel_size": 3},
        )
