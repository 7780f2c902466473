"""``decode_fusion`` for int8 / int4 / fp8 weight-only models: the quantized decode step fused.

A packed quantized projection (``quant.weight.gemv_layout``) runs
``slipstream.kernels``' ``quant_decode_gemv``, which folds in what the unfused step launches
between the projections. Per Llama block at batch 1:

- ``qkv``: the input RMSNorm's ``1 / rms`` (from the partial sums of squares the previous
  block's down projection left) scales the accumulator, and its epilogue rotates the queries
  and keys and writes keys and values into the cache (``rotary_kv_write``'s work, with
  ``"attention"`` fused too); ``decode_attention`` follows;
- ``out``: its epilogue adds the residual, writes the residual stream and ``total *
  post_norm.weight`` (the next RMSNorm but its ``1 / rms``) and the partial sums of squares;
- ``gate_up``: the post-norm's ``1 / rms`` as for QKV, and SiLU(gate) * up in its epilogue (when
  ``down`` is fused too), so the 2I-wide projection never reaches memory;
- ``down``: the residual add and the next block's (or the final) norm weight in its epilogue.

Five launches per block (QKV, attention, output, gate/up, down) instead of nine; the first
block's norm is one ``rms_norm`` launch (its output goes into QKV with no statistics to apply)
and a dense (bf16) head's norm runs as in the dense fused step. Parts left out of
``decode_fusion`` run unfused, the others still fused (the hand-over between them is converted
as needed). Tensor-parallel blocks are not fused here (their partial sums must be reduced
before the norm).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from slipstream.inference.model import FusedBlock, FusedDecoder, KVCache, Norm
from slipstream.inference.quantize import WeightOnlyLinear
from slipstream.kernels.ops import (
    decode_attention,
    decode_gemv,
    gated_activation,
    gated_gemv,
    norm_gemv,
)
from slipstream.kernels.ops.quant_matmul import quant_decode_gemv, quant_decode_qkv

__all__ = [
    "FUSABLE_FORMATS",
    "first_norm_folds",
    "fusable_quantized",
    "has_fused_quantized",
    "quant_decode_forward",
]

# The code formats the fused quantized step takes (packed layout); "auto" turns it on for
# int8 and int4 only (the measured ones), ``decode_fusion: true`` for fp8 too.
FUSABLE_FORMATS = ("int8", "int4", "fp8_e4m3")
AUTO_FORMATS = ("int8", "int4")


# The state handed from one projection to the next RMSNorm:
#   ("pending", x, pending): the residual stream is x + pending (pending None: x alone);
#   ("prenormed", x, h): the residual stream is x and h = the next norm of it (the first
#   block's, from decode_inputs);
#   ("normed", total, u, stats): the residual stream is total, u = total * norm weight of
#   the norm it was made for, stats the partial sums of total**2.
_State = tuple[Any, ...]


def fusable_quantized(linear: object, block: nn.Module | None = None) -> bool:
    """Whether ``linear`` is a packed quantized linear the fused decode step can run (not
    sharded over a tensor-parallel group)."""
    if not isinstance(linear, WeightOnlyLinear) or not linear.packed:
        return False
    if linear.format not in FUSABLE_FORMATS:
        return False
    return block is None or (
        getattr(block, "tp_group", None) is None and getattr(block, "reducer", None) is None
    )


def has_fused_quantized(model: FusedDecoder) -> bool:
    """Whether any projection of ``model`` is a fusable quantized linear (which
    ``fused_decode.decode_forward`` then hands to :func:`quant_decode_forward`)."""
    if model.head_group is None and fusable_quantized(model.head):
        return True
    return any(
        fusable_quantized(getattr(block, name, None), block)
        for block in model.blocks
        for name in ("qkv", "out", "up", "down")
    )


def first_norm_folds(model: FusedDecoder) -> bool:
    """Whether the first block's input RMSNorm of a fused quantized step can come from
    ``decode_inputs`` (its QKV projection is a fused quantized one, which takes the normed
    row; the dense fused GEMVs normalise inside their own launch)."""
    first = model.blocks[0]
    return (
        "qkv" in model.decode_fusion
        and isinstance(first, FusedBlock)
        and first.input_norm.kind == "rms"
        and fusable_quantized(first.qkv, first)
        and has_fused_quantized(model)
    )


def _quantized(
    linear: WeightOnlyLinear,
    x: torch.Tensor,
    stats: torch.Tensor | None = None,
    eps: float = 0.0,
    gated: bool = False,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    pdl: str = "on",
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    bias = None if linear.bias is None else linear.bias.to(x.dtype)
    return quant_decode_gemv(
        x,
        linear.codes,
        linear.scales,
        linear.format,
        linear.group_size,
        bias,
        stats,
        eps,
        gated,
        residual,
        norm_weight,
        pdl=pdl,
    )


def _normed(state: _State, norm: Norm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(total, u, stats)`` for ``norm`` from any state: the producer's epilogue output, or
    (the first block, or after an unfused projection) the norm itself, one ``add_rms_norm`` /
    ``rms_norm`` launch, with no statistics left to apply (``stats`` None)."""
    if state[0] == "normed":
        return state[1], state[2], state[3]
    if state[0] == "prenormed":
        return state[1], state[2], None
    x, pending = state[1], state[2]
    total, h = (x, norm(x)) if pending is None else norm.add_forward(pending, x)
    return total, h, None


