"""``decode_fusion``: the fused batch-1 decode step equals the unfused one (CPU: the ops' torch
references, so bit for bit), and it turns itself off for models it cannot run."""

from __future__ import annotations

import copy
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

    def counting(original: Any) -> Any:
        def count(*args: Any, **kwargs: Any) -> Any:
            calls["norm_gemv"] += 1
            return original(*args, **kwargs)

        return count

    # QKV (with rotary_kv_write: norm_gemv_rotary), gate/up and the head
    for name in ("norm_gemv", "norm_gemv_rotary"):
        monkeypatch.setattr(fused_module, name, counting(getattr(fused_module, name)))
    launches: set[tuple[bool, bool, bool]] = set()  # decode_attention's pdl, trigger, prefetch
    original_attention = fused_module.decode_attention

    def attention(*args: Any, **kwargs: Any) -> Any:
        launches.add((kwargs["pdl"], kwargs["trigger"], kwargs["prefetch"]))
        return original_attention(*args, **kwargs)

    monkeypatch.setattr(fused_module, "decode_attention", attention)
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
    # attention's launch options: plain by default; the dense step's attention PDL (waiting
    # only) with its L2 prefetch changes no token
    assert launches == {(False, False, False)}
    launches.clear()
    fused.fused.decode_attention_pdl = fused.fused.decode_attention_prefetch = True
    assert torch.equal(fused.generate(ids, **KWARGS), expected)
    assert launches == {(True, False, True)}
    fused.fused.decode_attention_pdl = fused.fused.decode_attention_prefetch = False
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


def test_decode_pdl_key() -> None:
    """decode_pdl: a typed key; "auto" follows fused_decode.AUTO_PDL on one CUDA rank; on, the
    step passes pdl to every decode kernel (the CPU references ignore it: same tokens)."""
    from slipstream.inference import fused_decode

    llama = tiny_hf_model("llama")
    common = {"replace_with_kernel_inject": True, "dtype": torch.bfloat16}
    ids = torch.randint(3, 96, (1, 5), generator=torch.Generator().manual_seed(2))
    outputs = []
    for pdl in (False, True):
        engine = init_inference(llama, decode_fusion=True, decode_pdl=pdl, **common)
        assert engine.fused is not None and engine.fused.decode_pdl is pdl
        outputs.append(engine.generate(ids, **KWARGS))
    assert torch.equal(outputs[0], outputs[1])
    assert engine.fused is not None
    cuda = torch.device("cuda")
    fused_decode.enable_decode_fusion(engine.fused, "auto", cuda, "auto")
    assert engine.fused.decode_pdl is fused_decode.AUTO_PDL
    fused_decode.enable_decode_fusion(engine.fused, "auto", torch.device("cpu"), "auto")
    assert engine.fused.decode_pdl is False
    with pytest.raises(ValueError, match="decode_pdl"):
        init_inference(llama, decode_pdl="sometimes", **common)


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
    from slipstream.inference.quantize import quantize_decoder

    fp32 = from_hf(tiny_hf_model("llama"))
    model = copy.deepcopy(fp32).to(torch.bfloat16)
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(2))
    single = quantize_decoder(copy.deepcopy(fp32), 4, 16, lm_head=True, head_format="int8")
    slots = torch.arange(ids.shape[1])
    with torch.no_grad():
        expected = single(ids, slots[None], torch.ones_like(ids, dtype=torch.bool), slots)
    run_distributed(_tp_worlds, 2, model, ids, (fp32, expected))


def _quantized_tp(model: Any, ids: torch.Tensor, expected: torch.Tensor) -> None:
    """int4 blocks with an int8 vocab-parallel head (quant.weight.lm_head_bits), sharded
    then quantized as init_inference orders it: the logits of the single-rank quantized model
    (row groups lie inside each rank's slice, so every rank holds the same codes)."""
    from slipstream.inference.quantize import WeightOnlyLinear, quantize_decoder
    from slipstream.inference.tensor_parallel import shard_decoder

    sharded = shard_decoder(copy.deepcopy(model), None)
    quantize_decoder(sharded, 4, 16, lm_head=True, head_format="int8")
    head = sharded.head
    assert isinstance(head, WeightOnlyLinear) and head.format == "int8"
    assert head.out_features == model.spec.vocab_size // 2
    assert sharded.blocks[0].out.format == "int4"
    length = ids.shape[1]
    with torch.no_grad():
        slots = torch.arange(length)
        logits = sharded(ids, slots[None], torch.ones_like(ids, dtype=torch.bool), slots)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def _tp_worlds(model: Any, ids: torch.Tensor, quantized: tuple[Any, torch.Tensor]) -> None:
    """One spawned world for both tensor-parallel checks."""
    _tp_world(model, ids)
    _quantized_tp(quantized[0], ids, quantized[1])


