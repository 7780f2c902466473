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


@pytest.mark.parametrize("target", ["sm_90", "gfx942"])
def test_kernel_builds_for_gpus(target: str) -> None:
    """The kernel (sum + add + RMSNorm of bf16 words) compiles ahead of time for Hopper and
    MI300."""
    pytest.importorskip("triton")
    from slipstream.inference.allreduce_norm_triton import reduce_add_rms_norm_kernel
    from slipstream.kernels.aot import compile_spec
    from slipstream.kernels.triton_support import AotSpec

    pointers = ["local", "residual", "weight", "total", "out"]
    signature = {f"{name}_ptr": "*i32" for name in pointers}
    signature.update(recv_ptrs="*i64", epoch_ptr="*i32", err_ptr="*i32")
    signature.update(rows="i32", n_words="i32", slot_words="i64", eps="fp32")
    constants = {
        "RANK": 0,
        "WORLD": 2,
        "PACKED": True,
        "NORM": True,
        "HAS_WEIGHT": True,
        "BLOCK": 2048,
        "SPIN": 1 << 26,
    }
    signature.update(dict.fromkeys(constants, "constexpr"))
    spec = AotSpec("reduce_add_rms_norm", reduce_add_rms_norm_kernel, signature, constants)
    result = compile_spec(spec, target)
    assert result.ok, result.error


def _deliver(state: SymmNormState, sender: int, call: int, rows: torch.Tensor) -> None:
    """Put ``rows`` into this rank's receive buffer as peer ``sender``'s push of call ``call``."""
    words = rows.contiguous().view(torch.int32).flatten().to(torch.int64) & 0xFFFFFFFF
    regions = state.recv.view(2, state.world, state.slot_words)
    regions[call % 2, sender, : words.numel()] = (call << 32) | words


def _simulated(world: int, rank: int, rows: int, width: int, dtype: torch.dtype):
    """Rank ``rank``'s state (3 programs) with the peers' buffers beside it."""
    torch.manual_seed(world * 10 + rank)
    parts = [torch.randn(rows, width).to(dtype) for _ in range(world)]
    buffers = [torch.zeros(2 * world * 512, dtype=torch.int64) for _ in range(world)]
    pointers = torch.tensor([b.data_ptr() for b in buffers])
    state = SymmNormState(buffers[rank], pointers, rank, world, 3)
    state.reset()
    return state, parts, buffers


def _interpreted_checks() -> None:
    """Run in a child with TRITON_INTERPRET=1 (see the module docstring)."""
    import torch.distributed as dist

    from slipstream.inference import allreduce as allreduce_module
    from slipstream.inference import from_hf
    from slipstream.inference.allreduce import TPReducer
    from slipstream.inference.allreduce_norm import all_reduce_sum, reduce_add_rms_norm
    from slipstream.inference.testing import tiny_hf_model

    # 1. Simulated peers: 2 ranks (as rank 0) and 4 ranks (as rank 2), fp32 (exact) and bf16
    # (the interpreter rounds fp32 -> bf16 toward zero: within one bf16 step); more rows than
    # programs; two calls (the receive regions alternate).
    for world, rank, dtype in (
        (2, 0, torch.float32),
        (4, 2, torch.float32),
        (2, 1, torch.bfloat16),
    ):
        rows, width = 5, 48
        state, parts, buffers = _simulated(world, rank, rows, width, dtype)
        tol = {"rtol": 0, "atol": 0} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
        residual, weight = torch.randn(rows, width).to(dtype), torch.randn(width).to(dtype)
        for peer in range(world):
            if peer != rank:
                _deliver(state, peer, 1, parts[peer])
        total, normed = reduce_add_rms_norm(state, parts[rank], residual, weight, 1e-5)
        want_total, want_normed = reference(parts, residual, weight, 1e-5)
        torch.testing.assert_close(total, want_total, **tol)
        torch.testing.assert_close(normed, want_normed, rtol=2e-2, atol=2e-2)
        if dtype == torch.float32:
            torch.testing.assert_close(normed, want_normed, rtol=1e-5, atol=1e-5)
        assert int(state.error.item()) == 0 and state.epochs.tolist() == [1, 1, 1]
        words = parts[rank].contiguous().view(torch.int32).flatten().to(torch.int64) & 0xFFFFFFFF
        for peer in range(world):  # its rows went to every peer, numbered 1
            if peer != rank:
                slots = buffers[peer].view(2, world, -1)[1, rank, : words.numel()]
                assert torch.equal(slots >> 32, torch.ones_like(slots))
                assert torch.equal(slots & 0xFFFFFFFF, words)
        for peer in range(world):  # call 2: the sum alone, through the other regions
            if peer != rank:
                _deliver(state, peer, 2, parts[peer])
        torch.testing.assert_close(all_reduce_sum(state, parts[rank]), reference_sum(parts), **tol)
        assert int(state.error.item()) == 0 and state.epochs.tolist() == [2, 2, 2]
    # 2. A peer whose words never come: the wait gives up and raises the error flag (no hang);
    # words of an older call do not pass for this one.
    state, parts, _ = _simulated(2, 1, 2, 16, torch.float32)
    _deliver(state, 0, 3, parts[0])  # call 3 lands in region 1, where call 1 looks
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
        recv = torch.zeros(2 << 12, dtype=torch.int64)
        reducer.norm_state = SymmNormState(recv, torch.tensor([recv.data_ptr()]), 0, 1, 4)
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

    # 4. Real peers: 2 and 3 ranks as threads, each making the same 6 calls (sums and sums +
    # add + norm, 1 to 7 rows) on its own state over the shared buffers.
    for world in (2, 3):
        _threaded_ranks(world)
    print("INTERPRETED-OK")


