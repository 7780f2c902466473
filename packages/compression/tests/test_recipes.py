"""ZeroQuant (with layer-by-layer distillation) and XTC on a tiny Llama."""

from __future__ import annotations

import copy

import torch

from slipstream.compression import LinearCompress, xtc, zeroquant
from slipstream.compression.distillation import logits_of
from slipstream.compression.testing import tiny_llama


def _batches(n: int, seed: int = 0, rows: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (rows, 16 * (rows // 2)), generator=g) for _ in range(n)]


def _logit_error(model: torch.nn.Module, teacher: torch.nn.Module, batch: torch.Tensor) -> float:
    with torch.no_grad():
        return (logits_of(model(batch)) - logits_of(teacher(batch))).pow(2).mean().item()


def test_zeroquant_w4_with_lkd_fits_each_layer_to_the_original() -> None:
    from slipstream.inference.testing import tiny_hf_model  # weights with a larger spread

    teacher = tiny_hf_model("llama")
    options = {
        "weight_bits": 4,
        "group_size": 16,
        "activation_bits": 8,
        "modules": ["self_attn", "mlp"],
    }
    plain = zeroquant(copy.deepcopy(teacher), **options)
    fitted = zeroquant(
        copy.deepcopy(teacher),
        **options,
        calibration=_batches(4, rows=8),  # 1024 tokens: LKD needs more targets than weights
        layers="model.layers",
        lkd_steps=40,
        lr=1e-4,
    )
    query = fitted.model.layers[0].self_attn.q_proj  # type: ignore[union-attr]
    assert isinstance(query, LinearCompress) and query.weight_bits == 4 and query.act_bits == 8
    held_out = _batches(1, seed=9, rows=8)[0]  # LKD saw other batches: the gain must generalise
    assert _logit_error(fitted, teacher, held_out) < 0.9 * _logit_error(plain, teacher, held_out)


def test_xtc_reduces_layers_then_trains_ternary_weights() -> None:
    teacher = tiny_llama(layers=4)
    student = xtc(
        teacher,
        keep_layers=[1, 3],
        layers="model.layers",
        batches=_batches(4),
        reduce_steps=4,
        quantize_steps=12,
        weight_bits=2,
        group_size=16,
        modules=["self_attn", "mlp"],
        lr=1e-3,
    )
    assert len(student.model.layers) == 2 and len(teacher.model.layers) == 4  # type: ignore[union-attr]
    layer = student.model.layers[0].mlp.up_proj  # type: ignore[union-attr]
    assert isinstance(layer, LinearCompress) and layer.weight_bits == 2
    weight, _ = layer.compressed_weight()
    for group in weight.detach().reshape(-1, 16):
        assert group.unique().numel() <= 3
