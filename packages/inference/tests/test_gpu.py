"""GPU checks (``nox -s gpu``): the CUDA-graph decode equals eager decode, and Triton ops match HF."""

from __future__ import annotations

import pytest
import torch

from slipstream.inference import init_inference
from slipstream.inference.testing import tiny_hf_model

pytestmark = pytest.mark.gpu
pytest.importorskip("transformers")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_decode_equals_eager_and_hf(dtype: torch.dtype) -> None:
    model = tiny_hf_model("llama").cuda()
    ids = torch.randint(3, 96, (3, 9), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    kwargs = {"max_new_tokens": 16, "do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    outputs = []
    for graph in (False, True):
        engine = init_inference(
            model,
            dtype=dtype,
            replace_with_kernel_inject=True,
            enable_cuda_graph=graph,
            max_out_tokens=32,
        )
        outputs.append(engine.generate(ids, attention_mask=mask, **kwargs))
        if graph:
            assert engine._runner is not None and engine._runner.buckets[3].graph is not None
            # A second call replays the captured graph with new prompts.
            again = engine.generate(ids.flip(0), attention_mask=mask.flip(0), **kwargs)
            assert torch.equal(again, outputs[-1].flip(0))
    assert torch.equal(outputs[0], outputs[1])
    if dtype == torch.float32:  # GPU attention kernels differ from HF's eager path: 1e-4
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        with torch.no_grad():
            expected = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        logits = engine(ids, attention_mask=mask).logits
        real = mask.bool()
        torch.testing.assert_close(logits[real], expected[real], rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("format", ["int8", "int4", "fp8_e4m3"])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_quant_matmul_on_gpu(format: str, rows: int) -> None:
    from torch import nn

    from slipstream.inference.quantize import WeightOnlyLinear

    torch.manual_seed(0)
    layer = WeightOnlyLinear(
        nn.Linear(4096, 1000).cuda().bfloat16(), 8, group_size=128, format=format
    )
    x = torch.randn(rows, 1, 4096, device="cuda", dtype=torch.bfloat16)
    expected = (x.float() @ layer.dequantized_weight(torch.float32).t()) + layer.bias.float()
    torch.testing.assert_close(layer(x).float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("variant", ["use_triton", "int8", "int4", "fp8"])
def test_decode_kernels_graph_equals_eager(variant: str) -> None:
    """The streaming GEMVs (dense and quantized) in a captured decode equal their eager runs,
    and their logits stay near the bf16 model's."""
    model = tiny_hf_model("llama").cuda()
    ids = torch.randint(3, 96, (2, 9), device="cuda")
    config: dict = {"dtype": torch.bfloat16, "replace_with_kernel_inject": True}
    if variant == "use_triton":
        config["use_triton"] = True
    else:
        weight = {"num_bits": 4 if variant == "int4" else 8, "group_size": 32}
        if variant == "fp8":
            weight["format"] = "fp8_e4m3"
        config.update(dtype="int8", quant={"weight": {**weight, "compute_dtype": "bf16"}})
    kwargs = {"max_new_tokens": 12, "do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    outputs = [
        init_inference(model, config, enable_cuda_graph=graph, max_out_tokens=32).generate(
            ids, **kwargs
        )
        for graph in (False, True)
    ]
    assert torch.equal(outputs[0], outputs[1])
    base = init_inference(model, dtype=torch.bfloat16, replace_with_kernel_inject=True)
    logits = init_inference(model, config)(ids).logits.float()
    expected = base(ids).logits.float()
    bound = {"use_triton": 0.02, "int8": 0.05, "fp8": 0.2, "int4": 1.0}[variant]
    assert ((logits - expected).abs().max() / expected.abs().max()).item() < bound


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decode_fusion_on_gpu() -> None:
    """The fused batch-1 decode step (Triton decode GEMVs with add + RMSNorm and SwiGLU inside)
    captured in a graph equals its eager run, and its logits stay near the unfused step's."""
    model = tiny_hf_model("llama").cuda()
    ids = torch.randint(3, 96, (1, 9), device="cuda")
    config: dict = {"dtype": torch.bfloat16, "replace_with_kernel_inject": True}
    config["decode_fusion"] = True  # every projection, whatever "auto" picks
    kwargs = {"max_new_tokens": 12, "do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    engines = [
        init_inference(model, config, enable_cuda_graph=graph, max_out_tokens=32)
        for graph in (False, True)
    ]
    assert all(engine.fused is not None and engine.fused.decode_fusion for engine in engines)
    outputs = [engine.generate(ids, **kwargs) for engine in engines]
    assert torch.equal(outputs[0], outputs[1])
    steps = []
    for fusion in (True, False):
        engine = init_inference(model, {**config, "decode_fusion": fusion}, max_out_tokens=32)
        assert engine._runner is not None
        with torch.no_grad():
            engine._runner.prefill(ids, torch.arange(9, device="cuda")[None], ids > 0)
            steps.append(engine._runner.decode(ids[:, -1], torch.tensor([9], device="cuda"), 9))
    error = (steps[0].float() - steps[1].float()).abs().max() / steps[1].float().abs().max()
    assert error.item() < 0.02


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decode_pdl_changes_no_result(tmp_path) -> None:
    """decode_pdl (programmatic dependent launch of the fused step's kernels) gives the same
    tokens and logits, bit for bit, as plain launches, eager and captured in a CUDA graph (so
    do QKV and attention alone with it and attention's L2 prefetch); with
    a table whose output projection prefetches its weight into L2 and whose QKV folds
    rotary_kv_write into its epilogue, the same logits within bf16 rounding."""
    import json

    model = tiny_hf_model("llama").cuda()
    ids = torch.randint(3, 96, (1, 9), device="cuda")
    config: dict = {"dtype": torch.bfloat16, "replace_with_kernel_inject": True}
    config.update(decode_fusion=True, max_out_tokens=32)
    hidden = model.config.hidden_size
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    head_dim = hidden // heads
    launch = {
        "device": torch.cuda.get_device_name(),
        "block_n": 2,
        "block_k": 32,
        "num_warps": 4,
        "pdl": True,
    }
    entries = [{"fusion": "plain", "n": hidden, "k": heads * head_dim, "l2_prefetch": True}]
    qkv = {"fusion": "norm", "n": (heads + 2 * kv_heads) * head_dim, "k": hidden}
    entries.append(qkv | {"fold_rotary": True})
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"entries": [launch | entry for entry in entries]}))
    kwargs = {"max_new_tokens": 12, "do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    outputs, steps = [], []
    runs = [(False, True, None, False), (True, False, None, False), (True, True, str(table), False)]
    runs.append((False, True, None, True))  # only QKV and attention with PDL, L2 prefetch
    for pdl, graph, gemv_table, attention in runs:
        engine = init_inference(
            model,
            {**config, "decode_pdl": pdl, "decode_gemv_table": gemv_table},
            enable_cuda_graph=graph,
        )
        assert engine.fused is not None and engine.fused.decode_pdl == pdl
        engine.fused.decode_attention_pdl = engine.fused.decode_attention_prefetch = attention
        outputs.append(engine.generate(ids, **kwargs))
        assert engine._runner is not None
        with torch.no_grad():
            engine._runner.prefill(ids, torch.arange(9, device="cuda")[None], ids > 0)
            steps.append(engine._runner.decode(ids[:, -1], torch.tensor([9], device="cuda"), 9))
    from slipstream.kernels.ops.decode_gemv.table import use_launch_table

    use_launch_table(None)
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(steps[0], steps[1])
    assert torch.equal(outputs[0], outputs[3]) and torch.equal(steps[0], steps[3])
    error = (steps[2].float() - steps[0].float()).abs().max() / steps[0].float().abs().max()
    assert error.item() < 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mixtral_decode_is_captured_and_equals_eager() -> None:
    model = tiny_hf_model("mixtral").cuda()
    ids = torch.randint(3, 96, (2, 9), device="cuda")
    kwargs = {"max_new_tokens": 12, "do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    outputs = []
    for graph in (False, True):
        engine = init_inference(
            model,
            dtype=torch.float32,
            replace_with_kernel_inject=True,
            enable_cuda_graph=graph,
            max_out_tokens=32,
        )
        outputs.append(engine.generate(ids, **kwargs))
        if graph:
            assert engine._runner is not None and engine._runner.buckets[2].graph is not None
    assert torch.equal(outputs[0], outputs[1])
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    assert torch.equal(outputs[0], expected)  # fp32: the moe_gemv decode matches HF's greedy


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_zero_inference_on_gpu_equals_resident() -> None:
    """Pinned host weights streamed through the double-buffered ring (side stream, events)
    equal the resident model bit for bit, over several passes (ring sets reused)."""
    from slipstream.inference.zero_inference import LayerStreamer

    model = tiny_hf_model("llama", layers=5)  # odd: the ring wraps across passes
    config = {"dtype": "bf16", "replace_with_kernel_inject": True, "max_out_tokens": 40}
    resident = init_inference(model, config)
    offload = {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}}
    streamed = init_inference(model, config, zero=offload)
    assert streamed.fused is not None
    streamer = streamed.fused.layer_hook
    assert isinstance(streamer, LayerStreamer) and len(streamer.ring) == 2
    assert streamer.host[0][0].is_pinned()
    ids = torch.randint(3, 96, (4, 11), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    kwargs = {"max_new_tokens": 12, "do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    assert torch.equal(
        streamed(ids, attention_mask=mask).logits, resident(ids, attention_mask=mask).logits
    )
    assert torch.equal(
        streamed.generate(ids, attention_mask=mask, **kwargs),
        resident.generate(ids, attention_mask=mask, **kwargs),
    )


def _llama_1024() -> torch.nn.Module:
    """A 2-layer random Llama on the GPU with shapes the fused quantized kernels take (hidden
    1024, GQA 8 / 2), its weights drawn so that int4 / int8 steps stay well conditioned."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=1024,
        intermediate_size=2048,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0, 0.1) if "norm" in name else param.normal_(0.0, 0.05)
    return model.cuda()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("bits,head_bits", [(4, None), (8, None), (4, 8)])
def test_fused_quantized_decode_on_gpu(bits: int, head_bits: int | None) -> None:
    """decode_fusion on packed int4 / int8 weights with shapes the fused Triton kernels take
    (hidden 1024): the captured step equals its eager run (with and without programmatic
    dependent launch), and its logits stay near the unfused quantized step's. ``head_bits``:
    the LM head quantized at its own width (quant.weight.lm_head_bits: int4 blocks, int8
    head), its fused GEMV in the step too."""
    model = _llama_1024()
    ids = torch.randint(3, 96, (1, 9), device="cuda")
    weight = {"num_bits": bits, "group_size": 128, "compute_dtype": "bf16"}
    if head_bits is not None:
        weight.update(lm_head=True, lm_head_bits=head_bits)
    config: dict = {
        "dtype": "int8",
        "replace_with_kernel_inject": True,
        "quant": {"weight": weight},
    }
    kwargs = {"max_new_tokens": 12, "do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    outputs = []
    cases = [(False, False, ""), (True, False, ""), (True, True, ""), (True, "l2_partial", "")]
    # attention launched with PDL too: triggering the output projection; waiting only, with
    # the L2 prefetch and the early load of the slots QKV does not write (the bench's options)
    cases += [(True, "l2_partial", "trigger"), (True, "l2_partial", "preload")]
    cases += [(True, "l2_partial", "all")]  # the preload + the output weight's prefetch too
    for graph, pdl, attention in cases:
        pdl_config = {**config, "quant": {"weight": {**weight, "decode_pdl": pdl}}}
        engine = init_inference(model, pdl_config, enable_cuda_graph=graph, max_out_tokens=32)
        assert engine.fused is not None and len(engine.fused.decode_fusion) == 6  # auto: all
        assert engine.fused.quant_pdl == {False: "off", True: "on"}.get(pdl, pdl)
        head_format = getattr(engine.fused.head, "format", None)
        assert head_format == (None if head_bits is None else f"int{head_bits}")
        engine.fused.quant_attention_pdl = bool(attention)
        engine.fused.quant_attention_trigger = attention == "trigger"
        engine.fused.quant_attention_prefetch = attention in ("preload", "all")
        engine.fused.quant_attention_preload = attention in ("preload", "all")
        if attention == "all":
            engine.fused.quant_attention_trigger = "issued"
            engine.fused.quant_attention_weights = "early"
        outputs.append(engine.generate(ids, **kwargs))
    assert all(torch.equal(outputs[0], other) for other in outputs[1:])
    config["quant"]["weight"]["decode_pdl"] = False
    steps = []
    for fusion in (True, False):
        engine = init_inference(model, {**config, "decode_fusion": fusion}, max_out_tokens=32)
        assert engine._runner is not None
        with torch.no_grad():
            engine._runner.prefill(ids, torch.arange(9, device="cuda")[None], ids > 0)
            steps.append(engine._runner.decode(ids[:, -1], torch.tensor([9], device="cuda"), 9))
    # bf16 roundings in other places (1/rms after the GEMV; f16x2 sums): a few ulps of the
    # largest logit (the CPU references differ by up to 1.3% on this model)
    error = (steps[0].float() - steps[1].float()).abs().max() / steps[1].float().abs().max()
    assert error.item() < 0.04


def _prologue_model(family: str) -> torch.nn.Module:
    if family != "llama-1024":
        return tiny_hf_model(family).cuda()
    return _llama_1024()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    ("family", "dtype"),
    [
        ("llama", "bf16"),  # GQA, decode fusion (dense)
        ("mistral", "fp16"),  # sliding window
        ("opt", "bf16"),  # learned positions at offset 2
        ("llama-1024", "int4"),  # the fused int4 decode step
    ],
)
def test_decode_prologue_on_gpu(family: str, dtype: str) -> None:
    """The decode step's prologue in one ``decode_inputs`` kernel: its x, rotary cos/sin and
    additive mask equal the torch ops' bit for bit, and the logits of prefill + five decode
    steps (batch 2, left padding; graph-captured and eager) equal, bit for bit, those of the
    same steps with the torch prologue; the graph marks its slots valid itself and advances
    its positions and slot (steps called with positions=None) as the explicit ones do."""
    from slipstream.inference.runner import StaticCacheRunner

    model = _prologue_model(family)
    config: dict = {"dtype": torch.bfloat16 if dtype == "bf16" else torch.float16}
    if dtype == "int4":
        weight = {"num_bits": 4, "group_size": 128, "compute_dtype": "bf16"}
        config = {"dtype": "int8", "quant": {"weight": weight}}
    engine = init_inference(model, config, replace_with_kernel_inject=True, max_out_tokens=32)
    fused = engine.fused
    assert fused is not None
    ids = torch.randint(3, 96, (2, 9), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    # 1. The prologue's tensors against the torch ops (full width, as a graph step has them).
    valid = torch.zeros(2, 32, dtype=torch.bool, device="cuda")
    valid[:, :9] = mask.bool()
    slot = torch.tensor([9], device="cuda")
    step_ids, step_pos = ids[:, -1:], positions[:, -1:] + 1
    group = fused.blocks[0].heads // fused.blocks[0].kv_heads
    with torch.no_grad():
        got = fused._decode_inputs(step_ids, step_pos, valid.clone(), slot, group, True)
        assert got is not None
        x = fused.embed(step_ids)
        if fused.positions is not None:
            x = x + fused.positions(step_pos + fused.spec.learned_offset)
        assert torch.equal(got[0], x)
        rotary = fused._rotary(step_pos)
        assert (got[1] is None) == (rotary is None)
        if rotary is not None and got[1] is not None:
            assert torch.equal(got[1][0], rotary[0]) and torch.equal(got[1][1], rotary[1])
        from slipstream.inference.model import attention_mask

        seen = attention_mask(valid, slot, fused.spec.sliding_window)
        seen = seen[:, :, None].expand(-1, -1, group, -1, -1).flatten(2, 3)
        additive = torch.zeros(seen.shape, dtype=x.dtype, device="cuda")
        assert torch.equal(got[2], additive.masked_fill_(~seen, float("-inf")))
        # int4: the first block's RMSNorm too, at batch 2 as its own launch, at batch 1 inside
        # the kernel (rms_norm's code inlined): the rms_norm op's bits either way
        assert (got[3] is not None) == (dtype == "int4")
        for rows in (2, 1):
            one = fused._decode_inputs(
                step_ids[:rows], step_pos[:rows], valid[:rows].clone(), slot, group, False
            )
            assert one is not None
            if one[3] is not None:
                assert torch.equal(one[3], fused.blocks[0].input_norm(one[0])), rows
    # 2. Whole steps: the kernel's prologue against the torch one, graph and eager.
    runs = []
    for prologue in (True, False):
        for graph in (True, False):
            runner = StaticCacheRunner(fused, 32, cuda_graph=graph)
            fused.decode_prologue = prologue
            with torch.no_grad():
                logits = [runner.prefill(ids, positions, mask.bool())]
                position = positions[:, -1] + 1
                for step in range(5):
                    tokens = logits[-1].argmax(-1)
                    # positions None: the step after the runner's own (advanced on the device
                    # by a replay); the torch-prologue runs pass them every step
                    given = position + step if step == 0 or not prologue else None
                    logits.append(runner.decode(tokens, given, 9 + step))
            assert runner.captured(2) == graph
            assert logits[-1].dtype == torch.float32
            key_valid = runner.buckets[2].key_valid
            assert key_valid[:, 9:14].all() and not key_valid[:, 14:].any()
            runs.append(torch.stack(logits))
    assert torch.equal(runs[0], runs[2]), "graph steps: decode_inputs changed the logits"
    assert torch.equal(runs[1], runs[3]), "eager steps: decode_inputs changed the logits"
