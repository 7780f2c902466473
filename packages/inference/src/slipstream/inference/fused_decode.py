"""``decode_fusion``: batch-1 decode steps through the Triton decode kernels, neighbours fused in.

At batch 1 a decode step is bound by streaming the weights once, and the small kernels between
the projections (norms, residual adds, SwiGLU, cuBLAS's split-K reduce) cost launches and gaps
rather than bytes. With decode fusion on, a single-token step of a
:class:`~slipstream.inference.model.FusedDecoder` runs per block ``norm_gemv`` (residual add +
input RMSNorm + QKV), ``rotary_kv_write``, ``decode_attention`` (split-K over the cache, where
cuDNN's SDPA took 8.8 us a call on an H200), ``decode_gemv`` (output projection), ``norm_gemv``
(residual add + post RMSNorm + gate/up) and ``gated_gemv`` (SiLU * up + down), then
``norm_gemv`` (final norm + LM head). Prefill and steps of more than one token are unchanged.
QKV and ``rotary_kv_write`` go through ``norm_gemv_rotary``: one kernel where the QKV launch
folds the rotary and cache write into its epilogue (``fold_rotary``), else the two.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
from torch import nn

from slipstream.inference.model import FusedBlock, FusedDecoder, KVCache
from slipstream.kernels.ops import (
    decode_attention,
    decode_gemv,
    gated_activation,
    gated_gemv,
    norm_gemv,
    norm_gemv_rotary,
)

__all__ = [
    "AUTO_PARTS",
    "PARTS",
    "decode_block",
    "decode_forward",
    "decode_fusion_blockers",
    "eligible_parts",
    "enable_decode_fusion",
]

# The parts of a decode step that decode fusion can take over: the five projections (with
# their norms / SwiGLU fused in) and the attention over the cache (split-K decode_attention).
PARTS = frozenset({"qkv", "attention", "out", "gate_up", "down", "head"})
# What decode_fusion "auto" runs on a GPU. All six: on an H100 (8B Llama shapes, batch 1,
# CUDA graph) the fused step ran at 85.2% of the bandwidth limit (5.932 ms) against 80.4%
# (6.295 ms) unfused, in one call (tools/bench/infer_bench.py --decode-fusion on/off).
AUTO_PARTS = PARTS
# What decode_pdl "auto" does: launch the dense single-rank fused step's kernels with
# programmatic dependent launch (NVIDIA sm_90+): each GEMV's first weight tile loads while the
# kernel before it finishes, and the output projection can prefetch its weight into L2 while
# the cache write and attention run. Off: on an H100 (8B, batch 1) the step took 6.44 ms with
# it against 5.84 without, 6.27-6.37 with the L2 prefetch and other variants (GPU call B1,
# tools/bench/bf16_decode_variants.py); true turns it on.
AUTO_PDL = False

logger = logging.getLogger(__name__)

_DTYPES = (torch.bfloat16, torch.float16)


def _dense(linear: object) -> bool:
    # nn.Linear and its GemvLinear subclass hold a dense weight; quantized linears do not.
    return isinstance(linear, nn.Linear) and linear.weight.dtype in _DTYPES


def decode_fusion_blockers(model: FusedDecoder) -> list[str]:
    """Why ``model`` cannot run the fused decode step at all (empty: it can)."""
    spec = model.spec
    reasons = []
    if model.embed.weight.dtype not in _DTYPES:
        reasons.append(f"the model is in {model.embed.weight.dtype} (needs bf16 or fp16)")
    if spec.norm != "rms":
        reasons.append(f"norm is {spec.norm!r} (the fused GEMV applies RMSNorm)")
    if spec.parallel_residual:
        reasons.append("the blocks have a parallel residual")
    if spec.mlp != "gated" or spec.activation != "silu":
        reasons.append(f"the MLP is {spec.mlp!r} with {spec.activation!r} (needs gated SiLU)")
    if model.layer_hook is not None:
        reasons.append("the weights stream through ZeRO-Inference")
    return reasons


def eligible_parts(model: FusedDecoder) -> frozenset[str]:
    """The parts ``model`` can run fused: attention always, each projection when every one of
    its linears is dense bf16/fp16 or a packed int8/int4/fp8 linear of a single-rank model
    (``fused_quant_decode``; other quantized linears keep their own kernels)."""
    from slipstream.inference.fused_quant_decode import fusable_quantized

    unsharded = model.head_group is None
    linears: dict[str, list[tuple[object, nn.Module | None]]] = {"head": [(model.head, None)]}
    for block in model.blocks:
        assert isinstance(block, FusedBlock)
        for part, name in (("qkv", "qkv"), ("out", "out"), ("gate_up", "up"), ("down", "down")):
            linears.setdefault(part, []).append((getattr(block, name, None), block))
    dense = {
        part
        for part, found in linears.items()
        if all(_dense(x) or (unsharded and fusable_quantized(x, b)) for x, b in found)
    }
    return frozenset({"attention"} | dense)


def enable_decode_fusion(
    model: FusedDecoder,
    setting: bool | Literal["auto"],
    device: torch.device,
    pdl: bool | Literal["auto"] = "auto",
) -> frozenset[str]:
    """Turn decode fusion on for ``model`` per the ``decode_fusion`` config key; returns the
    parts fused (empty: off). ``"auto"``: :data:`AUTO_PARTS` on a CUDA/ROCm ``device`` for a
    model whose projections are all dense bf16/fp16 (one rank or tensor-parallel) or packed
    int8/int4 on one rank (:mod:`.fused_quant_decode`), what was measured; else off. ``True``:
    every part the model can run (:func:`eligible_parts`: packed int8/int4/fp8 projections
    fuse, other quantized ones keep their kernels; tensor-parallel blocks sum their partials
    with one kernel per sum), on
    any device (on the CPU the ops run their torch references, the same math as the unfused
    step), with a warning naming what blocks the rest.

    ``pdl`` (the ``decode_pdl`` key): the dense fused step's kernels launch with programmatic
    dependent launch (where it runs: NVIDIA sm_90+; elsewhere plain launches, same results);
    ``"auto"``: :data:`AUTO_PDL` for a single-rank model. The quantized step has its own
    (the ``quant.weight.decode_pdl`` key)."""
    model.decode_fusion = frozenset()
    model.decode_pdl = pdl is True or (
        pdl == "auto" and AUTO_PDL and model.head_group is None and device.type == "cuda"
    )
    if setting is False or (setting == "auto" and device.type != "cuda"):
        return model.decode_fusion
    blockers = decode_fusion_blockers(model)
    if blockers:
        if setting is True:
            logger.warning("decode_fusion is off for this model: %s", "; ".join(blockers))
        return model.decode_fusion
    parts = eligible_parts(model)
    if setting == "auto":
        # Measured (8B, batch 1): the dense model on one H100 (85.2% of the bandwidth limit
        # against 80.4% unfused), at TP=2 on 2x H200 (333.8 tokens/s against 294.6 unfused,
        # one sum kernel per sum) and the packed int8/int4 one on one H200 (1.09x / 1.07x the
        # unfused quantized step's tokens/s). fp8 and quantized tensor-parallel models keep
        # their own paths unless decode_fusion is true (eligible_parts leaves parts out).
        if parts != PARTS or not _auto_quantized(model):
            return model.decode_fusion
        model.decode_fusion = AUTO_PARTS
        return model.decode_fusion
    if parts != PARTS:
        logger.warning(
            "decode_fusion: %s run unfused (not dense bf16/fp16 or packed int8/int4/fp8 linears)",
            ", ".join(sorted(PARTS - parts)),
        )
    model.decode_fusion = parts
    return model.decode_fusion


def _auto_quantized(model: FusedDecoder) -> bool:
    """Whether "auto" fuses ``model``'s quantized linears: only int8/int4 (measured) ones."""
    from slipstream.inference.fused_quant_decode import AUTO_FORMATS
    from slipstream.inference.quantize import WeightOnlyLinear

    return all(
        module.format in AUTO_FORMATS
        for module in model.modules()
        if isinstance(module, WeightOnlyLinear)
    )


