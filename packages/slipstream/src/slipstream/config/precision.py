"""The ``fp16`` and ``bf16`` blocks and the ``communication_data_type`` setting."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from slipstream.kernels.config_schema import ConfigBlock, config_fail, key_path, not_implemented

__all__ = ["BF16Config", "FP16Config", "communication_dtype_name", "parse_communication_dtype"]

_ZERO = "the slipstream-zero package (ZeRO stages 1-3)"


@dataclasses.dataclass(kw_only=True)
class FP16Config(ConfigBlock):
    """fp16 mixed precision with loss scaling (``"fp16": {...}``; DeepSpeed's keys and defaults).

    Attributes:
        enabled: train in fp16 with fp32 master weights.
        auto_cast: cast floating-point inputs of ``engine(...)`` to fp16.
        loss_scale: a static loss scale; 0 selects dynamic loss scaling.
        initial_scale_power: the dynamic scale starts at ``2 ** initial_scale_power``.
        loss_scale_window: overflow-free steps before the dynamic scale doubles.
        hysteresis: overflows tolerated before the scale is lowered (DeepSpeed's delayed shift).
        consecutive_hysteresis: refill the hysteresis after every overflow-free step.
        min_loss_scale: the dynamic scale never goes below this.
        fp16_master_weights_and_grads: keep master weights in fp16 (DeepSpeed: ZeRO 1-3 with
            CPU offload only); not implemented yet.
        fused_mode: accepted for older DeepSpeed configs; has no effect.
    """

    enabled: bool = False
    auto_cast: bool = False
    loss_scale: float = dataclasses.field(default=0.0, metadata={"ge": 0})
    initial_scale_power: int = dataclasses.field(default=16, metadata={"ge": 0, "le": 1023})
    loss_scale_window: int = dataclasses.field(default=1000, metadata={"ge": 1})
    hysteresis: int = dataclasses.field(default=2, metadata={"ge": 1})
    consecutive_hysteresis: bool = False
    min_loss_scale: float = dataclasses.field(default=1.0, metadata={"gt": 0})
    fp16_master_weights_and_grads: bool = False
    fused_mode: bool = True

    def validate(self, path: str) -> None:
        """Reject fp16 master weights, which need ZeRO with offload."""
        if self.fp16_master_weights_and_grads:
            not_implemented(
                key_path(path, "fp16_master_weights_and_grads"),
                True,
                "keeping fp16 master weights and gradients (a ZeRO-Offload option)",
                _ZERO,
                "Leave it false: Slipstream keeps fp32 master weights.",
            )


@dataclasses.dataclass(kw_only=True)
class BF16Config(ConfigBlock):
    """bfloat16 mixed precision (``"bf16": {...}``, also read under DeepSpeed's old ``"bfloat16"``).

    Attributes:
        enabled: train in bf16 with fp32 master weights and fp32 gradient accumulation.
        immediate_grad_update: accepted for DeepSpeed compatibility; Slipstream always adds
            each micro-batch's bf16 gradient into the fp32 master gradient as soon as it is
            produced, so either value behaves the same.
        check_grad_overflow: skip, on every rank, an optimizer step whose loss or gradients
            hold an inf or nan, with a warning (``check_overflow`` in some DeepSpeed
            versions). On by default here; DeepSpeed's default is off (docs/reliability.md).
        bf16_master_weights_and_grads: keep ZeRO master weights in bf16; not implemented yet.
        bf16_optimizer_states: keep optimizer states in bf16; not implemented yet.
    """

    enabled: bool = False
    immediate_grad_update: bool = False
    check_grad_overflow: bool = dataclasses.field(
        default=True, metadata={"aliases": ("check_overflow",)}
    )
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False

    def validate(self, path: str) -> None:
        """Reject the bf16 options that need ZeRO master weights or states in bf16."""
        if self.bf16_master_weights_and_grads:
            not_implemented(
                key_path(path, "bf16_master_weights_and_grads"),
                True,
                "keeping ZeRO master weights and gradients in bf16",
                _ZERO,
                "Leave it false: Slipstream keeps fp32 master weights.",
            )
        if self.bf16_optimizer_states:
            not_implemented(
                key_path(path, "bf16_optimizer_states"),
                True,
                "keeping optimizer states in bf16",
                _ZERO,
                "Leave it false.",
            )


# DeepSpeed's communication_data_type takes fp32/fp16/bf16 in any case; the longer spellings
# are those of its DtypeEnum, accepted here too.
_COMM_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "torch.float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "torch.float16": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "torch.bfloat16": torch.bfloat16,
}
_COMM_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# docs/config.md: null reduces in fp32 (DeepSpeed's null follows the training precision).
COMMUNICATION_DTYPE_EXPECTED = (
    '"fp32", "fp16" or "bf16", or null (the default: reduce in fp32, from and into the fp32 '
    'master gradients; set "bf16" for DeepSpeed\'s reduction under bf16)'
)


def parse_communication_dtype(value: Any, path: str) -> torch.dtype | None:
    """``communication_data_type``: a dtype name (case-insensitive) or null -> torch dtype or None."""
    if value is None:
        return None
    if isinstance(value, torch.dtype) and value in _COMM_NAMES:
        return value
    if isinstance(value, str) and value.strip().lower() in _COMM_DTYPES:
        return _COMM_DTYPES[value.strip().lower()]
    config_fail(path, value, COMMUNICATION_DTYPE_EXPECTED)


def communication_dtype_name(dtype: torch.dtype | None) -> str | None:
    """The config spelling of a communication dtype (``torch.bfloat16`` -> ``"bf16"``)."""
    return None if dtype is None else _COMM_NAMES[dtype]
