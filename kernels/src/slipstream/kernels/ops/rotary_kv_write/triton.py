"""Triton fused attention input step: one program per (token, head) rotates and stores its row.

Replaces, per decoder layer, the rotary kernel, the two cache writes (``index_copy_``) and the
copy that makes the queries contiguous: at batch-1 decode these are four launches moving a few
kilobytes each, so their cost is launch latency, not bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.kernels.ops.rotary_kv_write.reference import check_shapes
from slipstream.kernels.triton_support import (
    AotSpec,
    check_kernel_device,
    next_power_of_2,
    pdl_supported,
)

# With PDL: the next kernel (decode_attention, which lets the output projection start at once)
# may be scheduled before this one's wait, i.e. while the QKV projection still streams, so the
# output projection's L2 prefetch overlaps QKV's tail too; False: only after QKV has finished.
TRIGGER_BEFORE_WAIT = True

try:  # grid-dependency control (programmatic dependent launch), Triton >= 3.3 on CUDA
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: never traced with GDC=True

    @triton.jit
    def gdc_wait():  # type: ignore[no-redef]
        """Placeholder (this Triton has no grid dependency control)."""

    @triton.jit
    def gdc_launch_dependents():  # type: ignore[no-redef]
        """Placeholder (this Triton has no grid dependency control)."""


@triton.jit
def rotary_kv_write_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    key_ptr,
    value_ptr,
    slots_ptr,
    q_ptr,
    length,
    stride_qkv_b,
    stride_qkv_t,
    stride_cos_b,
    stride_cos_t,
    stride_cache_b,
    stride_cache_h,
    stride_cache_s,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,  # rotary_dim // 2; 0: no rotary
    BLOCK: tl.constexpr,
    GDC: tl.constexpr = False,
    TRIGGER_FIRST: tl.constexpr = False,
):
    """Program (token, head): rotate (queries, keys) and store to q / the key or value cache.
    ``GDC`` (launched with programmatic dependent launch): wait for the previous kernel (the
    QKV projection) before reading, and let the next one (attention) be scheduled, before the
    wait with ``TRIGGER_FIRST`` (see :data:`TRIGGER_BEFORE_WAIT`), else after it."""
    if GDC:
        if TRIGGER_FIRST:
            gdc_launch_dependents()
        gdc_wait()
        if not TRIGGER_FIRST:
            gdc_launch_dependents()
    token = tl.program_id(0)
    head = tl.program_id(1)
    b = token // length
    t = token % length
    d = tl.arange(0, BLOCK)
    keep = d < HEAD_DIM
    row = qkv_ptr + b.to(tl.int64) * stride_qkv_b + t.to(tl.int64) * stride_qkv_t + head * HEAD_DIM
    x = tl.load(row + d, mask=keep, other=0.0)
    out = x.to(tl.float32)
    if HALF > 0:
        if head < HEADS + KV_HEADS:
            first = d < HALF
            rotated = d < 2 * HALF
            partner = tl.where(first, d + HALF, d - HALF)
            other = tl.load(row + partner, mask=rotated & keep, other=0.0).to(tl.float32)
            angle = tl.where(first, d, d - HALF)
            trig = b.to(tl.int64) * stride_cos_b + t.to(tl.int64) * stride_cos_t + angle
            c = tl.load(cos_ptr + trig, mask=rotated, other=1.0).to(tl.float32)
            s = tl.load(sin_ptr + trig, mask=rotated, other=0.0).to(tl.float32)
            turned = tl.where(first, out * c - other * s, out * c + other * s)
            out = tl.where(rotated, turned, out)
    if head < HEADS:
        dest = q_ptr + ((b * HEADS + head).to(tl.int64) * length + t) * HEAD_DIM
        tl.store(dest + d, out.to(q_ptr.dtype.element_ty), mask=keep)
    else:
        slot = tl.load(slots_ptr + t)
        kv = head - HEADS
        cache = key_ptr
        if kv >= KV_HEADS:
            kv -= KV_HEADS
            cache = value_ptr
        offset = b.to(tl.int64) * stride_cache_b + kv * stride_cache_h + slot * stride_cache_s
        tl.store(cache + offset + d, out.to(key_ptr.dtype.element_ty), mask=keep)


def rotary_kv_write(
    qkv: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    pdl: bool = False,
) -> torch.Tensor:
    """See :func:`slipstream.kernels.ops.rotary_kv_write.reference.rotary_kv_write`. ``pdl``:
    launch with programmatic dependent launch where it can run (sm_90+)."""
    check_kernel_device("rotary_kv_write", qkv, cos, sin, key_cache, value_cache, slots)
    head_dim = check_shapes(qkv, cos, sin, key_cache, value_cache, slots, num_heads, num_kv_heads)
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    if key_cache.stride() != value_cache.stride() or key_cache.stride(-1) != 1:
        raise ValueError("rotary_kv_write (triton): the caches need equal strides, last dim unit")
    batch, length, _ = qkv.shape
    q = torch.empty(batch, num_heads, length, head_dim, device=qkv.device, dtype=qkv.dtype)
    half = 0 if cos is None else cos.shape[-1]
    if cos is not None and sin is not None:
        cos, sin = cos.contiguous(), sin.contiguous()  # no copies for the model's fresh tables
    trig = cos if cos is not None else q
    grid = (batch * length, num_heads + 2 * num_kv_heads)
    gdc = pdl and pdl_supported(qkv.device)
    rotary_kv_write_kernel[grid](
        qkv,
        trig,
        sin if sin is not None else q,
        key_cache,
        value_cache,
        slots,
        q,
        length,
        qkv.stride(0),
        qkv.stride(1),
        trig.stride(0) if cos is not None else 0,
        trig.stride(1) if cos is not None else 0,
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        HEADS=num_heads,
        KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HALF=half,
        BLOCK=max(16, next_power_of_2(head_dim)),
        GDC=gdc,
        TRIGGER_FIRST=TRIGGER_BEFORE_WAIT,
        **({"launch_pdl": True} if gdc else {}),
    )
    return q


def aot_specs() -> list[AotSpec]:
    """The specialisations ``slipstream.kernels.aot`` compiles for every GPU target."""
    specs = []
    for dtype in ("bf16", "fp16"):
        for half in (64, 0):  # Llama-style full rotary, and no rotary (learned positions)
            specs.append(
                AotSpec(
                    f"rotary_kv_write[{dtype},half={half}]",
                    rotary_kv_write_kernel,
                    {
                        "qkv_ptr": f"*{dtype}",
                        "cos_ptr": "*fp32",
                        "sin_ptr": "*fp32",
                        "key_ptr": f"*{dtype}",
                        "value_ptr": f"*{dtype}",
                        "slots_ptr": "*i64",
                        "q_ptr": f"*{dtype}",
                        "length": "i32",
                        "stride_qkv_b": "i32",
                        "stride_qkv_t": "i32",
                        "stride_cos_b": "i32",
                        "stride_cos_t": "i32",
                        "stride_cache_b": "i32",
                        "stride_cache_h": "i32",
                        "stride_cache_s": "i32",
                        "HEADS": "constexpr",
                        "KV_HEADS": "constexpr",
                        "HEAD_DIM": "constexpr",
                        "HALF": "constexpr",
                        "BLOCK": "constexpr",
                        "GDC": "constexpr",
                        "TRIGGER_FIRST": "constexpr",
                    },
                    {
                        "HEADS": 32,
                        "KV_HEADS": 8,
                        "HEAD_DIM": 128,
                        "HALF": half,
                        "BLOCK": 128,
                        "GDC": False,
                        "TRIGGER_FIRST": False,
                    },
                )
            )
    return specs
