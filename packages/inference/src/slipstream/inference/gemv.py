"""``use_triton``: the fused blocks' dense linears run a Triton streaming GEMV at decode."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GemvLinear", "use_triton_gemv"]

_LINEARS = ("qkv", "out", "up", "down")


class GemvLinear(nn.Linear):
    """``nn.Linear`` whose calls on a GPU go through ``slipstream.kernels``' ``dense_gemv``:
    a streaming Triton kernel for at most 16 rows (decode), ``F.linear`` otherwise."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from slipstream.kernels.ops.quant_matmul.triton import dense_gemv

            return dense_gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def use_triton_gemv(model: nn.Module) -> int:
    """Turn every plain block linear (QKV, output, up, down) of a FusedDecoder into a
    :class:`GemvLinear` in place (same parameters); returns how many were turned."""
    turned = 0
    for block in model.blocks:  # type: ignore[union-attr]
        for name in _LINEARS:
            linear = getattr(block, name, None)
            if type(linear) is nn.Linear:
                linear.__class__ = GemvLinear
                turned += 1
    return turned