def decode_block(
    block: FusedBlock,
    x: torch.Tensor,
    pending: torch.Tensor | None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None,
    cache: tuple[torch.Tensor, torch.Tensor] | None,
    slots: torch.Tensor,
    mask: torch.Tensor,
    parts: frozenset[str],
    pdl: bool = False,
    attention_pdl: bool = False,
    attention_prefetch: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of a single-token decode step, the ``parts`` through the decode kernels:
    ``"qkv"`` and ``"gate_up"`` with the residual add and RMSNorm before them, ``"down"`` with
    SiLU * up, ``"out"`` plain, ``"attention"`` split-K over the cache; the others as the
    unfused step runs them. Takes the previous block's ``(base, pending)`` (``pending`` None
    for the first block; summed over the tensor-parallel group) and returns this block's.
    ``pdl``: the decode kernels launch with programmatic dependent launch (``decode_pdl``).
    ``attention_pdl`` (without ``pdl``): only the QKV GEMV (which then lets attention launch
    at once) and attention (which waits for it) launch so, attention's early loads
    (``attention_prefetch``: its cache rows into L2) overlapping the GEMV's end."""
    assert block.post_norm is not None
    norm, post = block.input_norm, block.post_norm
    # PDL launches: None leaves each GEMV's launch to its table; True for all (sm_90+).
    gdc = True if pdl else None
    if "qkv" in parts and "attention" in parts and cache is not None:
        # QKV, then rotary_kv_write in its epilogue where its launch folds it (one kernel)
        cos, sin = (None, None) if rotary is None else (rotary[0][:, :, 0], rotary[1][:, :, 0])
        x, q = norm_gemv_rotary(
            x,
            pending,
            norm.weight,
            norm.eps,
            block.qkv.weight,
            block.qkv.bias,
            cos,
            sin,
            cache[0],
            cache[1],
            slots,
            block.heads,
            block.kv_heads,
            pdl=True if attention_pdl else gdc,
        )
        attn = _cached_attention(
            block, q, cache, mask, pdl or attention_pdl, pdl, attention_prefetch
        )
    else:
        if "qkv" in parts:
            x, qkv = norm_gemv(
                x, pending, norm.weight, norm.eps, block.qkv.weight, block.qkv.bias, pdl=gdc
            )
        else:
            x, h = (x, norm(x)) if pending is None else norm.add_forward(pending, x)
            qkv = block.qkv(h)
        attn = block._attend(qkv, rotary, cache, slots, mask, "attention" in parts, pdl)
    if "out" in parts:
        attn = decode_gemv(attn, block.out.weight, block.out.bias, pdl=gdc)
    else:
        attn = block.out(attn)
    attn = block._reduce(attn)
    if "gate_up" in parts:
        x, up = norm_gemv(x, attn, post.weight, post.eps, block.up.weight, block.up.bias, pdl=gdc)
    else:
        x, h = post.add_forward(attn, x)
        up = block.up(h)
    if "down" in parts:
        down = gated_gemv(up, block.down.weight, block.down.bias, pdl=gdc)
    else:
        down = block.down(gated_activation(up, "silu"))
    return x, block._reduce(down)


