"""The gemv kernel's packed int4 / int8 / fp8 weight layout (pure torch: packing happens at load time).

Blocks of ``PACK = 16 * per_word`` input features (128 for int4, 64 for int8 and fp8) are stored as 16
int32 words per output row; field ``f = 2p + b`` (bits ``f * 32 / per_word`` up) of word ``jj``
holds element ``32p + 2jj + b`` of the block. See :mod:`.gemv` for why.
"""

from __future__ import annotations

import torch

__all__ = ["PER_WORD", "check_packable", "is_packable", "pack_block", "pack_gemv", "unpack_gemv"]

PER_WORD = {"int4": 8, "int8": 4, "fp8_e4m3": 4}


def pack_block(format: str) -> int:
    """Input features per packed block: 16 words per output row."""
    return 16 * PER_WORD[format]


def is_packable(format: str, group_size: int, in_features: int) -> bool:
    """Whether :func:`pack_gemv` takes this weight (int8/int4/fp8, features and group in blocks)."""
    if format not in PER_WORD:
        return False
    block = pack_block(format)
    return in_features % block == 0 and group_size % block == 0


def check_packable(format: str, group_size: int, in_features: int) -> None:
    if format not in PER_WORD:
        raise ValueError(f"pack_gemv: format must be int8, int4 or fp8_e4m3, got {format!r}")
    block = pack_block(format)
    if in_features % block or group_size % block:
        raise ValueError(
            f"pack_gemv: {format} needs in_features ({in_features}) and group_size "
            f"({group_size}) to be multiples of {block}"
        )


def pack_gemv(codes: torch.Tensor, format: str, group_size: int, in_features: int) -> torch.Tensor:
    """``quantize``'s ``(out, in)`` codes (int8, float8_e4m3fn, or uint8 int4 pairs) as int32
    words, ``(out, in // per_word)`` (see the module docstring)."""
    check_packable(format, group_size, in_features)
    per = PER_WORD[format]
    bits = 32 // per
    rows = codes.numel() * (2 if format == "int4" else 1) // in_features
    raw = codes.reshape(rows, -1)
    if format == "int4":
        raw = raw.view(torch.uint8).to(torch.int64)
        fields = torch.stack((raw & 15, raw >> 4), dim=-1).reshape(rows, in_features)
    else:
        fields = raw.view(torch.uint8).to(torch.int64)
    # element 32p + 2jj + b of a block -> word jj, field 2p + b
    fields = fields.reshape(rows, -1, per // 2, 16, 2).permute(0, 1, 3, 2, 4)
    fields = fields.reshape(rows, -1, per)
    shifts = torch.arange(per, device=codes.device, dtype=torch.int64) * bits
    words = (fields << shifts).sum(dim=-1)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32).reshape(rows, in_features // per)


def unpack_gemv(words: torch.Tensor, format: str, in_features: int) -> torch.Tensor:
    """Inverse of :func:`pack_gemv`: ``quantize``'s codes layout, ``(out, in)`` int8 or
    ``(out, in // 2)`` uint8, or float8_e4m3fn."""
    per = PER_WORD[format]
    bits = 32 // per
    rows = words.numel() * per // in_features
    wide = words.reshape(rows, -1, 16).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per, device=words.device, dtype=torch.int64) * bits
    fields = (wide[..., None] >> shifts) & ((1 << bits) - 1)  # (rows, blocks, 16, per)
    fields = fields.reshape(rows, -1, 16, per // 2, 2).permute(0, 1, 3, 2, 4)
    fields = fields.reshape(rows, in_features)
    if format == "int4":
        pairs = fields.reshape(rows, -1, 2)
        return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    if format == "fp8_e4m3":
        return fields.to(torch.uint8).view(torch.float8_e4m3fn)
    return fields.to(torch.uint8).view(torch.int8)
