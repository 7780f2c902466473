"""ZeroQuant and XTC as functions: the configs they use, and the distillation each needs."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from torch import nn

from slipstream.compression.compress import init_compression
from slipstream.compression.distillation import Batch, distill, layerwise_distillation
from slipstream.compression.scheduler import CompressionScheduler

__all__ = ["xtc", "xtc_config", "zeroquant", "zeroquant_config"]


def zeroquant_config(
    weight_bits: int = 8,
    group_size: int = 64,
    activation_bits: int | None = 8,
    modules: Sequence[str] = ("*",),
) -> dict[str, Any]:
    """The ``compression_training`` block of ZeroQuant: group-wise symmetric weights at once,
    token-wise (dynamic) symmetric activations.

    >>> zeroquant_config(4, 64, None)["weight_quantization"]["shared_parameters"]["enabled"]
    True
    """
    block: dict[str, Any] = {
        "weight_quantization": {
            "shared_parameters": {
                "enabled": True,
                "schedule_offset": 0,
                "quantization_type": "symmetric",
                "quantize_weight_in_forward": True,
                "quantize_group_size": group_size,
            },
            "different_groups": {
                "wq1": {
                    "params": {"start_bits": weight_bits, "target_bits": weight_bits},
                    "modules": list(modules),
                }
            },
        }
    }
    if activation_bits is not None:
        block["activation_quantization"] = {
            "shared_parameters": {
                "enabled": True,
                "schedule_offset": 0,
                "quantization_type": "symmetric",
                "range_calibration": "dynamic",
            },
            "different_groups": {
                "aq1": {"params": {"bits": activation_bits}, "modules": list(modules)}
            },
        }
    return block


def zeroquant(
    model: nn.Module,
    weight_bits: int = 8,
    group_size: int = 64,
    activation_bits: int | None = 8,
    modules: Sequence[str] = ("*",),
    calibration: Sequence[Batch] = (),
    layers: str | None = None,
    lkd_steps: int = 0,
    lr: float = 1e-4,
) -> nn.Module:
    """ZeroQuant post-training quantization of ``model`` in place, with optional LKD.

    With ``lkd_steps`` > 0, each layer of the ModuleList at ``layers`` is then fitted to the
    original model's layer on the ``calibration`` batches (layer-by-layer distillation). Run
    ``redundancy_clean`` and ``save_compressed`` afterwards to export.
    """
    config = {
        "compression_training": zeroquant_config(weight_bits, group_size, activation_bits, modules)
    }
    teacher = copy.deepcopy(model).eval() if lkd_steps > 0 else None
    init_compression(model, config)
    if teacher is not None:
        if layers is None:
            raise ValueError("zeroquant: LKD needs layers= (the name of the ModuleList of layers)")
        layerwise_distillation(model, teacher, layers, calibration, lkd_steps, lr)
    return model


def xtc_config(
    keep_layers: Sequence[int],
    layers: str,
    weight_bits: int = 2,
    group_size: int = 64,
    quantize_after: int = 0,
    modules: Sequence[str] = ("*",),
) -> dict[str, Any]:
    """The ``compression_training`` block of XTC: layer reduction, then 1- or 2-bit weights
    from step ``quantize_after`` on."""
    return {
        "layer_reduction": {
            "enabled": True,
            "keep_number_layer": len(keep_layers),
            "module_name_prefix": layers,
            "teacher_layer": list(keep_layers),
        },
        "weight_quantization": {
            "shared_parameters": {
                "enabled": True,
                "schedule_offset": quantize_after,
                "quantization_type": "symmetric",
                "quantize_weight_in_forward": True,
                "quantize_group_size": group_size,
            },
            "different_groups": {
                "wq1": {
                    "params": {"start_bits": weight_bits, "target_bits": weight_bits},
                    "modules": list(modules),
                }
            },
        },
    }


def xtc(
    teacher: nn.Module,
    keep_layers: Sequence[int],
    layers: str,
    batches: Sequence[Batch],
    reduce_steps: int,
    quantize_steps: int,
    weight_bits: int = 2,
    group_size: int = 64,
    modules: Sequence[str] = ("*",),
    lr: float = 1e-4,
    temperature: float = 1.0,
) -> nn.Module:
    """XTC's recipe: a student of the teacher's ``keep_layers`` trained by distillation, first
    at full precision (``reduce_steps``), then with ternary (2) or binary (1) weights
    (``quantize_steps``). Returns the student; the teacher is unchanged."""
    block = xtc_config(keep_layers, layers, weight_bits, group_size, reduce_steps, modules)
    student = copy.deepcopy(teacher)
    init_compression(student, {"compression_training": block})  # cut to keep_layers in place
    scheduler = CompressionScheduler(student, block)
    distill(
        student,
        teacher,
        batches,
        reduce_steps + quantize_steps,
        lr=lr,
        temperature=temperature,
        on_step=lambda step, loss: scheduler.step(),
    )
    return student