def _cached_attention(
    block: FusedBlock,
    q: torch.Tensor,
    cache: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor,
    pdl: bool,
    trigger: bool = False,
    prefetch: bool = False,
) -> torch.Tensor:
    """``FusedBlock._attend``'s split-K attention over the cache from the rotated queries
    ``(batch, heads, 1, head_dim)``; returns ``(batch, 1, heads * head_dim)`` (``pdl``,
    ``trigger``, ``prefetch``: decode_attention's launch options)."""
    batch, heads, length, head_dim = q.shape
    keys, values = cache[0][:, :, : mask.shape[-1]], cache[1][:, :, : mask.shape[-1]]
    if heads > block.kv_heads:  # the GQA group's query heads as rows of their KV head
        q = q.reshape(batch, block.kv_heads, (heads // block.kv_heads) * length, head_dim)
    out = decode_attention(
        q, keys, values, mask, block.spec.scale, pdl=pdl, trigger=trigger, prefetch=prefetch
    )
    return out.reshape(batch, heads, length, head_dim).transpose(1, 2).reshape(batch, length, -1)


def decode_forward(
    model: FusedDecoder,
    x: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor] | None,
    cache: KVCache | None,
    slots: torch.Tensor,
    mask: torch.Tensor,
    normed: torch.Tensor | None = None,
) -> torch.Tensor:
    """The blocks, final norm and head of ``model``'s single-token decode step from the
    embedded token ``x`` (``FusedDecoder.forward`` calls this when decode fusion is on);
    ``normed``: the first block's input RMSNorm of ``x`` where ``decode_inputs`` computed it
    (the fused quantized step's first QKV takes it; see ``first_norm_folds``)."""
    from slipstream.inference.fused_quant_decode import has_fused_quantized, quant_decode_forward

    if has_fused_quantized(model):  # packed int8/int4/fp8 projections: their fused kernels
        return quant_decode_forward(model, x, rotary, cache, slots, mask, normed)
    parts = model.decode_fusion
    pending: torch.Tensor | None = None
    for index, block in enumerate(model.blocks):
        assert isinstance(block, FusedBlock)
        layer_cache = None if cache is None else (cache.keys[index], cache.values[index])
        x, pending = decode_block(
            block,
            x,
            pending,
            rotary,
            layer_cache,
            slots,
            mask,
            parts,
            model.decode_pdl,
            model.decode_attention_pdl,
            model.decode_attention_prefetch,
        )
    norm, head = model.final_norm, model.head
    if "head" in parts:
        gdc = True if model.decode_pdl else None
        logits = norm_gemv(x, pending, norm.weight, norm.eps, head.weight, head.bias, pdl=gdc)[1]
    else:
        logits = head(norm(x) if pending is None else norm.add_forward(pending, x)[1])
    return logits if model.head_group is None else model.gather_vocab(logits)