def _threaded_ranks(world: int) -> None:
    """Every rank a thread running its calls through the interpreted kernel concurrently.

    Triton's interpreter patches ``triton.language`` for the length of each launch and keeps
    the program index in one global: the patch is held over the whole run (restored after) and
    each call runs one program, so that concurrent launches do not trip over each other.
    """
    import threading

    import triton.runtime.interpreter as interpreter

    from slipstream.inference.allreduce_norm import all_reduce_sum, reduce_add_rms_norm

    buffers = [torch.zeros(2 * world * 2048, dtype=torch.int64) for _ in range(world)]
    pointers = torch.tensor([b.data_ptr() for b in buffers])
    states = [SymmNormState(buffers[r], pointers, r, world, 1) for r in range(world)]
    generator = torch.Generator().manual_seed(world)
    calls = []
    for rows in (1, 5, 2, 7, 1, 3):
        parts = [torch.randn(rows, 32, generator=generator) for _ in range(world)]
        calls.append((parts, torch.randn(rows, 32, generator=generator), torch.randn(32)))
    results: list[list] = [[] for _ in range(world)]

    def rank_calls(rank: int) -> None:
        for index, (parts, residual, weight) in enumerate(calls):
            state = states[rank]
            if index % 2:
                results[rank].append(
                    reduce_add_rms_norm(state, parts[rank], residual, weight, 1e-5)
                )
            else:
                results[rank].append(all_reduce_sum(state, parts[rank]))

    original, scopes = interpreter._patch_lang, []

    class _Held:
        def restore(self) -> None:
            pass

    def held(fn):
        scopes.append(original(fn))
        return _Held()

    for state in states:
        state.reset()
        state.spin = 1 << 20
    interpreter._patch_lang = held
    try:
        threads = [
            threading.Thread(target=rank_calls, args=(r,), daemon=True) for r in range(world)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        interpreter._patch_lang = original
        for scope in reversed(scopes):
            scope.restore()
    for rank in range(world):
        assert len(results[rank]) == len(calls), (world, rank)
        assert int(states[rank].error.item()) == 0 and states[rank].epochs.tolist() == [6]
        for index, (parts, residual, weight) in enumerate(calls):
            got = results[rank][index]
            if index % 2:
                total, normed = reference(parts, residual, weight, 1e-5)
                assert torch.equal(got[0], total), (world, rank, index)
                torch.testing.assert_close(got[1], normed, rtol=1e-5, atol=1e-5)
            else:
                assert torch.equal(got, reference_sum(parts)), (world, rank, index)


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
