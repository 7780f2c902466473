"""``decode_fusion``: batch-1 decode steps through the Triton decode kernels, neighbours fused in.

At batch 1 a decode step is bound by streaming the weights once, and the small kernels between
the projections (norms, residual adds, SwiGLU, cuBLAS's split-K reduce) cost launches and gaps
rather than bytes. With decode fusion on, a single-token step of a
:class:`~slipstream.inference.model.FusedDecoder` runs per block ``norm_gemv`` (residual add +
input RMSNorm + QKV), ``rotary_kv_write``, ``decode_attention`` (split-K over the cache, where
cuDNN's SDPA took 8.8 us a call on an H200), ``decode_gemv`` (output projection), ``norm_gemv``
(residual add + post RMSNorm + gate/up) and ``gated_gemv`` (SiLU * up + down), then
``norm_gemv`` (final norm + LM head). Prefill and steps of more than one token are unchanged.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
from torch import nn

from slipstream.inference.model import FusedBlock, FusedDecoder

__all__ = ["AUTO_PARTS", "PARTS", "decode_fusion_blockers", "enable_decode_fusion"]

# The parts of a decode step that decode fusion can take over: the five projections (with
# their norms / SwiGLU fused in) and the attention over the cache (split-K decode_attention).
PARTS = frozenset({"qkv", "attention", "out", "gate_up", "down", "head"})
# What decode_fusion "auto" runs on a GPU: the parts whose kernels beat the unfused kernels,
# cuBLAS and SDPA in tools/bench/bf16_gemv_bench.py (Llama-3-8B shapes, batch 1).
AUTO_PARTS = PARTS

logger = logging.getLogger(__name__)

_DTYPES = (torch.bfloat16, torch.float16)


def _dense(linear: object) -> bool:
    # nn.Linear and its GemvLinear subclass hold a dense weight; quantized linears do not.
    return isinstance(linear, nn.Linear) and linear.weight.dtype in _DTYPES


def decode_fusion_blockers(model: FusedDecoder) -> list[str]:
    """Why ``model`` cannot run the fused decode step (empty: it can)."""
    spec = model.spec
    reasons = []
    if spec.norm != "rms":
        reasons.append(f"norm is {spec.norm!r} (the fused GEMV applies RMSNorm)")
    if spec.parallel_residual:
        reasons.append("the blocks have a parallel residual")
    if spec.mlp != "gated" or spec.activation != "silu":
        reasons.append(f"the MLP is {spec.mlp!r} with {spec.activation!r} (needs gated SiLU)")
    if model.layer_hook is not None:
        reasons.append("the weights stream through ZeRO-Inference")
    linears: list[object] = [model.head]
    for block in model.blocks:
        assert isinstance(block, FusedBlock)
        linears += [block.qkv, block.out, getattr(block, "up", None), getattr(block, "down", None)]
    if not all(_dense(linear) for linear in linears):
        reasons.append("some projections are not dense bf16/fp16 linears (quantized or fp32)")
    return reasons


def enable_decode_fusion(
    model: FusedDecoder, setting: bool | Literal["auto"], device: torch.device
) -> frozenset[str]:
    """Turn decode fusion on for ``model`` per the ``decode_fusion`` config key; returns the
    parts fused (empty: off). ``"auto"``: :data:`AUTO_PARTS` on a CUDA/ROCm
    ``device`` when the model qualifies. ``True``: every part wherever the model
    qualifies (on the CPU the ops run their torch references, the same math as the unfused
    step), with a warning naming what blocks it otherwise."""
    model.decode_fusion = frozenset()
    if setting is False or (setting == "auto" and device.type != "cuda"):
        return model.decode_fusion
    blockers = decode_fusion_blockers(model)
    if blockers:
        if setting is True:
            logger.warning("decode_fusion is off for this model: %s", "; ".join(blockers))
        return model.decode_fusion
    model.decode_fusion = PARTS if setting is True else AUTO_PARTS
    return model.decode_fusion
