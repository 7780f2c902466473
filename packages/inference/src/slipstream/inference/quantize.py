"""Weight-only int8 / int4 / fp8 quantization of a FusedDecoder's linears (group-wise, symmetric)."""

from __future__ import annotations

import torch
from torch import nn

from slipstream.kernels.ops import QuantizedTensor, dequantize, quant_matmul, quantize
from slipstream.kernels.ops.quant_matmul import (
    is_packable,
    pack_gemv,
    quant_matmul_packed,
    unpack_gemv,
)
from slipstream.kernels.ops.quantize import SCALE_DTYPES

__all__ = ["WeightOnlyLinear", "quantize_decoder", "weight_bytes_per_parameter"]

_FORMATS = {8: "int8", 4: "int4"}
FP8 = "fp8_e4m3"
# The block linears that are quantized; embeddings, norms and MoE experts stay in the compute
# dtype, and so does the LM head unless quant.weight.lm_head is set (as most weight-only
# schemes do, the head is kept exact by default).
_QUANTIZED = ("qkv", "out", "up", "down")


class WeightOnlyLinear(nn.Module):
    """``nn.Linear`` whose weight is stored as group-wise int8, packed int4 or fp8 (e4m3) codes
    plus scales in ``scale_dtype`` (``quant.weight.scale_dtype``; fp16 by default, each rounded
    up from the fp32 absmax / qmax and the codes computed from the stored scale; the kernels
    multiply in fp32).

    Groups run along each row (``group_size`` consecutive input features share a scale; -1: one
    group per row, i.e. per-channel scales), so a group never straddles two output rows, and the
    codes keep the row-major ``(out, in)`` order that the fused kernel streams. ``forward`` is
    ``slipstream.kernels``' ``quant_matmul``: on GPUs a Triton kernel that reads the codes in
    place and dequantizes in registers; on the CPU the reference (dequantize, then matmul).
    fp8 codes are kept as their bytes (``uint8``), so a module-wide dtype cast cannot touch them.

    ``gemv_layout`` (``quant.weight.gemv_layout``, default off): int8/int4/fp8 codes whose rows
    and groups are whole packed blocks (64 / 128 / 64 features) are stored as ``pack_gemv``'s
    int32 words, the layout of the decode GEMV kernel (``quant_matmul_packed``: a CUDA-core
    kernel at <= 8 rows; more rows dequantize the packed words, then cuBLAS).
    """

    def __init__(
        self,
        linear: nn.Linear,
        bits: int,
        group_size: int,
        *,
        format: str | None = None,
        gemv_layout: bool = False,
        scale_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if format is None:
            if bits not in _FORMATS:
                raise ValueError(f"WeightOnlyLinear: bits must be 8 or 4, got {bits}")
            format = _FORMATS[bits]
        elif format not in (*_FORMATS.values(), FP8):
            raise ValueError(
                f"WeightOnlyLinear: format must be int8, int4 or {FP8}, got {format!r}"
            )
        out_features, in_features = linear.weight.shape
        if group_size == -1:
            group_size = in_features  # per-channel: one scale per output row
        if group_size < 1 or in_features % group_size:
            raise ValueError(
                f"WeightOnlyLinear: in_features {in_features} is not a multiple of "
                f"quant.weight.group_size {group_size}; choose a group size that divides it "
                "(or -1 for one scale per output row)"
            )
        if scale_dtype not in SCALE_DTYPES:
            raise ValueError(
                f"WeightOnlyLinear: scale_dtype must be one of {SCALE_DTYPES}, got {scale_dtype}"
            )
        q = quantize(linear.weight.detach(), format, group_size, scale_dtype)
        self.format, self.group_size = q.format, group_size
        self.shape, self.dtype = q.shape, q.dtype
        self.codes: torch.Tensor
        self.scales: torch.Tensor
        codes = q.data.reshape(out_features, -1)
        self.packed = gemv_layout and is_packable(format, group_size, in_features)
        if self.packed:
            codes = pack_gemv(codes, format, group_size, in_features)
        fp8_bytes = format == FP8 and not self.packed
        self.register_buffer("codes", codes.view(torch.uint8) if fp8_bytes else codes)
        self.register_buffer("scales", q.scales.reshape(out_features, -1))
        self.bias = linear.bias
        self.in_features, self.out_features = in_features, out_features

    def _load_from_state_dict(  # type: ignore[no-untyped-def]
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ) -> None:
        """Refuse codes of another format or layout (an int4 state dict into an int8 layer:
        a mixed-width model's head and blocks each load only codes of their own width) and
        scales that this module's dtype cannot hold exactly (the codes were computed for the
        stored scales: a rounded scale would silently change every weight of its group)."""
        codes = state_dict.get(prefix + "codes")
        if isinstance(codes, torch.Tensor) and (
            codes.dtype != self.codes.dtype or codes.shape != self.codes.shape
        ):
            layout = "packed " if self.packed else ""
            raise ValueError(
                f"{prefix}codes: the state dict holds {codes.dtype} codes of shape "
                f"{tuple(codes.shape)}, this layer stores {layout}{self.format} codes as "
                f"{self.codes.dtype} {tuple(self.codes.shape)}: the state dict was quantized "
                "with another width, format or layout; quantize with the state dict's "
                "quant.weight.num_bits / lm_head_bits / format / gemv_layout"
            )
        incoming = state_dict.get(prefix + "scales")
        if isinstance(incoming, torch.Tensor) and incoming.dtype != self.scales.dtype:
            cast = incoming.to(self.scales.dtype)
            if not torch.equal(cast.to(incoming.dtype), incoming):
                raise ValueError(
                    f"{prefix}scales: the state dict holds {incoming.dtype} scales that "
                    f"{self.scales.dtype} cannot hold exactly; quantize with "
                    f"quant.weight.scale_dtype matching the checkpoint's scales"
                )
            state_dict = {**state_dict, prefix + "scales": cast}
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
        )

    def _codes(self) -> torch.Tensor:
        if self.packed:
            return unpack_gemv(self.codes, self.format, self.in_features)
        return self.codes.view(torch.float8_e4m3fn) if self.format == FP8 else self.codes

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight the codes stand for, ``(out_features, in_features)``."""
        codes = self._codes()
        q = QuantizedTensor(
            codes.reshape(-1, codes.shape[-1] * self.group_size // self.in_features),
            self.scales.reshape(-1),
            self.format,
            self.group_size,
            self.shape,
            self.dtype,
        )
        return dequantize(q, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return quant_matmul_packed(
                x,
                self.codes,
                self.scales,
                self.format,
                self.group_size,
                None if self.bias is None else self.bias.to(x.dtype),
            )
        return quant_matmul(
            x,
            self._codes(),
            self.scales,
            self.format,
            self.group_size,
            None if self.bias is None else self.bias.to(x.dtype),
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"format={self.format}, group_size={self.group_size}, packed={self.packed}, "
            f"scale_dtype={self.scales.dtype}"
        )


def quantize_decoder(
    model: nn.Module,
    bits: int,
    group_size: int,
    *,
    format: str | None = None,
    gemv_layout: bool = False,
    lm_head: bool = False,
    scale_dtype: torch.dtype = torch.float32,
    head_format: str | None = None,
) -> nn.Module:
    """Replace every block linear of a FusedDecoder (QKV, output, up, down) in place.

    ``format`` (``"int8"``, ``"int4"``, ``"fp8_e4m3"``) overrides ``bits``; ``group_size`` -1
    gives per-channel scales; ``gemv_layout`` as in :class:`WeightOnlyLinear`; ``lm_head``
    (``quant.weight.lm_head``) quantizes the LM head the same way (a tied embedding keeps its
    own weight: only the head's copy is quantized); ``head_format`` (``"int8"``, ``"int4"``,
    ``"fp8_e4m3"``; ``quant.weight.lm_head_bits``) the head's own format with ``lm_head`` (None:
    the blocks'), in the blocks' group size and layout; ``scale_dtype``
    (``quant.weight.scale_dtype``) the dtype the scales are stored in (ValueError naming the
    layer when a scale does not fit).
    """

    def quantized(linear: nn.Linear, where: str, fmt: str | None = format) -> WeightOnlyLinear:
        size = group_size if group_size == -1 else min(group_size, linear.in_features)
        try:
            return WeightOnlyLinear(
                linear, bits, size, format=fmt, gemv_layout=gemv_layout, scale_dtype=scale_dtype
            )
        except ValueError as error:
            hint = (
                " (quant.weight.scale_dtype: bf16 or fp32)" if "largest value" in str(error) else ""
            )
            raise ValueError(f"quantizing {where}: {error}{hint}") from error

    for index, block in enumerate(model.blocks):  # type: ignore[union-attr,arg-type]
        for name in _QUANTIZED:
            linear = getattr(block, name, None)
            if isinstance(linear, nn.Linear):
                setattr(block, name, quantized(linear, f"blocks.{index}.{name}"))
    if head_format is not None and not lm_head:
        raise ValueError(
            f"quantize_decoder: head_format={head_format!r} needs lm_head=True "
            "(quant.weight.lm_head_bits needs quant.weight.lm_head: true)"
        )
    if lm_head:
        head = getattr(model, "head", None)
        if not isinstance(head, nn.Linear):
            raise ValueError(
                f"quant.weight.lm_head=true needs the decoder's head to be a plain linear, got "
                f"{type(head).__name__}; set quant.weight.lm_head to false"
            )
        model.head = quantized(head, "head", head_format or format)  # type: ignore[assignment]
    return model


def weight_bytes_per_parameter(module: nn.Module) -> float:
    """Stored bytes (codes, scales, dense weights) per weight parameter of ``module``."""
    stored = 0
    params = 0
    for sub in module.modules():
        if isinstance(sub, WeightOnlyLinear):
            codes, scales = sub.codes, sub.scales
            stored += codes.numel() * codes.element_size() + scales.numel() * scales.element_size()
            params += sub.in_features * sub.out_features
        for tensor in sub.parameters(recurse=False):
            stored += tensor.numel() * tensor.element_size()
            params += tensor.numel()
    return stored / max(params, 1)
