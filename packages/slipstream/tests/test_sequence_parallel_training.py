"""Ulysses sequence parallelism through slipstream.initialize: SP=2 × DP=2 with ZeRO-3 (and
ZeRO-2), and SP=2 × AutoTP=2 (ZeRO-1 and stage 0), train a tiny Llama exactly like a
single-process run on the whole batch."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from slipstream.comm.testing import run_distributed

STEPS, SEQ, SP = 3, 16, 2


def _tiny_llama(heads: int = 4, kv_heads: int = 2) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _check_sample_counters(engine: Any, micro: int, replicas: int) -> None:
    """Samples count once per data-parallel replica, not once per SP rank."""
    assert engine.global_samples == STEPS * micro * replicas, engine.global_samples
    samples_per_s, tokens_per_s, _ = engine.throughput.rates()
    # Every sample is SEQ tokens, spread over the SP ranks: tokens/s = SEQ × samples/s.
    assert abs(tokens_per_s / samples_per_s - SEQ) < 1e-6 * SEQ, (samples_per_s, tokens_per_s)
    engine.set_train_batch_size(2 * micro * replicas)
    assert engine.gradient_accumulation_steps() == 2
    with pytest.raises(ValueError, match="data-parallel replicas"):
        engine.set_train_batch_size(micro * replicas * engine.sequence_parallel_size + 1)


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
    _check_sample_counters(engine, 1, dp)
    return worst


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _train_with_autotp(stage: int, clip: float) -> dict[str, float]:
    """SP=2 × TP=2 on 4 ranks (DP=1): Ulysses splits each TP rank's 2 query heads and
    replicates its one key/value head; every step equals the unsplit model's."""
    import torch.distributed as dist

    import slipstream
    from slipstream.comm.sequence import sequence_parallel_cross_entropy, shard_sequence
    from slipstream.comm.sequence_hf import apply_ulysses_attention

    tp, micro = 2, 2
    model = _tiny_llama()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "sequence_parallel_size": SP,
        "tensor_parallel": {"autotp_size": tp},
        "optimizer": {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": clip,
        "steps_per_print": 1000,
    }
    engine, _, _, _ = slipstream.initialize(model=model, config=config)
    dp = dist.get_world_size() // (SP * tp)
    assert engine.train_batch_size() == micro * dp
    assert engine.dp_world_size == dp * SP  # gradients average over DP × SP at one TP index
    group = engine.seq_parallel_group
    tp_rank = dist.get_rank() % tp  # tensor-parallel ranks are adjacent
    assert dist.get_process_group_ranks(group) == [tp_rank, tp_rank + tp]
    apply_ulysses_attention(engine.module, group)
    generator = torch.Generator().manual_seed(11)
    worst = {"loss": 0.0, "norm": 0.0, "param": 0.0}
    for step in range(STEPS):
        tokens = torch.randint(0, 64, (micro, SEQ), generator=generator)
        piece = shard_sequence(tokens, tokens, group)
        logits = engine(input_ids=piece["input_ids"], position_ids=piece["position_ids"]).logits
        loss = sequence_parallel_cross_entropy(logits, piece["shift_labels"], group)
        engine.backward(loss)
        engine.step()

        ref_opt.zero_grad()
        ref_loss = reference(input_ids=tokens, labels=tokens).loss
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(
            reference.parameters(), clip if clip > 0 else float("inf")
        )
        if step == 0 and clip > 0:
            assert float(ref_norm) > 2 * clip, "the clip must change the step to test it"
        ref_opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=group)
        worst["loss"] = max(worst["loss"], _rel(mean / SP, ref_loss.detach()))
        worst["norm"] = max(worst["norm"], _rel(engine._last_grad_norm, ref_norm))
    expected = dict(reference.named_parameters())
    for name, param in engine.module.named_parameters():
        want = expected[name].detach()
        dim = getattr(param, "tp_partition_dim", None)
        if dim is not None:
            want = want.chunk(tp, dim=dim)[tp_rank]
        worst["param"] = max(worst["param"], _rel(param.detach(), want))
    _check_sample_counters(engine, micro, dp)
    return worst


def _check_autotp_heads_error() -> None:
    import slipstream
    from slipstream.config import ConfigError

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "sequence_parallel_size": SP,
        "tensor_parallel": {"autotp_size": 2},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    # 2 heads over TP=2 leave one per rank: SP=2 cannot split it.
    with pytest.raises(ConfigError, match=r"each rank's 1 attention heads \(of 2 after"):
        slipstream.initialize(model=_tiny_llama(heads=2, kv_heads=2), config=config)


def _sp_world() -> dict[str, Any]:
    _check_autotp_heads_error()
    return {
        "sp_dp_zero3": _train(3),
        "sp_dp_zero2": _train(2),
        "sp_tp_zero1": _train_with_autotp(1, clip=0.05),
        "sp_tp_stage0": _train_with_autotp(0, clip=0.0),
    }


def test_sequence_parallel_training_equals_single_process() -> None:
    """SP=2 × DP=2 (ZeRO-3, ZeRO-2) and SP=2 × TP=2 (ZeRO-1 with clipping, stage 0) on 4 ranks."""
    results = run_distributed(_sp_world, 4, timeout=300)
    for ranks in results:
        assert ranks["sp_dp_zero3"] <= 1e-5, results
        assert ranks["sp_dp_zero2"] <= 1e-5, results
        for run in ("sp_tp_zero1", "sp_tp_stage0"):
            assert max(ranks[run].values()) <= 1e-5, (run, results)


def test_sequence_parallel_size_must_divide_the_world() -> None:
    import slipstream

    with pytest.raises(ValueError, match="does not divide the world size"):
        slipstream.initialize(
            model=torch.nn.Linear(2, 2),
            config={"train_batch_size": 1, "sequence_parallel_size": 3},
        )
