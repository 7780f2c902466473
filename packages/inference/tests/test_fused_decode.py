"""``decode_fusion``: the fused batch-1 decode step equals the unfused one (CPU: the ops' torch
references, so bit for bit), and it turns itself off for models it cannot run."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from slipstream.inference import init_inference
from slipstream.inference.fused_decode import PARTS
from slipstream.inference.testing import tiny_hf_model

pytest.importorskip("transformers")

KWARGS = {"max_new_tokens": 6, "do_sample": False, "eos_token_id": None, "pad_token_id": 0}


def test_fused_decode_step_equals_unfused(monkeypatch: pytest.MonkeyPatch) -> None:
    import slipstream.inference.fused_decode as fused_module

    calls = {"norm_gemv": 0}
    original = fused_module.norm_gemv

    def counting(*args: Any) -> Any:
        calls["norm_gemv"] += 1
        return original(*args)

    monkeypatch.setattr(fused_module, "norm_gemv", counting)
    model = tiny_hf_model("llama")
    ids = torch.randint(3, 96, (1, 7), generator=torch.Generator().manual_seed(0))
    settings = {"dtype": torch.bfloat16, "replace_with_kernel_inject": True, "max_out_tokens": 32}
    fused = init_inference(model, settings, decode_fusion=True)
    plain = init_inference(model, settings, decode_fusion=False)
    assert fused.fused is not None and fused.fused.decode_fusion
    assert plain.fused is not None and not plain.fused.decode_fusion
    expected = plain.generate(ids, **KWARGS)
    assert calls["norm_gemv"] == 0
    tokens = fused.generate(ids, **KWARGS)
    assert torch.equal(tokens, expected)
    layers = len(fused.fused.blocks)
    # 5 decode steps, each: 2 per block (QKV, gate/up) + the head's; the prefill runs unfused.
    assert calls["norm_gemv"] == 5 * (2 * layers + 1)
    # The decode step's logits, bit for bit (CPU: the same torch ops in the same order), with
    # every part fused and with some of them (the others through the unfused kernels).
    assert plain._runner is not None and fused._runner is not None
    plain._runner.prefill(ids, torch.arange(7)[None], torch.ones_like(ids, dtype=torch.bool))
    expected_logits = plain._runner.decode(ids[:, -1], torch.tensor([7]), 7)
    for subset in (PARTS, {"qkv", "down"}, {"attention", "out", "gate_up", "head"}):
        fused.fused.decode_fusion = frozenset(subset)
        fused._runner.prefill(ids, torch.arange(7)[None], torch.ones_like(ids, dtype=torch.bool))
        logits = fused._runner.decode(ids[:, -1], torch.tensor([7]), 7)
        assert torch.equal(logits, expected_logits), subset


def test_decode_fusion_turns_off_where_it_cannot_run() -> None:
    llama, gpt2 = tiny_hf_model("llama"), tiny_hf_model("gpt2")
    common = {"replace_with_kernel_inject": True}
    auto = init_inference(llama, dtype=torch.bfloat16, **common)  # "auto": CUDA only
    assert auto.fused is not None and not auto.fused.decode_fusion
    from slipstream.inference.fused_decode import enable_decode_fusion

    cuda = torch.device("cuda")  # "auto" reads only the device type: no GPU needed here
    assert enable_decode_fusion(auto.fused, "auto", cuda) == PARTS  # dense, single rank
    for engine in (
        init_inference(gpt2, dtype=torch.bfloat16, decode_fusion=True, **common),  # LayerNorm
        init_inference(llama, dtype=torch.float32, decode_fusion=True, **common),  # fp32
    ):
        assert engine.fused is not None and not engine.fused.decode_fusion
    # Quantized linears keep their kernels; the attention (and the dense head) still fuse.
    quantized = init_inference(
        llama,
        dtype="int8",
        quant={"weight": {"num_bits": 8, "group_size": 32, "compute_dtype": "bf16"}},
        decode_fusion=True,
        **common,
    )
    assert quantized.fused is not None
    assert quantized.fused.decode_fusion == {"attention", "head"}
    # "auto" leaves quantized models on their measured path.
    assert enable_decode_fusion(quantized.fused, "auto", cuda) == frozenset()
    quantized.fused.decode_fusion = frozenset({"attention", "head"})
    ids = torch.randint(3, 96, (1, 5), generator=torch.Generator().manual_seed(1))
    expected = init_inference(
        llama,
        dtype="int8",
        quant={"weight": {"num_bits": 8, "group_size": 32, "compute_dtype": "bf16"}},
        decode_fusion=False,
        **common,
    ).generate(ids, **KWARGS)
    assert torch.equal(quantized.generate(ids, **KWARGS), expected)
    from slipstream.inference.fused_decode import decode_fusion_blockers

    gpt2_engine = init_inference(gpt2, dtype=torch.bfloat16, **common)
    assert gpt2_engine.fused is not None
    assert any("norm is 'layer'" in reason for reason in decode_fusion_blockers(gpt2_engine.fused))
    with pytest.raises(ValueError, match="decode_fusion"):
        init_inference(llama, decode_fusion="sometimes", **common)


def test_chunked_argmax_equals_argmax() -> None:
    from slipstream.inference.generation import chunked_argmax

    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 1000, generator=generator)
    scores[1, 700] = scores[1, 90] = 50.0  # a tie across chunks: the first index wins
    scores[2, 999] = 60.0  # the maximum in the padded last chunk
    for chunk in (64, 100, 1000, 4096):
        assert torch.equal(chunked_argmax(scores, chunk), scores.argmax(dim=-1))
    assert chunked_argmax(scores, 64)[1].item() == 90


def _tp_world(model: Any, ids: torch.Tensor) -> None:
    import copy

    from slipstream.inference.runner import StaticCacheRunner
    from slipstream.inference.tensor_parallel import shard_decoder

    sharded = shard_decoder(copy.deepcopy(model), None)
    assert sharded.blocks[0].heads == model.blocks[0].heads // 2  # a vocab-parallel head too
    assert sharded.head_group is not None
    from slipstream.inference.fused_decode import enable_decode_fusion

    # "auto" fuses tensor-parallel models on GPUs too; true anywhere.
    assert enable_decode_fusion(sharded, "auto", torch.device("cuda")) == PARTS
    assert enable_decode_fusion(sharded, "auto", torch.device("cpu")) == frozenset()
    assert enable_decode_fusion(sharded, True, torch.device("cpu")) == PARTS
    steps = []
    for parts in (frozenset(), PARTS):
        sharded.decode_fusion = parts
        runner = StaticCacheRunner(sharded, 16, cuda_graph=False)
        length = ids.shape[1]
        runner.prefill(ids, torch.arange(length)[None], torch.ones_like(ids, dtype=torch.bool))
        steps.append(runner.decode(ids[:, -1], torch.tensor([length]), length))
    # The fused step reduces the same partial sums over the group: bit for bit on CPU.
    assert torch.equal(steps[0], steps[1])


def test_fused_decode_under_tensor_parallelism() -> None:
    from slipstream.comm.testing import run_distributed
    from slipstream.inference import from_hf

    model = from_hf(tiny_hf_model("llama")).to(torch.bfloat16)
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(2))
    run_distributed(_tp_world, 2, model, ids)
