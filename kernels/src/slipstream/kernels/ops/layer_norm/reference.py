"""Pure-torch LayerNorm over the last dimension, computed in fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dimension, in ``x.dtype``.

    The variance is the biased one (divide by N), as in ``torch.nn.LayerNorm``. Half-precision
    inputs are computed in fp32 and rounded once. Differentiable through torch's autograd.
    """
    hidden_size = x.shape[-1]
    for name, tensor in (("weight", weight), ("bias", bias)):
        if tensor is not None and tensor.shape != (hidden_size,):
            raise ValueError(
                f"layer_norm: {name} shape {tuple(tensor.shape)} must be ({hidden_size},), the "
                "last dimension of x"
            )
    compute_dtype = torch.promote_types(x.dtype, torch.float32)
    out = F.layer_norm(
        x.to(compute_dtype),
        (hidden_size,),
        None if weight is None else weight.to(compute_dtype),
        None if bias is None else bias.to(compute_dtype),
        eps,
    )
    return out.to(x.dtype)
