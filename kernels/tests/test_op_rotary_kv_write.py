"""``rotary_kv_write``: the reference against rotary + index_copy_, the Triton kernel against the
reference (GQA, partial rotary, no rotary, several tokens at scattered slots, batch 2)."""

from __future__ import annotations

import pytest
import torch

from slipstream.kernels.ops import rotary_embedding, rotary_kv_write
from slipstream.kernels.ops.rotary_kv_write.reference import rotary_kv_write as reference

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def _inputs(device: torch.device, dtype: torch.dtype, half: int, length: int = 3):
    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, length, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=generator)
    angles = torch.randn(2, length, max(half, 1), generator=generator)
    cos, sin = (angles.cos(), angles.sin()) if half else (None, None)
    keys = torch.randn(2, KV_HEADS, 12, HEAD_DIM, generator=generator)
    slots = torch.tensor([5, 6, 9][:length])
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return (
        qkv.to(device, dtype),
        move(cos),
        move(sin),
        keys.to(device, dtype),
        (keys + 1).to(device, dtype),
        slots.to(device),
    )


def test_reference_is_rotary_then_cache_writes() -> None:
    qkv, cos, sin, keys, values, slots = _inputs(torch.device("cpu"), torch.float32, half=4)
    before = keys.clone()
    q = reference(qkv, cos, sin, keys, values, slots, HEADS, KV_HEADS)
    heads = qkv.view(2, 3, HEADS + 2 * KV_HEADS, HEAD_DIM)
    rotated = rotary_embedding(heads[:, :, : HEADS + KV_HEADS], cos[:, :, None], sin[:, :, None])
    torch.testing.assert_close(q, rotated[:, :, :HEADS].transpose(1, 2))
    assert q.is_contiguous()
    torch.testing.assert_close(keys[:, :, slots], rotated[:, :, HEADS:].transpose(1, 2))
    torch.testing.assert_close(values[:, :, slots], heads[:, :, HEADS + KV_HEADS :].transpose(1, 2))
    untouched = [s for s in range(12) if s not in slots.tolist()]
    torch.testing.assert_close(keys[:, :, untouched], before[:, :, untouched])
    with pytest.raises(ValueError, match="features"):
        reference(qkv, cos, sin, keys, values, slots, HEADS + 1, KV_HEADS)
    with pytest.raises(ValueError, match="slots"):
        reference(qkv, cos, sin, keys, values, slots[:2], HEADS, KV_HEADS)


@pytest.mark.parametrize("half", [8, 4, 0])  # full rotary, partial (rotary_dim 8 of 16), none
@pytest.mark.parametrize("length", [1, 3])
def test_triton_matches_reference(triton_device: torch.device, half: int, length: int) -> None:
    from slipstream.kernels.ops.rotary_kv_write.triton import rotary_kv_write as triton_op

    dtypes = [torch.float32, torch.float16]
    if triton_device.type == "cuda":
        dtypes.append(torch.bfloat16)
    for dtype in dtypes:
        args = _inputs(triton_device, dtype, half, length)
        expected_args = [a if a is None else a.clone() for a in args]
        # length 3: launched with programmatic dependent launch where it runs (sm_90+)
        q = triton_op(*args, HEADS, KV_HEADS, pdl=length > 1)
        expected = reference(*expected_args, HEADS, KV_HEADS)
        # Same fp32 math, rounded once to the dtype; FMA contraction may differ by one ulp.
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(q, expected, rtol=tol, atol=tol)
        torch.testing.assert_close(args[3], expected_args[3], rtol=tol, atol=tol)  # keys
        torch.testing.assert_close(args[4], expected_args[4], rtol=0, atol=0)  # values: copies


def test_dispatch_on_cpu_is_the_reference() -> None:
    args = _inputs(torch.device("cpu"), torch.float32, half=8)
    copies = [a if a is None else a.clone() for a in args]
    torch.testing.assert_close(
        rotary_kv_write(*args, HEADS, KV_HEADS), reference(*copies, HEADS, KV_HEADS)
    )
