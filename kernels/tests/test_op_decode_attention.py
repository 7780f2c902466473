"""``decode_attention``: the split-K Triton kernel against the SDPA reference (GQA rows, ragged
chunks, a chunk whose keys are all masked, a broadcast mask, strided cache views)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slipstream.kernels.ops import decode_attention


def _case(device: torch.device, dtype: torch.dtype, generator: torch.Generator) -> tuple:
    batch, kv_heads, rows, slots, head_dim, capacity = 2, 2, 4, 70, 32, 96
    cache = torch.randn(2, batch, kv_heads, capacity, head_dim, generator=generator)
    cache = cache.to(device, dtype)
    key, value = cache[0, :, :, :slots], cache[1, :, :, :slots]  # views of a larger cache
    query = torch.randn(batch, kv_heads, rows, head_dim, generator=generator).to(device, dtype)
    visible = torch.zeros(batch, 1, rows, slots, dtype=torch.bool)
    visible[0, :, :, :41] = True  # row 0 sees slots 0-40: its chunk at 64-69 is all masked
    visible[1, :, :, 5:60] = True  # row 1: left padding and a partly masked last chunk
    mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf")).to(device, dtype)
    return query, key, value, mask


def test_reference_is_sdpa() -> None:
    query, key, value, mask = _case(torch.device("cpu"), torch.float32, torch.Generator())
    expected = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.2)
    torch.testing.assert_close(decode_attention(query, key, value, mask, 0.2), expected)


def test_triton_matches_reference(triton_device: torch.device) -> None:
    from slipstream.kernels.ops.decode_attention.reference import decode_attention as reference
    from slipstream.kernels.ops.decode_attention.triton import decode_attention as kernel

    generator = torch.Generator().manual_seed(0)
    dtypes = [torch.float32, torch.float16]
    if triton_device.type == "cuda":
        dtypes.append(torch.bfloat16)
    with torch.no_grad():
        for dtype in dtypes:
            query, key, value, mask = _case(triton_device, dtype, generator)
            expected = reference(query.float(), key.float(), value.float(), mask.float(), 0.2)
            # fp32: IEEE dots, summation order only; half: p rounded to the dtype before P @ V.
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            cases = [(16, True, False, None), (32, False, False, None), (None, True, True, None)]
            # the loop form (one program per KV head walks the chunks), ragged last chunk too
            cases += [(None, True, False, True), (16, True, True, True), (32, True, False, True)]
            for block_s, merge, pdl, loop in cases:
                # merge: one launch, the last chunk program merges (and resets its counter, so
                # the next call, here the next loop, starts from zero again). pdl: launched with
                # programmatic dependent launch on sm_90+ (a plain launch elsewhere).
                got = kernel(
                    query, key, value, mask, 0.2, block_s=block_s, merge=merge, pdl=pdl, loop=loop
                )
                assert got.dtype == dtype
                torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol)
            for loop in (True, False):  # trigger: the next kernel may launch at once (sm_90+)
                for trigger in (True, "issued", "waited"):
                    got = kernel(query, key, value, mask, 0.2, loop=loop, trigger=trigger)
                    torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol)
            # the split form ignores the loop form's early-load hints
            plain = kernel(query, key, value, mask, 0.2, block_s=32, pdl=True)
            hinted = kernel(
                query,
                key,
                value,
                mask,
                0.2,
                block_s=32,
                pdl=True,
                prefetch=True,
                new_slots=torch.tensor([40], device=triton_device),
                weights=(query,),
            )
            assert torch.equal(plain, hinted)


def test_loop_launch_options_match(triton_device: torch.device) -> None:
    """The loop form's launch options change the launch, not the result: PDL waiting without
    the trigger, the L2 prefetch and the early load of the first chunk (all but the new slots,
    loaded again after the wait), the trigger once the early loads are issued or after the
    wait, an L2 prefetch of other tensors (the next weights), pipeline stages — the same bits as the plain loop; warps,
    head_dim split over programs and one whole-cache chunk — within the dtype's tolerance
    (exact on the CPU interpreter)."""
    from slipstream.kernels.ops.decode_attention.reference import decode_attention as reference
    from slipstream.kernels.ops.decode_attention.triton import decode_attention as kernel

    generator = torch.Generator().manual_seed(1)
    dtype = torch.bfloat16 if triton_device.type == "cuda" else torch.float32
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    exact = triton_device.type == "cpu"
    with torch.no_grad():
        query, key, value, mask = _case(triton_device, dtype, generator)
        expected = reference(query.float(), key.float(), value.float(), mask.float(), 0.2)
        new = torch.tensor([40], device=triton_device)  # row 0's last valid slot
        spare = torch.zeros(37 * 4096 + 48, device=triton_device, dtype=torch.uint8)  # "weights"
        for block_s in (32, 128):
            plain = kernel(query, key, value, mask, 0.2, loop=True, block_s=block_s)
            torch.testing.assert_close(plain.float(), expected, rtol=tol, atol=tol)
            same = [
                {"pdl": True},
                {"pdl": True, "prefetch": True, "stages": 2},
                {"pdl": True, "new_slots": new},
                {
                    "pdl": True,
                    "prefetch": True,
                    "new_slots": torch.tensor([3, 69], device=new.device),
                },
                {"new_slots": new.int(), "stages": 1},
                {"pdl": True, "prefetch": True, "new_slots": new, "trigger": "issued"},
                {"pdl": True, "trigger": "waited", "weights": (spare, mask)},
                {"pdl": True, "weights": (spare[4096:],), "weights_when": "early"},
            ]
            close = [{"warps": 8}, {"d_split": 2}, {"d_split": 2, "new_slots": new, "pdl": True}]
            for index, options in enumerate(same + close):
                got = kernel(query, key, value, mask, 0.2, loop=True, block_s=block_s, **options)
                if exact or index < len(same):
                    assert torch.equal(got, plain), (block_s, options)
                torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol)
        bad_options = [{"d_split": 3}, {"new_slots": new[None]}, {"new_slots": new.float()}]
        bad_options += [{"trigger": "late"}, {"weights": (query,) * 3}, {"weights_when": "x"}]
        bad_options += [{"weights": (key.transpose(2, 3),)}]
        for bad in bad_options:
            with pytest.raises(ValueError, match=r"d_split|new_slots|trigger|weights"):
                kernel(query, key, value, mask, 0.2, loop=True, **bad)


def test_loop_stages_fit_shared_memory() -> None:
    """The loop form pipelines no deeper than shared memory holds: one stage for a cache of
    one chunk (nothing to overlap), fewer for big chunks (an H100 refused 256-slot chunks at
    3 stages: 284 KiB against 227)."""
    from slipstream.kernels.ops.decode_attention.triton import _loop_stages

    cpu = torch.device("cpu")  # a 100 KiB budget off the GPU
    assert _loop_stages(3, 256, 192, 128, 1, 2, cpu) == 1
    assert _loop_stages(3, 64, 192, 128, 1, 2, cpu) == 3  # 2 x 32 KiB in flight
    assert _loop_stages(3, 128, 400, 128, 1, 2, cpu) == 2  # 2 x 64 KiB would not fit
    assert _loop_stages(3, 128, 400, 128, 2, 2, cpu) == 2


def test_default_d_split() -> None:
    """Two programs per KV head only where they fit one per multiprocessor and each half of
    head_dim keeps 16 features; one off GPUs."""
    from slipstream.kernels.ops.decode_attention import triton as module

    assert module._default_d_split(8, 128, torch.device("cpu")) == 1
    if torch.cuda.is_available():
        cuda = torch.device("cuda")
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert module._default_d_split(8, 128, cuda) == module.LOOP_D_SPLIT
        assert module._default_d_split(sms, 128, cuda) == 1  # no SMs to spare
        assert module._default_d_split(8, 16, cuda) == 1  # 8-feature halves