def _consume(
    state: _State,
    norm: Norm,
    linear: nn.Module,
    fused: bool,
    gated: bool = False,
    pdl: str = "on",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream and ``linear(norm(stream))`` (``gated``: SiLU * up of it, in the
    quantized GEMV's epilogue)."""
    if fused and fusable_quantized(linear):
        assert isinstance(linear, WeightOnlyLinear)
        total, u, stats = _normed(state, norm)
        return total, _quantized(linear, u, stats=stats, eps=norm.eps, gated=gated, pdl=pdl)[0]
    assert not gated
    x, residual = (state[1], None) if state[0] != "pending" else (state[1], state[2])
    if fused and isinstance(linear, nn.Linear):
        return norm_gemv(x, residual, norm.weight, norm.eps, linear.weight, linear.bias)
    x, h = (x, norm(x)) if residual is None else norm.add_forward(residual, x)
    return x, linear(h)


def _produce(
    x: torch.Tensor,
    act: torch.Tensor,
    linear: nn.Module,
    fused: bool,
    next_norm: Norm | None,
    pdl: str = "on",
) -> _State:
    """The state after ``linear(act)`` is added to the residual stream ``x``; normalised for
    ``next_norm`` in the quantized projection's epilogue when it is given."""
    if fused and fusable_quantized(linear):
        assert isinstance(linear, WeightOnlyLinear)
        if next_norm is not None:
            weight = next_norm.weight.to(x.dtype)
            out, total, stats = _quantized(linear, act, residual=x, norm_weight=weight, pdl=pdl)
            return ("normed", total, out, stats)
        return ("pending", x, _quantized(linear, act, pdl=pdl)[0])
    if fused and isinstance(linear, nn.Linear):
        return ("pending", x, decode_gemv(act, linear.weight, linear.bias))
    return ("pending", x, linear(act))


def _rotary_qkv(
    block: FusedBlock,
    u: torch.Tensor,
    stats: torch.Tensor | None,
    rotary: tuple[torch.Tensor, torch.Tensor],
    cache: tuple[torch.Tensor, torch.Tensor],
    slots: torch.Tensor,
    pdl: str = "on",
) -> torch.Tensor:
    """The rotated queries ``(batch, heads, 1, head_dim)`` of the quantized QKV projection of
    ``u`` (normalised by ``stats``), its keys and values written into ``cache`` at ``slots``."""
    linear = block.qkv
    assert isinstance(linear, WeightOnlyLinear)
    bias = None if linear.bias is None else linear.bias.to(u.dtype)
    return quant_decode_qkv(
        u,
        linear.codes,
        linear.scales,
        linear.format,
        linear.group_size,
        bias,
        stats,
        block.input_norm.eps,
        rotary[0][:, :, 0],
        rotary[1][:, :, 0],
        cache[0],
        cache[1],
        slots,
        block.heads,
        block.kv_heads,
        pdl=pdl,
    )


def _cached_attention(
    block: FusedBlock,
    q: torch.Tensor,
    cache: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor,
    pdl: bool = False,
    trigger: bool | str = False,
    prefetch: bool = False,
    new_slots: torch.Tensor | None = None,
    weights_when: str | None = None,
) -> torch.Tensor:
    """``FusedBlock._attend``'s split-K attention over the cache from rotated queries
    (``pdl``, ``trigger``, ``prefetch``, ``new_slots``: decode_attention's launch options;
    ``weights_when``: it prefetches the quantized output projection's weight into L2 then)."""
    batch, heads, length, head_dim = q.shape
    keys, values = cache[0][:, :, : mask.shape[-1]], cache[1][:, :, : mask.shape[-1]]
    if heads > block.kv_heads:  # the GQA group's query heads as rows of their KV head
        q = q.reshape(batch, block.kv_heads, (heads // block.kv_heads) * length, head_dim)
    weights: tuple[torch.Tensor, ...] = ()
    if weights_when is not None and fusable_quantized(block.out):
        assert isinstance(block.out, WeightOnlyLinear)
        weights = (block.out.codes, block.out.scales)
    out = decode_attention(
        q,
        keys,
        values,
        mask,
        block.spec.scale,
        pdl=pdl,
        trigger=trigger,
        prefetch=prefetch,
        new_slots=new_slots,
        weights=weights,
        weights_when=weights_when or "waited",
    )
    return out.reshape(batch, heads, length, head_dim).transpose(1, 2).reshape(batch, length, -1)


def quant_decode_forward(
    model: FusedDecoder,
    x: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor] | None,
    cache: KVCache | None,
    slots: torch.Tensor,
    mask: torch.Tensor,
    normed: torch.Tensor | None = None,
) -> torch.Tensor:
    """The blocks, final norm and head of a single-token decode step of a model with packed
    quantized projections (``fused_decode.decode_forward`` hands over to this); ``normed``:
    the first block's input RMSNorm of ``x``, computed already (``decode_inputs``)."""
    parts = model.decode_fusion
    pdl = model.quant_pdl
    attention_pdl = pdl != "off" and model.quant_attention_pdl
    trigger = pdl != "off" and model.quant_attention_trigger
    prefetch = attention_pdl and model.quant_attention_prefetch
    # the slots the QKV epilogue writes: attention reads the others before it waits for QKV
    preload = attention_pdl and model.quant_attention_preload
    weights_when = model.quant_attention_weights if pdl != "off" else None
    blocks = list(model.blocks)
    state: _State = ("pending", x, None) if normed is None else ("prenormed", x, normed)
    for index, block in enumerate(blocks):
        assert isinstance(block, FusedBlock) and block.post_norm is not None
        layer_cache = None if cache is None else (cache.keys[index], cache.values[index])
        if (
            "qkv" in parts
            and "attention" in parts
            and fusable_quantized(block.qkv)
            and layer_cache is not None
            and rotary is not None
        ):
            # rotary_kv_write in the QKV projection's epilogue, then decode_attention
            x, u, stats = _normed(state, block.input_norm)
            q = _rotary_qkv(block, u, stats, rotary, layer_cache, slots, pdl)
            new_slots = slots.reshape(-1) if preload else None
            attn = _cached_attention(
                block,
                q,
                layer_cache,
                mask,
                attention_pdl,
                trigger,
                prefetch,
                new_slots,
                weights_when,
            )
        else:
            x, qkv = _consume(state, block.input_norm, block.qkv, "qkv" in parts, pdl=pdl)
            attn = block._attend(qkv, rotary, layer_cache, slots, mask, "attention" in parts)
        up_normed = "gate_up" in parts and fusable_quantized(block.up)
        post = block.post_norm if up_normed else None
        state = _produce(x, attn, block.out, "out" in parts, post, pdl)
        # SiLU * up in gate/up's epilogue when both MLP projections are fused and quantized
        gated = up_normed and "down" in parts and fusable_quantized(block.down)
        x, up = _consume(state, block.post_norm, block.up, "gate_up" in parts, gated, pdl)
        if index + 1 < len(blocks):
            following = blocks[index + 1]
            assert isinstance(following, FusedBlock)
            takes = "qkv" in parts and fusable_quantized(following.qkv)
            next_norm = following.input_norm if takes else None
        else:
            takes = "head" in parts and fusable_quantized(model.head)
            next_norm = model.final_norm if takes else None
        if gated:
            state = _produce(x, up, block.down, True, next_norm, pdl)
        elif "down" in parts and isinstance(block.down, nn.Linear):
            state = ("pending", x, gated_gemv(up, block.down.weight, block.down.bias))
        else:
            act = gated_activation(up, "silu")
            state = _produce(x, act, block.down, "down" in parts, next_norm, pdl)
    logits = _consume(state, model.final_norm, model.head, "head" in parts, pdl=pdl)[1]
    return logits if model.head_group is None else model.gather_vocab(logits)