def _packable_llama() -> Any:
    """A tiny random Llama whose projections hold whole packed int4 blocks (128 features)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=500000.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0, 0.1) if "norm" in name else param.normal_(0.0, 0.2)
    return model.eval()


def test_fused_quantized_decode_equals_unfused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Packed int4 / int8 (and fp8 with decode_fusion true): the fused step — norms in the
    quantized GEMVs, SiLU * up in gate/up's epilogue — equals the unfused quantized step within
    bf16 rounding (the norm's 1/rms is applied after the GEMV instead of before), every part
    subset too; "auto" fuses int8/int4 on a GPU, not fp8."""
    import slipstream.inference.fused_quant_decode as quant_module
    from slipstream.inference.fused_decode import enable_decode_fusion

    calls = {"gated": 0, "norm_in": 0, "add_norm": 0, "qkv": 0}
    launches: set[str] = set()  # the pdl launch options the kernels were given
    original, original_qkv = quant_module.quant_decode_gemv, quant_module.quant_decode_qkv

    formats: set[str] = set()  # the weight formats the fused GEMVs were given

    def counting(*args: Any, **kwargs: Any) -> Any:
        formats.add(args[3])
        calls["gated"] += bool(args[8])
        calls["norm_in"] += args[6] is not None
        calls["add_norm"] += args[9] is not None
        launches.add(kwargs["pdl"])
        return original(*args, **kwargs)

    def counting_qkv(*args: Any, **kwargs: Any) -> Any:
        calls["qkv"] += 1
        launches.add(kwargs["pdl"])
        return original_qkv(*args, **kwargs)

    # decode_attention's pdl, trigger, prefetch, whether it was given the new slots and
    # weights to prefetch
    attention_pdl: set[tuple[bool, ...]] = set()
    original_attention = quant_module.decode_attention

    def attention(*args: Any, **kwargs: Any) -> Any:
        new_slots = kwargs["new_slots"]
        if new_slots is not None:  # the slot the QKV epilogue wrote, the last valid one
            assert new_slots.shape == (1,) and args[3][0, 0, 0, new_slots[0]] == 0
            assert new_slots[0] + 1 == args[3].shape[-1] or args[3][0, 0, 0, new_slots[0] + 1] < 0
        key = (kwargs["pdl"], kwargs["trigger"], kwargs["prefetch"], new_slots is not None)
        key += (len(kwargs["weights"]) == 2 and kwargs["weights_when"] == "early",)
        attention_pdl.add(key)
        return original_attention(*args, **kwargs)

    monkeypatch.setattr(quant_module, "quant_decode_gemv", counting)
    monkeypatch.setattr(quant_module, "quant_decode_qkv", counting_qkv)
    monkeypatch.setattr(quant_module, "decode_attention", attention)
    model = _packable_llama()
    ids = torch.randint(3, 96, (1, 7), generator=torch.Generator().manual_seed(0))
    cuda = torch.device("cuda")  # "auto" reads only the device type
    # (quant.weight.decode_pdl: each case hands the kernels its launch option)
    # (int4 blocks with an int8 head: quant.weight.lm_head_bits, the head's own format)
    cases = (
        (4, "int", False, False, None),
        (8, "int", True, "l2_partial", None),
        (8, "fp8_e4m3", True, "auto", None),
        (4, "int", True, "l2_partial", 8),
    )
    for bits, fmt, lm_head, pdl, head_bits in cases:
        quant = {"weight": {"num_bits": bits, "group_size": 128, "compute_dtype": "bf16"}}
        quant["weight"].update(format=fmt, lm_head=lm_head, decode_pdl=pdl)
        quant["weight"].update(lm_head_bits=head_bits)
        settings = {"dtype": "int8", "replace_with_kernel_inject": True, "max_out_tokens": 32}
        fused = init_inference(model, settings, quant=quant, decode_fusion=True)
        plain = init_inference(model, settings, quant=quant, decode_fusion=False)
        assert fused.fused is not None and fused.fused.decode_fusion == PARTS
        auto = enable_decode_fusion(plain.fused, "auto", cuda)  # type: ignore[arg-type]
        assert auto == (frozenset() if fmt == "fp8_e4m3" else PARTS), (bits, fmt)
        assert plain.fused is not None
        plain.fused.decode_fusion = frozenset()
        calls.update(gated=0, norm_in=0, add_norm=0, qkv=0)
        formats.clear()
        launches.clear()
        attention_pdl.clear()
        # attention's launch options (PDL, the trigger for the output projection, the L2
        # prefetch and the early load of the slots QKV does not write, the L2 prefetch of the
        # output projection's weight): off by default, and they reach attention only with the
        # GEMVs' PDL on (prefetch and preload with attention's PDL)
        options = ("pdl", "trigger", "prefetch", "preload", "weights")
        assert not any(getattr(fused.fused, f"quant_attention_{o}") for o in options)
        fused.fused.quant_attention_pdl = bits == 4 or pdl == "l2_partial"
        fused.fused.quant_attention_trigger = bits == 4 or pdl == "l2_partial"
        fused.fused.quant_attention_prefetch = fused.fused.quant_attention_preload = True
        fused.fused.quant_attention_weights = "early"  # the output projection's codes, scales
        tokens = fused.generate(ids, **KWARGS)
        assert launches == {{False: "off", "auto": "on"}.get(pdl, pdl)}, (pdl, launches)
        # the blocks' GEMVs run their format, a quantized head its own (lm_head_bits)
        want = {fused.fused.blocks[0].out.format}
        if lm_head:
            want.add(fused.fused.head.format)
        assert formats == want, (formats, want)
        assert head_bits is None or fused.fused.head.format == f"int{head_bits}"
        partial = pdl == "l2_partial"
        assert attention_pdl == {(partial,) * 4 + (pdl is not False,)}, (pdl, attention_pdl)
        layers = len(fused.fused.blocks)
        # 5 decode steps: per block QKV (1/rms, rotary and cache write), gate/up (gated,
        # 1/rms), out and down (add + norm epilogue), the quantized head's 1/rms; the last
        # down's epilogue feeds a bf16 head through norm_gemv instead.
        assert calls["qkv"] == 5 * layers
        assert calls["gated"] == 5 * layers
        assert calls["norm_in"] == 5 * (layers + lm_head)
        assert calls["add_norm"] == 5 * (2 * layers - 1 + lm_head)
        assert torch.equal(tokens, plain.generate(ids, **KWARGS)), (bits, fmt)
        assert plain._runner is not None and fused._runner is not None
        valid = torch.ones_like(ids, dtype=torch.bool)
        plain._runner.prefill(ids, torch.arange(7)[None], valid)
        expected = plain._runner.decode(ids[:, -1], torch.tensor([7]), 7).float()
        # bf16 rounding of logits of magnitude ~8, a few ulps (0.0625 each)
        for subset in (PARTS, {"qkv", "down"}, {"attention", "out", "gate_up", "head"}, {"down"}):
            fused.fused.decode_fusion = frozenset(subset)
            fused._runner.prefill(ids, torch.arange(7)[None], valid)
            logits = fused._runner.decode(ids[:, -1], torch.tensor([7]), 7).float()
            error = (logits - expected).abs().max().item()
            assert error <= 0.02 * expected.abs().max().item(), (bits, fmt, subset, error)


