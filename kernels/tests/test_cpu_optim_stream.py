"""The C++ Adam's store paths (``stores=``) and memory probes: the same bits as the earlier kernel.

``stores="stream"`` (blocked through L1 buffers, every result written with non-temporal stores,
optional prefetch) and ``stores="stream_out"`` (that out of place, ordinary stores in place) change
only how the step moves memory, never what it computes: every path must equal the earlier
kernel (``stores="mixed"``) bit for bit, on every ISA the CPU has, in place and out of place,
for every gradient and copy dtype, AdamW and L2 mode, at unaligned offsets and odd lengths.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

# Lengths around the 512-element blocks and the 16 Ki-element work items, with tails; views
# start 1-3 elements into their buffers, so no output is aligned to a cache line.
SHAPES = [(1,), (7, 3), (513,), (40_000,), (16_384 + 515,)]
OPTIONS = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, bias_correction=True)


def _views(generator: torch.Generator, offset: int, dtype=torch.float32) -> list[torch.Tensor]:
    out = []
    for shape in SHAPES:
        n = math.prod(shape)
        out.append(torch.randn(offset + n, generator=generator)[offset:].view(shape).to(dtype))
    return out


def _state(seed: int, grad_dtype: torch.dtype) -> dict[str, list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "params": _views(generator, 1),
        "exp_avgs": [t * 0.1 for t in _views(generator, 2)],
        "exp_avg_sqs": [t.abs() * 0.01 for t in _views(generator, 3)],
        "grads": _views(generator, 1, grad_dtype),
    }


def _step(cpu_optim, state, copy_dtype, out_of_place: bool, adam_w: bool, **memory):
    """Two steps (the second reads the first's moments); returns every tensor written."""
    params, exp_avgs, exp_avg_sqs = state["params"], state["exp_avgs"], state["exp_avg_sqs"]
    generator = torch.Generator().manual_seed(99)
    copies = None
    if copy_dtype is not None:
        copies = [t.to(copy_dtype) for t in _views(generator, 3)]  # overwritten
    written: list[torch.Tensor] = []
    for step in (1, 2):
        out = None
        if out_of_place:
            out = tuple(_views(generator, 2 + k) for k in range(3))  # overwritten
        cpu_optim.adam(params, state["grads"], exp_avgs, exp_avg_sqs, adam_w_mode=adam_w,
                       step=step, param_copies=copies, grad_scale=0.75, out=out, **OPTIONS,
                       **memory)  # fmt: skip
        if out is not None:
            params, exp_avgs, exp_avg_sqs = out
    written = [*params, *exp_avgs, *exp_avg_sqs, *(copies or [])]
    return written


@pytest.mark.parametrize("adam_w", [True, False])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_paths_are_the_earlier_kernel_bit_for_bit(
    cpu_optim, monkeypatch, adam_w: bool, grad_dtype: torch.dtype
) -> None:
    memories = [
        dict(stores="stream_out"),
        dict(stores="stream"),
        dict(stores="stream", store_bytes=16, prefetch=700),
        dict(stores="stream", store_bytes=32, prefetch=512),
        dict(stores="stream", store_bytes=64, prefetch=3),
    ]
    for isa in cpu_optim.supported_isas():
        monkeypatch.setenv("SLIPSTREAM_CPU_ISA", isa)
        for copy_dtype, out_of_place in itertools.product(
            [None, torch.bfloat16, torch.float16], [False, True]
        ):
            want = _step(cpu_optim, _state(4, grad_dtype), copy_dtype, out_of_place, adam_w)
            for memory in memories:
                state = _state(4, grad_dtype)
                inputs = [t.clone() for t in state["params"] + state["exp_avgs"]]
                got = _step(cpu_optim, state, copy_dtype, out_of_place, adam_w, **memory)
                where = (isa, copy_dtype, out_of_place, memory)
                assert all(torch.equal(a, b) for a, b in zip(got, want)), where
                if out_of_place:  # the inputs are left as they were
                    now = state["params"] + state["exp_avgs"]
                    assert all(torch.equal(a, b) for a, b in zip(now, inputs)), where


@pytest.mark.parametrize("stores", ["stream", "stream_out"])
def test_store_paths_write_nothing_outside_their_views(cpu_optim, stores: str) -> None:
    # The non-temporal stores cover whole 16/32/64-byte pieces: the bytes around each view
    # (the rest of its buffer) must stay as they were.
    for store_bytes in (0, 16, 32, 64) if stores == "stream" else (0,):
        buffers = [torch.full((40_100,), 7.0) for _ in range(6)]
        views = [b[3 : 3 + 40_000] for b in buffers]
        param, m, v, pout, mout, vout = views
        v.abs_()
        grad = torch.randn(40_000).to(torch.bfloat16)
        copy_buffer = torch.full((40_100,), 7.0, dtype=torch.bfloat16)
        copy = copy_buffer[3 : 3 + 40_000]
        cpu_optim.adam([param], [grad], [m], [v], adam_w_mode=True, step=1,
                       param_copies=[copy], out=([pout], [mout], [vout]), stores=stores,
                       store_bytes=store_bytes, **OPTIONS)  # fmt: skip
        for buffer in [*buffers, copy_buffer.float()]:
            assert bool((buffer[:3] == 7.0).all()) and bool((buffer[40_003:40_005] == 7.0).all())
        assert torch.equal(copy, pout.to(torch.bfloat16))


def test_memory_probes_move_what_they_say(cpu_optim) -> None:
    generator = torch.Generator().manual_seed(2)
    params, exp_avgs, exp_avg_sqs = (_views(generator, 1) for _ in range(3))
    grads = _views(generator, 2, torch.bfloat16)
    total = cpu_optim.memory_probe("read", params, grads, exp_avgs, exp_avg_sqs)
    want = sum(float(t.double().sum()) for t in [*params, *exp_avgs, *exp_avg_sqs, *grads])
    assert total == pytest.approx(want, rel=1e-4, abs=1e-2)
    outs = tuple(_views(generator, 3) for _ in range(3))
    cpu_optim.memory_probe("copy", params, grads, exp_avgs, exp_avg_sqs, out=outs)
    for p, g, m, v, po, mo, vo in zip(params, grads, exp_avgs, exp_avg_sqs, *outs):
        assert torch.equal(po, p + g.float()) and torch.equal(mo, m) and torch.equal(vo, v)
    cpu_optim.memory_probe("write", params, grads, exp_avgs, exp_avg_sqs, store_bytes=16)
    assert all(bool((t == 0).all()) for t in [*params, *exp_avgs, *exp_avg_sqs])


def test_memory_options_are_checked(cpu_optim) -> None:
    param, grad, m, v = (torch.randn(64).abs() for _ in range(4))
    with pytest.raises(ValueError, match="store_bytes=8"):
        cpu_optim.adam([param], [grad], [m], [v], adam_w_mode=True, step=1, stores="stream",
                       store_bytes=8, **OPTIONS)  # fmt: skip
    with pytest.raises(ValueError, match="prefetch=-1"):
        cpu_optim.adam([param], [grad], [m], [v], adam_w_mode=True, step=1, stores="stream",
                       prefetch=-1, **OPTIONS)  # fmt: skip
    with pytest.raises(ValueError, match="stores='fast'"):
        cpu_optim.adam([param], [grad], [m], [v], adam_w_mode=True, step=1, stores="fast",
                       **OPTIONS)  # fmt: skip
    with pytest.raises(ValueError, match="mode='sum'"):
        cpu_optim.memory_probe("sum", [param], [grad], [m], [v])
