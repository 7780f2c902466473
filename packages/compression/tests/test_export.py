"""The packed export: stated sizes, exact round trips, and serving through init_inference."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from slipstream.compression import init_compression, redundancy_clean
from slipstream.compression.export import pack_weight, save_compressed, unpack_weight
from slipstream.compression.quantizers import quantized_values
from slipstream.compression.testing import tiny_llama


@pytest.mark.parametrize("bits,code_bytes", [(8, 1.0), (4, 0.5), (3, 1.0), (2, 0.25), (1, 0.125)])
def test_packed_size_and_exact_round_trip(bits: int, code_bytes: float) -> None:
    torch.manual_seed(0)
    weight = quantized_values(torch.randn(12, 64), bits, groups=24)  # groups of 32 on one row
    packed = pack_weight(weight, bits, group_size=32)
    assert packed["codes"].numel() * packed["codes"].element_size() == 12 * 64 * code_bytes
    assert packed["scales"].shape == (24,) and packed["scales"].dtype == torch.float32
    restored = unpack_weight(packed["codes"], packed["scales"], packed["entry"], torch.float32)
    torch.testing.assert_close(restored, weight, rtol=0, atol=1e-6)


def _llama_config(bits: int) -> dict[str, Any]:
    return {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {
                    "enabled": True,
                    "quantization_type": "symmetric",
                    "quantize_group_size": 16,
                },
                "different_groups": {
                    "wq1": {
                        "params": {"start_bits": bits, "target_bits": bits},
                        "modules": ["self_attn", "mlp"],
                    }
                },
            },
        }
    }


HEAD_PRUNING = {
    # Llama's MLP: up_proj rows go, with the same rows of its sibling gate_proj (same shape)
    # and the matching input columns of down_proj (DeepSpeed's related module).
    "row_pruning": {
        "shared_parameters": {"enabled": True, "schedule_offset": 0},
        "different_groups": {
            "rp1": {
                "params": {"dense_ratio": 0.5},
                "modules": ["mlp.up_proj"],
                "related_modules": [["mlp.gate_proj", "mlp.down_proj"]],
            }
        },
    },
    "head_pruning": {
        "shared_parameters": {"enabled": True, "schedule_offset": 0, "num_heads": 4},
        "different_groups": {
            "hp1": {
                "params": {"dense_ratio": 0.5},
                "modules": ["self_attn.o_proj"],
                "related_modules": [["q_proj", "k_proj", "v_proj"]],
            }
        },
    },
}


@pytest.mark.parametrize(
    "bits,extra",
    [(8, {}), (4, {}), (2, {}), (8, HEAD_PRUNING)],
    ids=["w8", "w4", "ternary", "w8-heads-rows"],
)
def test_export_is_served_by_init_inference(
    bits: int, extra: dict[str, Any], tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    from slipstream.inference import init_inference
    from slipstream.inference.quantize import WeightOnlyLinear
    from slipstream.inference.testing import tiny_hf_model

    # Head pruning needs as many key/value heads as query heads (no grouped-query attention).
    model = tiny_llama() if extra else tiny_hf_model("llama")
    ids = torch.randint(3, 96, (2, 10))
    if extra:  # prune first (shapes cut), then quantize the pruned model: an exact export
        pruning = {"compression_training": extra}
        init_compression(model, pruning)
        with torch.no_grad():
            masked = model(ids).logits
        redundancy_clean(model, pruning)
        with torch.no_grad():  # gate_proj lost up_proj's rows, down_proj their columns
            torch.testing.assert_close(model(ids).logits, masked, rtol=1e-5, atol=1e-5)
        assert model.model.layers[0].mlp.gate_proj.weight.shape == (64, 64)  # type: ignore[union-attr]
    config = _llama_config(bits)
    init_compression(model, config)
    redundancy_clean(model, config)
    with torch.no_grad():
        expected = model(ids).logits
    summary = save_compressed(model, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        header = json.loads(handle.metadata()["quantized"])
    q_proj = header["model.layers.0.self_attn.q_proj.weight"]
    assert q_proj["bits"] == bits and q_proj["group_size"] == 16
    assert summary["bytes"] < summary["dense_bytes"]

    # A fresh model from the export's config.json (pruned sizes), weights from the export.
    hf_config = transformers.AutoConfig.from_pretrained(tmp_path)
    if extra:
        assert hf_config.num_attention_heads == 2 and hf_config.head_dim == 16
        assert hf_config.intermediate_size == 64
    fresh = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager")
    engine = init_inference(
        fresh.eval(), dtype="fp32", replace_with_kernel_inject=True, checkpoint=str(tmp_path)
    )
    assert engine.fused is not None
    qkv = engine.fused.blocks[0].qkv
    assert isinstance(qkv, WeightOnlyLinear)
    assert qkv.format == ("int8" if bits == 8 else "int4")
    # The served codes stand for exactly the trained values.
    layer = model.model.layers[0].self_attn  # type: ignore[union-attr]
    trained = torch.cat([layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight])
    torch.testing.assert_close(qkv.dequantized_weight(torch.float32), trained, rtol=0, atol=1e-6)
    with torch.no_grad():
        served = engine(ids).logits
    torch.testing.assert_close(served, expected, rtol=1e-4, atol=1e-4)


def test_export_with_a_wider_lm_head_is_served_at_both_widths(tmp_path: Path) -> None:
    """int4 blocks with an 8-bit LM head: init_inference serves the head at its own width
    (quant.weight.lm_head_bits, set from the export), every served code standing for the
    trained value; a config asking for another head width is refused by name."""
    transformers = pytest.importorskip("transformers")
    from slipstream.inference import init_inference
    from slipstream.inference.quantize import WeightOnlyLinear
    from slipstream.inference.testing import tiny_hf_model

    model = tiny_hf_model("llama")
    ids = torch.randint(3, 96, (2, 10))
    config = _llama_config(4)
    groups = config["compression_training"]["weight_quantization"]["different_groups"]
    groups["wq2"] = {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["lm_head"]}
    init_compression(model, config)
    redundancy_clean(model, config)
    with torch.no_grad():
        expected = model(ids).logits
    save_compressed(model, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        header = json.loads(handle.metadata()["quantized"])
    assert header["lm_head.weight"]["bits"] == 8
    assert header["model.layers.0.mlp.up_proj.weight"]["bits"] == 4

    def fresh() -> Any:
        hf_config = transformers.AutoConfig.from_pretrained(tmp_path)
        built = transformers.AutoModelForCausalLM.from_config(
            hf_config, attn_implementation="eager"
        )
        return built.eval()

    settings = {"dtype": "fp32", "replace_with_kernel_inject": True, "checkpoint": str(tmp_path)}
    engine = init_inference(fresh(), settings)
    assert engine.fused is not None
    head, up = engine.fused.head, engine.fused.blocks[0].up
    assert isinstance(head, WeightOnlyLinear) and head.format == "int8"
    assert isinstance(up, WeightOnlyLinear) and up.format == "int4"
    torch.testing.assert_close(
        head.dequantized_weight(torch.float32), model.lm_head.weight, rtol=0, atol=1e-6
    )
    with torch.no_grad():
        served = engine(ids).logits
    torch.testing.assert_close(served, expected, rtol=1e-4, atol=1e-4)
    weight = {"lm_head": True, "lm_head_bits": 4}
    with pytest.raises(ValueError, match=r"8-bit LM head behind 4-bit blocks.*lm_head_bits = 4"):
        init_inference(
            fresh(), {**settings, "dtype": "int8"}, quant={"weight": {**weight, "num_bits": 4}}
        )
