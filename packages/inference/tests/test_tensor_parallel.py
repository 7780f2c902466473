"""AutoTP over gloo ranks: logits and greedy tokens equal the single-rank model's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from slipstream.comm.testing import run_distributed
from slipstream.inference import FusedDecoder, from_hf, init_inference
from slipstream.inference.allreduce import install_reducer
from slipstream.inference.generation import GenerationSettings, generate_tokens
from slipstream.inference.runner import StaticCacheRunner
from slipstream.inference.tensor_parallel import shard_decoder
from slipstream.inference.testing import tiny_hf_model

pytest.importorskip("transformers")

# GQA split (2 ranks) or KV heads replicated (4 ranks over 2), biases kept on rank 0
# (gpt2), MoE experts, learned positions, multi-query attention with a parallel residual (falcon).
TP2_FAMILIES = ("llama", "mixtral", "gpt2", "falcon")
TP4_FAMILIES = ("llama", "falcon")


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    return ids, mask


def _run(model: FusedDecoder) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits over the prompts and 8 greedy tokens, the way the engine computes them."""
    ids, mask = _inputs()
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        logits = model(ids, positions, mask.bool(), torch.arange(ids.shape[1]))
    runner = StaticCacheRunner(model, 24, cuda_graph=False)
    settings = GenerationSettings(max_new_tokens=8, pad_token_id=0)
    tokens = generate_tokens(runner.prefill, runner.decode, ids, mask, settings)
    return logits, tokens


def _check_world(models: dict[str, FusedDecoder], expected: dict[str, tuple]) -> None:
    """TP=2 on two halves of the world (subgroups), then TP=4 on the whole world."""
    rank = dist.get_rank()
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    for tp, families, group in (
        (2, TP2_FAMILIES, halves[rank // 2]),
        (4, TP4_FAMILIES, None),
    ):
        for family in families:
            sharded = shard_decoder(copy.deepcopy(models[family]), group)
            assert sharded.blocks[0].heads == 4 // tp
            logits, tokens = _run(sharded)
            want_logits, want_tokens = expected[family]
            torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-5)
            assert torch.equal(tokens, want_tokens), (family, tp)
    # tensor_parallel.allreduce on CPU/gloo: "symm_mem_or_nccl" falls back to gloo sums (same
    # results), "symm_mem" is refused by name.
    group = halves[rank // 2]
    sharded = shard_decoder(copy.deepcopy(models["llama"]), group)
    reducer = install_reducer(sharded, group, "symm_mem_or_nccl", 1 << 20, torch.device("cpu"))
    assert reducer.kind == "nccl" and sharded.blocks[0].reducer is reducer
    logits, tokens = _run(sharded)
    torch.testing.assert_close(logits, expected["llama"][0], rtol=1e-4, atol=1e-5)
    assert torch.equal(tokens, expected["llama"][1])
    with pytest.raises(ValueError, match='allreduce = "symm_mem" cannot run here: the model is on'):
        install_reducer(sharded, group, "symm_mem", 1 << 20, torch.device("cpu"))


@pytest.mark.slow
def test_tensor_parallel_equals_single_rank_at_2_and_4() -> None:
    # Built once here; the ranks get the fused models pickled (they never import transformers).
    models = {f: from_hf(tiny_hf_model(f)) for f in set(TP2_FAMILIES) | set(TP4_FAMILIES)}
    expected = {family: _run(model) for family, model in models.items()}
    run_distributed(_check_world, 4, models, expected)


def test_tp_size_must_match_the_world() -> None:
    with pytest.raises(ValueError, match="tp_size = 2 needs a process group of that size"):
        init_inference(
            tiny_hf_model("llama", layers=1),
            dtype=torch.float32,
            replace_with_kernel_inject=True,
            tensor_parallel={"tp_size": 2},
        )


def test_indivisible_sizes_are_named() -> None:
    model = from_hf(tiny_hf_model("llama", layers=1))

    class Three:  # shard_decoder asks only the rank and the size of its group
        pass

    with pytest.raises(ValueError, match="tp_size = 3 does not divide the model's attention"):
        original = dist.get_rank, dist.get_world_size
        try:
            dist.get_rank, dist.get_world_size = (lambda g=None: 0), (lambda g=None: 3)  # type: ignore[assignment]
            shard_decoder(model, Three())  # type: ignore[arg-type]
        finally:
            dist.get_rank, dist.get_world_size = original