def test_decode_prologue_gives_the_fused_quantized_step_its_first_norm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Packed int4 with decode fusion: ``decode_inputs`` also computes the first block's input
    RMSNorm (one launch fewer a step on a GPU), and the steps' logits equal, bit for bit, those
    of the step-by-step torch prologue with the norm as its own launch."""
    from slipstream.inference import model as model_module
    from slipstream.inference.fused_quant_decode import first_norm_folds

    normed: list[bool] = []
    original = model_module.decode_inputs

    def recording(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        normed.append(out[4] is not None)
        return out

    monkeypatch.setattr(model_module, "decode_inputs", recording)
    quant = {"weight": {"num_bits": 4, "group_size": 128, "compute_dtype": "bf16"}}
    settings = {"dtype": "int8", "replace_with_kernel_inject": True, "max_out_tokens": 32}
    engine = init_inference(_packable_llama(), settings, quant=quant, decode_fusion=True)
    assert engine.fused is not None and engine._runner is not None
    assert first_norm_folds(engine.fused)
    ids = torch.randint(3, 96, (1, 7), generator=torch.Generator().manual_seed(0))
    runs = []
    for prologue in (True, False):
        engine.fused.decode_prologue = prologue
        logits = [engine._runner.prefill(ids, torch.arange(7)[None], ids > 0)]
        for step in range(3):
            position = torch.tensor([7 + step]) if step == 0 else None
            logits.append(engine._runner.decode(logits[-1].argmax(-1), position, 7 + step))
        runs.append(torch.stack(logits))
    assert normed == [True] * 3  # the three decode steps of the first run
    assert torch.equal(runs[0], runs[1])
