"""The packed export: quantized weights as int8 / int4 / 2-bit / 1-bit codes + scales, safetensors.

[Note: the compressed checkpoint format] (version 1; ``slipstream.inference.compressed`` reads it
without importing this package, so this note is the contract)

A directory holding ``model.safetensors`` and, for a Hugging Face model, its ``config.json``
(sizes after pruning). The safetensors header metadata has ``"format":
"slipstream-compressed"``, ``"version": "1"`` and ``"quantized"``: JSON mapping each packed
weight's name to ``{"format", "bits", "group_size", "shape", "dtype"}``. A packed weight
``W`` (name ``N``) is stored as two tensors instead of ``N``:

- ``N.codes``: the codes of ``W`` read flat (row-major) in groups of ``group_size`` elements,
  ``(groups, bytes_per_group)``; the last group is zero-padded;
- ``N.scales``: fp32 ``(groups,)``; an element's value is ``code * scale``.

Formats (codes are symmetric; there is no zero point):

- ``int8``: ``torch.int8`` codes in [-127, 127], one per byte;
- ``int4``: codes in [-7, 7] as two's-complement nibbles, two per ``uint8``, element ``2i``
  in the low nibble (``slipstream.kernels.ops.quantize``'s int4 layout);
- ``ternary``: codes in {-1, 0, 1} as 2-bit two's complement (-1 = 0b11), four per
  ``uint8``, element ``4i + j`` in bits ``2j..2j+1``;
- ``binary``: codes in {-1, 1} as one bit (1 = +1), eight per ``uint8``, element ``8i + j`` in
  bit ``j``;
- ``intN`` (N = 3, 5, 6, 7): codes in [-(2^(N-1)-1), 2^(N-1)-1], one per ``torch.int8``.

int8 and int4 use exactly the layout of ``slipstream.kernels.ops.quantize``, so codes go to the
inference kernels unchanged; ternary and binary values are served through int4 (their codes
times 7 with the scale divided by 7: the same values). Every other tensor is stored as it is.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from slipstream.compression.layers import CompressionState
from slipstream.compression.quantizers import binary_codes, symmetric_codes, ternary_codes
from slipstream.kernels.ops import quantize

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "pack_weight",
    "save_compressed",
    "unpack_weight",
]

logger = logging.getLogger(__name__)

FORMAT_NAME = "slipstream-compressed"
FORMAT_VERSION = "1"
WEIGHTS_NAME = "model.safetensors"


def _format_for(bits: int) -> str:
    return {8: "int8", 4: "int4", 2: "ternary", 1: "binary"}.get(bits, f"int{bits}")


def _pack_bits(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Pack unsigned ``width``-bit codes ``(groups, n)`` into bytes, element ``k`` first."""
    per_byte = 8 // width
    groups, n = codes.shape
    padded = torch.zeros(groups, -(-n // per_byte) * per_byte, dtype=torch.uint8)
    padded[:, :n] = codes.to(torch.uint8)
    lanes = padded.reshape(groups, -1, per_byte)
    out = torch.zeros(groups, lanes.shape[1], dtype=torch.uint8)
    for j in range(per_byte):
        out |= lanes[:, :, j] << (width * j)
    return out


def _unpack_bits(data: torch.Tensor, width: int, n: int) -> torch.Tensor:
    per_byte = 8 // width
    mask = (1 << width) - 1
    lanes = [(data >> (width * j)) & mask for j in range(per_byte)]
    return torch.stack(lanes, dim=-1).reshape(data.shape[0], -1)[:, :n]


def pack_weight(weight: torch.Tensor, bits: int, group_size: int) -> dict[str, Any]:
    """Codes, scales and the header entry of ``weight`` (already on a ``bits``-bit grid)."""
    fmt = _format_for(bits)
    w = weight.detach().float().cpu()
    numel = w.numel()
    if fmt in ("int8", "int4"):
        if fmt == "int4" and group_size % 2:
            raise ValueError(f"int4 export needs an even group size, got {group_size}")
        q = quantize(w, fmt, group_size)  # the inference kernels' layout, by construction
        data, scales = q.data, q.scales
    else:
        flat = torch.zeros(-(-numel // group_size) * group_size)
        flat[:numel] = w.reshape(-1)
        if fmt == "ternary":
            codes, scales = ternary_codes(flat, flat.numel() // group_size)
            # On a ternary grid already: the kept values are +-scale.
            codes = torch.round(flat.reshape(-1, group_size) / scales[:, None]).clamp(-1, 1)
            data = _pack_bits((codes.to(torch.int16) & 0b11), 2)
        elif fmt == "binary":
            codes, scales = binary_codes(flat, flat.numel() // group_size)
            scales = flat.reshape(-1, group_size).abs().amax(dim=1)
            scales = torch.where(scales == 0, torch.ones_like(scales), scales)
            data = _pack_bits((codes > 0).to(torch.int16), 1)
        else:
            codes, scales = symmetric_codes(flat, bits, flat.numel() // group_size)
            data = codes.to(torch.int8)
    entry = {
        "format": fmt,
        "bits": bits,
        "group_size": group_size,
        "shape": list(weight.shape),
        "dtype": str(weight.dtype).removeprefix("torch."),
    }
    return {"codes": data.contiguous(), "scales": scales.float().contiguous(), "entry": entry}


def unpack_weight(
    codes: torch.Tensor, scales: torch.Tensor, entry: dict[str, Any], dtype: torch.dtype
) -> torch.Tensor:
    """The values of a packed weight, in its shape and ``dtype``."""
    fmt, group_size = entry["format"], int(entry["group_size"])
    shape = torch.Size(entry["shape"])
    numel = shape.numel()
    if fmt == "int4":
        packed = codes.to(torch.int16)
        low = ((packed & 0xF) ^ 8) - 8
        high = (((packed >> 4) & 0xF) ^ 8) - 8
        values = torch.stack((low, high), dim=-1).reshape(codes.shape[0], -1).float()
    elif fmt == "ternary":
        raw = _unpack_bits(codes, 2, group_size).to(torch.int16)
        values = ((raw ^ 2) - 2).float()  # sign-extend the 2-bit two's complement
    elif fmt == "binary":
        values = _unpack_bits(codes, 1, group_size).float() * 2 - 1
    else:
        values = codes.float()
    out = values[:, :group_size] * scales[:, None].float()
    return out.reshape(-1)[:numel].reshape(shape).to(dtype)


def _group_size(state: CompressionState, weight: torch.Tensor) -> int:
    settings = state.weight_quant
    assert settings is not None
    if settings.group_size is not None:
        return settings.group_size
    return weight.numel() // settings.groups


@torch.no_grad()
def save_compressed(
    model: nn.Module, directory: str | Path, dense_dtype: torch.dtype | None = None
) -> dict[str, Any]:
    """Write the cleaned ``model`` to ``directory`` in the packed format (see the note above).

    Run :func:`redundancy_clean` first: weights must be on their grid and pruned shapes cut.
    Only symmetric quantization is packed (asymmetric weights would need a zero point that
    the inference kernels do not read: they raise). ``dense_dtype`` (e.g. ``torch.bfloat16``)
    casts the floating tensors that are not packed (norms, embeddings, unquantized layers).
    Returns a summary: bytes of the file's tensors, bytes the same tensors take in their
    dense dtype, and the packed weights.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    header: dict[str, Any] = {}
    packed_names: set[str] = set()
    for name, module in model.named_modules():
        if not isinstance(module, CompressionState) or module.weight_bits is None:
            continue
        if not module.baked:
            raise RuntimeError(
                f"{name}: save_compressed needs the weights on their grid; run "
                "slipstream.compression.redundancy_clean(model, config) first"
            )
        settings = module.weight_quant
        assert settings is not None
        if not settings.symmetric and module.weight_bits > 2:
            raise NotImplementedError(
                f"{name}: asymmetric weight quantization cannot be packed (the format and "
                "the inference kernels have no zero point); use quantization_type symmetric"
            )
        if module.weight_bits > 8:
            raise NotImplementedError(
                f"{name}: {module.weight_bits}-bit weights cannot be packed (the export holds "
                "1, 2, 3-8 bits); set the group's target_bits to 8 or fewer"
            )
        key = f"{name}.weight" if name else "weight"
        weight = module.weight
        group_size = _group_size(module, weight)
        packed = pack_weight(weight, module.weight_bits, group_size)
        restored = unpack_weight(packed["codes"], packed["scales"], packed["entry"], torch.float32)
        error = (restored - weight.float().cpu()).abs().max().item()
        scale = weight.float().abs().max().item() or 1.0
        if error > 1e-5 * scale:
            logger.warning(
                "%s: the packed weight differs from the trained one by up to %.3g (its groups "
                "changed after quantization, e.g. columns pruned): set "
                "weight_quantization.shared_parameters.quantize_group_size and prune "
                "before quantizing for an exact export",
                key,
                error,
            )
        tensors[f"{key}.codes"] = packed["codes"]
        tensors[f"{key}.scales"] = packed["scales"]
        header[key] = packed["entry"]
        packed_names.add(key)
    seen: set[int] = set()
    for key, value in state.items():
        if key in packed_names:
            continue
        pointer = value.data_ptr()
        if pointer in seen and value.numel():
            continue  # a tied weight (LM head = embedding) is stored once
        seen.add(pointer)
        value = value.detach().cpu()
        if dense_dtype is not None and value.is_floating_point():
            value = value.to(dense_dtype)
        tensors[key] = value.contiguous()
    metadata = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "quantized": json.dumps(header, sort_keys=True),
    }
    save_file(tensors, str(directory / WEIGHTS_NAME), metadata=metadata)
    hf_config = getattr(model, "config", None)
    if hf_config is not None and hasattr(hf_config, "to_json_file"):
        hf_config.to_json_file(str(directory / "config.json"))
    stored = sum(t.numel() * t.element_size() for t in tensors.values())
    dense = sum(
        t.numel() * t.element_size()
        for key, t in state.items()
        if key in packed_names or key in tensors
    )
    return {"bytes": stored, "dense_bytes": dense, "packed": header}
