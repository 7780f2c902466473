"""DeepSpeed's ``deepspeed.moe.utils``: finding MoE layers and expert parameters, and grouping them.

>>> from slipstream.moe.utils import has_moe_layers, split_params_into_different_moe_groups_for_optimizer
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from slipstream.moe.layer import MoE
from slipstream.moe.optim import (
    is_moe_param,
    split_params_into_different_moe_groups_for_optimizer,
    split_params_into_shared_and_expert_params,
)

__all__ = [
    "configure_moe_param_groups",
    "has_moe_layers",
    "is_moe_param",
    "is_moe_param_group",
    "split_params_grads_into_shared_and_expert_params",
    "split_params_into_different_moe_groups_for_optimizer",
    "split_params_into_shared_and_expert_params",
]


def has_moe_layers(module: nn.Module) -> tuple[bool, int]:
    """``(True, num_experts of the first MoE layer)`` if ``module`` holds one, else ``(False, 0)``."""
    for child in module.modules():
        if isinstance(child, MoE):
            return True, child.num_experts
    return False, 0


def split_params_grads_into_shared_and_expert_params(
    params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(dense grads, expert grads)`` of the parameters that have a gradient, each in its
    parameter's dtype (for norms and overflow checks)."""
    dense: list[torch.Tensor] = []
    expert: list[torch.Tensor] = []
    for param in params:
        if param.grad is not None:
            (expert if is_moe_param(param) else dense).append(param.grad.to(param.dtype))
    return dense, expert


def is_moe_param_group(param_group: Mapping[str, Any]) -> bool:
    """Whether an optimizer parameter group holds expert parameters (``"moe": True``)."""
    return bool(param_group.get("moe", False))


def configure_moe_param_groups(model_parameters: list[Any]) -> list[dict[str, Any]] | list[Any]:
    """Parameters or parameter groups made MoE-ready, as ``deepspeed.initialize`` does with them.

    A list of parameters becomes a ``"dense-params"`` group plus one group per expert group; a
    list of groups is split the same way unless it already has ``"moe"`` groups.
    """
    if not isinstance(model_parameters, list) or not model_parameters:
        raise TypeError(
            "configure_moe_param_groups takes a non-empty list of parameters or of parameter "
            f"groups, got {type(model_parameters).__name__}"
        )
    for item in model_parameters:
        if not isinstance(item, (torch.Tensor, dict)):
            raise TypeError(
                "the optimizer's parameters must be tensors or dicts (parameter groups), got "
                f"{type(item).__name__}"
            )
    if isinstance(model_parameters[0], torch.Tensor):
        group = {"params": model_parameters, "name": "dense-params"}
        return split_params_into_different_moe_groups_for_optimizer(group)
    if any("moe" in group for group in model_parameters):
        return model_parameters
    return split_params_into_different_moe_groups_for_optimizer(model_parameters)
