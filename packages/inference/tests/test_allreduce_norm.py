"""Slipstream's symmetric-memory TP kernel on the CPU: its torch reference, and the Triton kernel
under Triton's interpreter with simulated peers (their buffers filled and their signals set by
hand), plus a decoder whose every norm runs through it.

The interpreted checks run in a child process (``TRITON_INTERPRET=1`` must be set before the
kernel module is imported, and must not leak into the other tests)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from slipstream.inference.allreduce_norm import SymmNormState, reference, reference_sum
from slipstream.kernels.ops import add_rms_norm


def test_reference_is_the_unfused_math() -> None:
    torch.manual_seed(0)
    parts = [torch.randn(3, 64) for _ in range(2)]
    residual, weight = torch.randn(3, 64), torch.randn(64)
    total, normed = reference(parts, residual, weight, 1e-5)
    want_total, want_normed = add_rms_norm(parts[0] + parts[1], residual, weight, 1e-5)
    assert torch.equal(total, want_total)  # fp32: the same additions in the same order
    torch.testing.assert_close(normed, want_normed, rtol=1e-6, atol=1e-6)
    assert torch.equal(reference_sum(parts), parts[0] + parts[1])
    halves = [p.bfloat16() for p in parts]  # bf16: summed in fp32, rounded once
    assert torch.equal(
        reference_sum(halves), (parts[0].bfloat16().float() + halves[1].float()).bfloat16()
    )


def _simulated(world: int, rank: int, rows: int, width: int, blocks: int, ready: bool):
    """Rank ``rank``'s state with the peers' rows in their buffers (and, if ``ready``, their
    READY signals in this rank's pad), as if the peers had run their half of a call."""
    torch.manual_seed(world * 10 + rank)
    parts = [torch.randn(rows, width) for _ in range(world)]
    buffers = [torch.zeros(rows * width + 8) for _ in range(world)]
    pads = [torch.zeros(blocks * 2 * world + 4, dtype=torch.int32) for _ in range(world)]
    for peer in range(world):
        if peer != rank:
            buffers[peer][: rows * width] = parts[peer].flatten()
    state = SymmNormState(
        buffers[rank],
        torch.tensor([b.data_ptr() for b in buffers]),
        torch.tensor([p.data_ptr() for p in pads]),
        pads[rank],
        rank,
        world,
        blocks,
    )
    state.reset_flags()
    flags = pads[rank][: blocks * 2 * world].view(blocks, 2, world)
    if ready:
        flags[:, 0] = 1
        flags[:, 0, rank] = 0
    return state, parts, buffers, pads


def _interpreted_checks() -> None:
    """Run in a child with TRITON_INTERPRET=1 (see the module docstring)."""
    import torch.distributed as dist

    from slipstream.inference import allreduce as allreduce_module
    from slipstream.inference import from_hf
    from slipstream.inference.allreduce import TPReducer
    from slipstream.inference.allreduce_norm import all_reduce_sum, reduce_add_rms_norm
    from slipstream.inference.testing import tiny_hf_model

    # 1. Simulated peers: 2 ranks (as rank 0) and 4 ranks (as rank 2); more rows than programs.
    for world, rank in ((2, 0), (4, 2)):
        rows, width, blocks = 5, 48, 3
        state, parts, buffers, pads = _simulated(world, rank, rows, width, blocks, ready=True)
        residual, weight = torch.randn(rows, width), torch.randn(width)
        total, normed = reduce_add_rms_norm(state, parts[rank], residual, weight, 1e-5)
        want_total, want_normed = reference(parts, residual, weight, 1e-5)
        assert torch.equal(total, want_total), world
        torch.testing.assert_close(normed, want_normed, rtol=1e-5, atol=1e-5)
        assert int(state.error.item()) == 0
        # Its rows are in its buffer; READY and DONE are set at every peer; its own flags are
        # consumed (the peers' READY and the start state's DONE).
        assert torch.equal(buffers[rank][: rows * width], parts[rank].flatten())
        for peer in range(world):
            flags = pads[peer][: blocks * 2 * world].view(blocks, 2, world)
            want = 0 if peer == rank else 1
            assert (flags[:, :, rank] == want).all(), (world, peer)
        assert int(pads[rank].sum().item()) == 0
        # The sum alone (the peers signal again for a second call).
        flags = pads[rank][: blocks * 2 * world].view(blocks, 2, world)
        for kind in (0, 1):
            flags[:, kind] = 1
            flags[:, kind, rank] = 0
        assert torch.equal(all_reduce_sum(state, parts[rank]), reference_sum(parts))
        assert int(state.error.item()) == 0
    # 2. A peer that never signals: the wait gives up and raises the error flag (no hang).
    state, parts, _, _ = _simulated(2, 1, 2, 16, 1, ready=False)
    state.spin = 3
    all_reduce_sum(state, parts[1])
    assert int(state.error.item()) == 1

    # 3. A decoder whose every norm after a sum runs through the kernel (one rank: no peers).
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    model = from_hf(tiny_hf_model("llama", layers=3))
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    slots = torch.arange(ids.shape[1])
    args = (ids, slots[None].expand(2, -1), torch.ones_like(ids, dtype=torch.bool), slots)
    with torch.no_grad():
        want = model(*args)
        reducer = TPReducer(None)
        buffer = torch.zeros(1 << 12)
        pad = torch.zeros(64, dtype=torch.int32)
        reducer.norm_state = SymmNormState(
            buffer,
            torch.tensor([buffer.data_ptr()]),
            torch.tensor([pad.data_ptr()]),
            pad,
            0,
            1,
            4,
        )
        for block in model.blocks:
            block.reducer = reducer
        calls = []
        fused = allreduce_module.reduce_add_rms_norm

        def counted(*a, **k):
            calls.append(1)
            return fused(*a, **k)

        allreduce_module.reduce_add_rms_norm = counted  # type: ignore[assignment]
        got = model(*args)
    assert len(calls) == 2 * 3  # post-attention norms, the next blocks' input norms, final norm
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    dist.destroy_process_group()
    print("INTERPRETED-OK")


@pytest.mark.slow
def test_kernel_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    pytest.importorskip("transformers")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300
    )
    assert "INTERPRETED-OK" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


if __name__ == "__main__":
    _interpreted_checks()
