"""Weight-only int8 / int4 quantization of a FusedDecoder's linears (group-wise, symmetric)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.kernels.ops import QuantizedTensor, dequantize, quantize

__all__ = ["WeightOnlyLinear", "quantize_decoder", "weight_bytes_per_parameter"]

_FORMATS = {8: "int8", 4: "int4"}
# The block linears that are quantized; embeddings, norms, the LM head and MoE experts stay in
# the compute dtype (the head is kept exact, as most weight-only schemes do).
_QUANTIZED = ("qkv", "out", "up", "down")


class WeightOnlyLinear(nn.Module):
    """``nn.Linear`` whose weight is stored as group-wise int8 or packed int4 codes + fp32 scales.

    Groups run along each row (``group_size`` consecutive input features share a scale), so a
    group never straddles two output rows. ``forward`` dequantizes through ``slipstream.kernels``
    (Triton on GPU, torch on CPU) and multiplies in the input's dtype.
    """

    def __init__(self, linear: nn.Linear, bits: int, group_size: int) -> None:
        super().__init__()
        if bits not in _FORMATS:
            raise ValueError(f"WeightOnlyLinear: bits must be 8 or 4, got {bits}")
        out_features, in_features = linear.weight.shape
        if in_features % group_size:
            raise ValueError(
                f"WeightOnlyLinear: in_features {in_features} is not a multiple of "
                f"quant.weight.group_size {group_size}; choose a group size that divides it"
            )
        q = quantize(linear.weight.detach(), _FORMATS[bits], group_size)
        self.format, self.group_size = q.format, group_size
        self.shape, self.dtype = q.shape, q.dtype
        self.codes: torch.Tensor
        self.scales: torch.Tensor
        self.register_buffer("codes", q.data)
        self.register_buffer("scales", q.scales)
        self.bias = linear.bias
        self.in_features, self.out_features = in_features, out_features

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight the codes stand for, ``(out_features, in_features)``."""
        q = QuantizedTensor(
            self.codes, self.scales, self.format, self.group_size, self.shape, self.dtype
        )
        return dequantize(q, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from slipstream.inference import quant_matmul

        if quant_matmul.gemv_supported(x, self.group_size):
            # Decode: read the codes, not a dequantized copy (the point of weight-only quant).
            out = quant_matmul.dequant_gemv(
                x,
                self.codes,
                self.scales,
                self.out_features,
                self.group_size,
                int4=self.format == "int4",
            )
            return out if self.bias is None else out + self.bias
        # Prefill and the CPU: dequantize once per call, then the matmul library.
        return F.linear(x, self.dequantized_weight(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"format={self.format}, group_size={self.group_size}"
        )


def quantize_decoder(model: nn.Module, bits: int, group_size: int) -> nn.Module:
    """Replace every block linear of a FusedDecoder (QKV, output, up, down) in place."""
    for block in model.blocks:  # type: ignore[union-attr]
        for name in _QUANTIZED:
            linear = getattr(block, name, None)
            if isinstance(linear, nn.Linear):
                size = min(group_size, linear.in_features)
                setattr(block, name, WeightOnlyLinear(linear, bits, size))
    return model


def weight_bytes_per_parameter(module: nn.Module) -> float:
    """Stored bytes (codes, scales, dense weights) per weight parameter of ``module``."""
    stored = 0
    params = 0
    for sub in module.modules():
        if isinstance(sub, WeightOnlyLinear):
            codes, scales = sub.codes, sub.scales
            stored += codes.numel() * codes.element_size() + scales.numel() * 4
            params += sub.in_features * sub.out_features
        for tensor in sub.parameters(recurse=False):
            stored += tensor.numel() * tensor.element_size()
            params += tensor.numel()
    return stored / max(params, 1)
