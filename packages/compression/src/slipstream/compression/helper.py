"""DeepSpeed's ``compression.helper`` names: GPT-2-style ``Conv1D`` layers turned into Linear."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["convert_conv1d_to_linear"]


@torch.no_grad()
def convert_conv1d_to_linear(model: nn.Module, convert_type: type[nn.Module]) -> nn.Module:
    """Replace every ``convert_type`` module (GPT-2's ``Conv1D``: ``y = x @ W + b`` with ``W`` of
    shape ``(in, out)``) by the equal ``nn.Linear``, so compression can match it; in place.

    >>> # from transformers.pytorch_utils import Conv1D; convert_conv1d_to_linear(gpt2, Conv1D)
    """
    for name, module in list(model.named_modules()):
        if not isinstance(module, convert_type) or not name:
            continue
        weight: torch.Tensor = module.weight  # type: ignore[assignment]
        bias = getattr(module, "bias", None)
        linear = nn.Linear(
            weight.shape[0], weight.shape[1], bias=bias is not None, device=weight.device
        ).to(weight.dtype)
        linear.weight.copy_(weight.t())
        if bias is not None:
            linear.bias.copy_(bias)
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, linear)
    if isinstance(model, convert_type):
        raise ValueError("convert_conv1d_to_linear: pass the model holding the layers")
    return model
