"""Optimizer ops (adam, lion, lamb, adagrad): references, Triton multi-tensor kernels, C++ CPU.

References are checked against torch.optim / the reference optimizer classes; the fast
backends against the references over several steps with fresh random gradients.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from slipstream.kernels.ops.adagrad.reference import adagrad as adagrad_reference
from slipstream.kernels.ops.adam.reference import adam as adam_reference
from slipstream.kernels.ops.lamb.reference import lamb as lamb_reference
from slipstream.kernels.ops.lion.reference import lion as lion_reference
from slipstream.kernels.optim import Lamb, Lion
from slipstream.kernels.registry import OpRegistry

SHAPES = [(33, 17), (5,), (1,), (2100,), (9000,)]  # odd sizes spanning several blocks
# fp32 params of order 1 after several steps: a few units in the last place.
FP32_STEP = {"rtol": 1e-5, "atol": 2e-6}
# bf16/fp16 params after three steps: each step rounds once, and Triton's interpreter truncates
# fp32 -> bf16 where GPUs round to nearest, so the error can grow by about an ulp per step.
HALF_STEPS = {"rtol": 2**-5, "atol": 2**-6}


def _tensors(device, dtype=torch.float32, seed=0, scale=1.0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=generator) * scale).to(device, dtype) for s in SHAPES]


def _zeros(device, dtype=torch.float32) -> list[torch.Tensor]:
    return [torch.zeros(s, device=device, dtype=dtype) for s in SHAPES]


# -- references against independent implementations ------------------------------------------
def test_lion_reference_matches_the_lion_optimizer() -> None:
    params = _tensors("cpu")
    module_params = [p.clone().requires_grad_() for p in params]
    optimizer = Lion(module_params, lr=0.01, betas=(0.9, 0.99), weight_decay=0.1)
    exp_avgs = _zeros("cpu")
    for step in range(3):
        grads = _tensors("cpu", seed=10 + step)
        for param, grad in zip(module_params, grads):
            param.grad = grad.clone()
        optimizer.step()
        lion_reference(params, grads, exp_avgs, lr=0.01, beta1=0.9, beta2=0.99, weight_decay=0.1)
    for ours, theirs in zip(params, module_params):
        torch.testing.assert_close(ours, theirs.detach(), rtol=0, atol=0)


def test_lamb_reference_matches_the_lamb_optimizer() -> None:
    params = _tensors("cpu")
    module_params = [p.clone().requires_grad_() for p in params]
    optimizer = Lamb(module_params, lr=0.01, weight_decay=0.01)
    exp_avgs, exp_avg_sqs = _zeros("cpu"), _zeros("cpu")
    for step in range(1, 4):
        grads = _tensors("cpu", seed=20 + step)
        for param, grad in zip(module_params, grads):
            param.grad = grad.clone()
        optimizer.step()
        trust = lamb_reference(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            lr=0.01,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.01,
            bias_correction=True,
            step=step,
        )
    torch.testing.assert_close(trust, torch.tensor(optimizer.get_lamb_coeffs()))
    for ours, theirs in zip(params, module_params):
        torch.testing.assert_close(ours, theirs.detach(), **FP32_STEP)


def test_adagrad_reference_matches_torch_adagrad() -> None:
    params = _tensors("cpu")
    module_params = [p.clone().requires_grad_() for p in params]
    optimizer = torch.optim.Adagrad(module_params, lr=0.05, eps=1e-10, weight_decay=0.1)
    sums = _zeros("cpu")
    for step in range(3):
        grads = _tensors("cpu", seed=30 + step)
        for param, grad in zip(module_params, grads):
            param.grad = grad.clone()
        optimizer.step()
        adagrad_reference(params, grads, sums, lr=0.05, eps=1e-10, weight_decay=0.1)
    for ours, theirs in zip(params, module_params):
        torch.testing.assert_close(ours, theirs.detach(), **FP32_STEP)


def test_reference_param_copies_and_length_errors() -> None:
    params, grads, states = _tensors("cpu"), _tensors("cpu", seed=1), _zeros("cpu")
    copies = [torch.empty(s, dtype=torch.bfloat16) for s in SHAPES]
    adagrad_reference(params, grads, states, lr=0.1, eps=1e-8, weight_decay=0, param_copies=copies)
    for param, copy in zip(params, copies):
        assert torch.equal(copy, param.to(torch.bfloat16))
    with pytest.raises(ValueError, match="same length"):
        lion_reference(params, grads[:2], states, lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0)


# -- Triton multi-tensor kernels -----------------------------------------------------------
ADAM_CASES = [
    (torch.float32, torch.float32, torch.float32, True, True),
    (torch.float32, torch.float32, torch.float32, False, True),  # Adam + L2
    (torch.bfloat16, torch.bfloat16, torch.float32, True, False),
    (torch.float16, torch.float32, torch.float32, True, True),  # fp32 grads of fp16 params
]


@pytest.mark.parametrize(("param_dtype", "grad_dtype", "state_dtype", "adam_w", "bias"), ADAM_CASES)
def test_triton_adam_matches_reference(
    triton_device, param_dtype, grad_dtype, state_dtype, adam_w, bias
) -> None:
    from slipstream.kernels.ops.adam.triton import adam

    ours = _tensors(triton_device, param_dtype)
    theirs = [p.clone() for p in ours]
    states = [_zeros(triton_device, state_dtype) for _ in range(4)]
    # An extra fp32 tensor in the same call: two dtype groups, two launches.
    ours.append(torch.randn(300, device=triton_device))
    theirs.append(ours[-1].clone())
    for group in states:
        group.append(torch.zeros(300, device=triton_device))
    options = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, adam_w_mode=adam_w)
    for step in range(1, 4):
        grads = _tensors(triton_device, grad_dtype, seed=40 + step)
        grads.append(torch.randn(300, device=triton_device))
        adam(ours, grads, states[0], states[1], bias_correction=bias, step=step, **options)
        adam_reference(
            theirs, grads, states[2], states[3], bias_correction=bias, step=step, **options
        )
    for got, want in zip(ours + states[0] + states[1], theirs + states[2] + states[3]):
        tolerance = FP32_STEP if got.dtype == torch.float32 else HALF_STEPS
        torch.testing.assert_close(got.float(), want.float(), **tolerance)


def test_triton_adam_unaligned_views_of_flat_buffers(triton_device) -> None:
    from slipstream.kernels.ops._multi_tensor import groups
    from slipstream.kernels.ops.adam.triton import adam

    # Views at odd element offsets into flat buffers (as ZeRO's flattened partitions are): the
    # addresses are not 16-byte aligned, so the kernel must take its unhinted path.
    def views(flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[1:4500], flat[4500:4503], flat[4503:13000]]

    generator = torch.Generator().manual_seed(7)
    flats = [torch.randn(13000, generator=generator).to(triton_device) for _ in range(2)]
    states = [torch.zeros(13000, device=triton_device) for _ in range(4)]
    ours, theirs = views(flats[0]), views(flats[0].clone())
    assert not groups("adam", [ours])[0].aligned
    options = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, adam_w_mode=True)
    for step in range(1, 3):
        grads = views(flats[1] * step)
        adam(ours, grads, views(states[0]), views(states[1]), bias_correction=True, step=step,
             **options)  # fmt: skip
        adam_reference(theirs, grads, views(states[2]), views(states[3]), bias_correction=True,
                       step=step, **options)  # fmt: skip
    for got, want in zip(ours + views(states[0]) + views(states[1]),
                         theirs + views(states[2]) + views(states[3])):  # fmt: skip
        torch.testing.assert_close(got, want, **FP32_STEP)


def test_triton_adam_refuses_non_contiguous_tensors(triton_device) -> None:
    from slipstream.kernels.ops.adam.triton import adam

    param = torch.randn(4, 6, device=triton_device).t()
    state = [torch.zeros(6, 4, device=triton_device) for _ in range(2)]
    with pytest.raises(ValueError, match="not contiguous"):
        adam(
            [param],
            [torch.randn(6, 4, device=triton_device)],
            *([s] for s in state),
            lr=1e-3,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.0,
            adam_w_mode=True,
            bias_correction=True,
            step=1,
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_lion_matches_reference(triton_device, dtype) -> None:
    from slipstream.kernels.ops.lion.triton import lion

    ours = _tensors(triton_device, dtype)
    theirs = [p.clone() for p in ours]
    ours_m, theirs_m = _zeros(triton_device, dtype), _zeros(triton_device, dtype)
    copies = [torch.empty(s, device=triton_device, dtype=torch.float16) for s in SHAPES]
    for step in range(3):
        grads = _tensors(triton_device, dtype, seed=50 + step)
        options = dict(lr=0.01, beta1=0.9, beta2=0.99, weight_decay=0.1)
        lion(ours, grads, ours_m, param_copies=copies, **options)
        lion_reference(theirs, grads, theirs_m, **options)
    # In bf16, a momentum within one rounding of zero can flip the sign of the update, which
    # moves that element by 2 * lr instead of 0: allowed on top of the rounding tolerance.
    tolerance = FP32_STEP if dtype == torch.float32 else {"rtol": 2**-5, "atol": 0.02 + 2**-6}
    for got, want in zip(ours + ours_m, theirs + theirs_m):
        torch.testing.assert_close(got.float(), want.float(), **tolerance)
    for copy, param in zip(copies, ours):
        assert torch.equal(copy, param.to(torch.float16))


@pytest.mark.parametrize("eps_inside_sqrt", [False, True])
def test_triton_lamb_matches_reference(triton_device, eps_inside_sqrt) -> None:
    from slipstream.kernels.ops.lamb.triton import lamb

    ours = _tensors(triton_device)
    ours[2].zero_()  # a zero-norm weight: trust ratio 1
    theirs = [p.clone() for p in ours]
    states = [_zeros(triton_device) for _ in range(4)]
    for step in range(1, 4):
        grads = _tensors(triton_device, seed=60 + step)
        options = dict(
            lr=0.01,
            beta1=0.9,
            beta2=0.999,
            eps=1e-6,
            weight_decay=0.01,
            bias_correction=True,
            step=step,
            eps_inside_sqrt=eps_inside_sqrt,
            max_coeff=10.0,
            min_coeff=0.01,
        )
        trust = lamb(ours, grads, states[0], states[1], **options)
        expected = lamb_reference(theirs, grads, states[2], states[3], **options)
        torch.testing.assert_close(trust, expected.to(trust.device), rtol=1e-5, atol=1e-6)
        if step == 1:
            assert trust[2].item() == 1.0  # zero weight norm: the ratio is 1, not 0 or NaN
    for got, want in zip(ours, theirs):
        torch.testing.assert_close(got, want, **FP32_STEP)


# Sizes around the kernels' 1024-element blocks (ops/_multi_tensor.py): one element, a partial
# block, exactly two full blocks, two full blocks + 1, four + 3 (unmasked full blocks, masked
# tails; they keep a full block and a tail at 2048-element blocks too).
BLOCK_SIZES = [1, 7, 2048, 2049, 4099]


def _layout(device, aligned: bool, seed: int, *, positive: bool = False) -> list[torch.Tensor]:
    """fp32 tensors of ``BLOCK_SIZES``: fresh (16-byte aligned) allocations, or consecutive
    views into one flat buffer from its second element on (as in ZeRO's flat partitions), at
    addresses that are not 16-byte aligned."""
    values = torch.randn(1 + sum(BLOCK_SIZES), generator=torch.Generator().manual_seed(seed))
    flat = (values.abs() if positive else values).to(device)
    views = list(torch.split(flat[1:], BLOCK_SIZES))
    return [v.clone() for v in views] if aligned else views


@pytest.mark.parametrize("aligned", [True, False])
def test_triton_adam_full_blocks_tails_aligned_and_not(triton_device, aligned) -> None:
    from slipstream.kernels.ops._multi_tensor import groups
    from slipstream.kernels.ops.adam.triton import adam

    ours = _layout(triton_device, aligned, 6)
    states = [_layout(triton_device, aligned, 7), _layout(triton_device, aligned, 8, positive=True)]
    assert groups("adam", [ours, *states])[0].aligned == aligned
    theirs = [p.clone() for p in ours]
    their_states = [[s.clone() for s in group] for group in states]
    options = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, adam_w_mode=True)
    for step in range(1, 3):
        grads = _layout(triton_device, aligned, 30 + step)
        adam(ours, grads, *states, bias_correction=True, step=step, **options)
        adam_reference(theirs, grads, *their_states, bias_correction=True, step=step, **options)
    for got, want in zip(ours + states[0] + states[1], theirs + their_states[0] + their_states[1]):
        torch.testing.assert_close(got, want, **FP32_STEP)


@pytest.mark.parametrize("aligned", [True, False])
def test_triton_lion_full_blocks_tails_aligned_and_not(triton_device, aligned) -> None:
    from slipstream.kernels.ops._multi_tensor import groups
    from slipstream.kernels.ops.lion.triton import lion

    ours, ours_m = _layout(triton_device, aligned, 1), _layout(triton_device, aligned, 2)
    assert groups("lion", [ours, ours_m])[0].aligned == aligned
    # A second dtype group in the same call: bf16 params and grads with an fp32 momentum.
    ours.append(torch.randn(2051, device=triton_device).to(torch.bfloat16))
    ours_m.append(torch.randn(2051, device=triton_device))
    theirs, theirs_m = [p.clone() for p in ours], [m.clone() for m in ours_m]
    options = dict(lr=0.01, beta1=0.9, beta2=0.99, weight_decay=0.1)
    for step in range(2):
        grads = _layout(triton_device, aligned, 10 + step)
        grads.append(torch.randn(2051, device=triton_device).to(torch.bfloat16))
        lion(ours, grads, ours_m, **options)
        lion_reference(theirs, grads, theirs_m, **options)
    for got, want in zip(ours + ours_m, theirs + theirs_m):
        tolerance = FP32_STEP if got.dtype == torch.float32 else HALF_STEPS
        torch.testing.assert_close(got.float(), want.float(), **tolerance)


@pytest.mark.parametrize("aligned", [True, False])
def test_triton_lamb_full_blocks_tails_aligned_and_not(triton_device, aligned) -> None:
    from slipstream.kernels.ops._multi_tensor import groups
    from slipstream.kernels.ops.lamb.triton import lamb

    ours = _layout(triton_device, aligned, 3)
    states = [_layout(triton_device, aligned, 4), _layout(triton_device, aligned, 5, positive=True)]
    assert groups("lamb", [ours, *states])[0].aligned == aligned
    # A bf16 group (fp32 moments) and an empty tensor: the ratios are gathered from two launches
    # and the empty tensor's stays 1.
    ours += [
        torch.randn(3000, device=triton_device).to(torch.bfloat16),
        torch.empty(0, device=triton_device),
    ]
    for group in states:
        group += [torch.rand(3000, device=triton_device), torch.empty(0, device=triton_device)]
    theirs = [p.clone() for p in ours]
    their_states = [[s.clone() for s in group] for group in states]
    for step in range(1, 3):
        grads = _layout(triton_device, aligned, 20 + step)
        grads += [
            torch.randn(3000, device=triton_device).to(torch.bfloat16),
            torch.empty(0, device=triton_device),
        ]
        options = dict(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01,
                       bias_correction=True, step=step)  # fmt: skip
        trust = lamb(ours, grads, *states, **options)
        expected = lamb_reference(theirs, grads, *their_states, **options)
        expected = expected.to(trust.device)
        torch.testing.assert_close(trust[:-2], expected[:-2], rtol=1e-5, atol=1e-6)
        # The bf16 weights differ by the interpreter's truncation (biased: |w| shrinks), so
        # their norm, and the ratio, by up to about one bf16 ulp.
        torch.testing.assert_close(trust[-2], expected[-2], rtol=2**-7, atol=0)
        assert trust[-1].item() == 1.0
    for got, want in zip(ours + states[0] + states[1], theirs + their_states[0] + their_states[1]):
        tolerance = FP32_STEP if got.dtype == torch.float32 else HALF_STEPS
        torch.testing.assert_close(got.float(), want.float(), **tolerance)


def test_triton_optimizers_refuse_states_of_different_dtypes(triton_device) -> None:
    from slipstream.kernels.ops.lamb.triton import lamb

    param = torch.randn(5, device=triton_device)
    with pytest.raises(ValueError, match="states of one tensor must share a dtype"):
        lamb([param], [param.clone()], [torch.zeros(5, device=triton_device)],
             [torch.zeros(5, device=triton_device, dtype=torch.bfloat16)], lr=0.01, beta1=0.9,
             beta2=0.999, eps=1e-6, weight_decay=0.0, bias_correction=True, step=1)  # fmt: skip


# -- C++ CPU optimizers --------------------------------------------------------------------
def _isas(cpu_optim) -> list[str]:
    return cpu_optim.supported_isas()


def test_cpp_adamw_matches_torch_adamw_on_every_isa(cpu_optim, monkeypatch) -> None:
    for isa in _isas(cpu_optim):
        monkeypatch.setenv("SLIPSTREAM_CPU_ISA", isa)
        params = _tensors("cpu", scale=2.0)
        module_params = [p.clone().requires_grad_() for p in params]
        torch_adamw = torch.optim.AdamW(
            module_params, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, foreach=True
        )
        exp_avgs, exp_avg_sqs = _zeros("cpu"), _zeros("cpu")
        copies = [torch.empty(s, dtype=torch.bfloat16) for s in SHAPES]
        for step in range(1, 6):
            grads = _tensors("cpu", seed=70 + step)
            for param, grad in zip(module_params, grads):
                param.grad = grad.clone()
            torch_adamw.step()
            cpu_optim.adam(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                lr=1e-2,
                beta1=0.9,
                beta2=0.99,
                eps=1e-8,
                weight_decay=0.1,
                adam_w_mode=True,
                bias_correction=True,
                step=step,
                param_copies=copies,
            )
        for ours, theirs, copy in zip(params, module_params, copies):
            torch.testing.assert_close(ours, theirs.detach(), **FP32_STEP, msg=isa)
            assert torch.equal(copy, ours.to(torch.bfloat16)), isa  # round-to-nearest-even


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_cpp_adam_l2_mode_half_grads_and_fp16_copies(cpu_optim, grad_dtype) -> None:
    params = _tensors("cpu")
    expected = [p.clone() for p in params]
    states = [_zeros("cpu") for _ in range(4)]
    copies = [torch.empty(s, dtype=torch.float16) for s in SHAPES]
    options = dict(lr=1e-3, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.05, adam_w_mode=False)
    for step in range(1, 4):
        grads = _tensors("cpu", grad_dtype, seed=80 + step)
        cpu_optim.adam(
            params, grads, states[0], states[1], bias_correction=False, step=step,
            param_copies=copies, **options,
        )  # fmt: skip
        adam_reference(
            expected, [g.float() for g in grads], states[2], states[3],
            bias_correction=False, step=step, **options,
        )  # fmt: skip
    for ours, theirs, copy in zip(params, expected, copies):
        torch.testing.assert_close(ours, theirs, **FP32_STEP)
        assert torch.equal(copy, ours.to(torch.float16))


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_cpp_adam_out_of_place_equals_in_place_on_every_isa(
    cpu_optim, monkeypatch, adam_w_mode
) -> None:
    # Views at odd offsets: the streamed stores start unaligned; 40,000 elements span
    # several 16K-element work items and 512-element blocks, with tails.
    shapes = [*SHAPES, (40_000,)]
    generator = torch.Generator().manual_seed(5)

    def fresh(n_extra: int = 0) -> list[torch.Tensor]:
        return [torch.randn(n_extra + math.prod(s), generator=generator)[n_extra:].view(s)
                for s in shapes]  # fmt: skip

    for isa in _isas(cpu_optim):
        monkeypatch.setenv("SLIPSTREAM_CPU_ISA", isa)
        params, grads, exp_avgs = fresh(), fresh(), fresh()
        exp_avg_sqs = [t.abs() for t in fresh()]
        inputs = [list(t) for t in (params, exp_avgs, exp_avg_sqs)]
        before = [[t.clone() for t in ts] for ts in inputs]
        outs = [fresh(n_extra=3) for _ in range(3)]  # contents irrelevant: fully overwritten
        options = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1,
                       adam_w_mode=adam_w_mode, bias_correction=True, step=3, grad_scale=0.25)  # fmt: skip
        copies_out = [torch.empty(s, dtype=torch.bfloat16) for s in shapes]
        cpu_optim.adam(inputs[0], grads, inputs[1], inputs[2], param_copies=copies_out,
                       out=tuple(outs), **options)  # fmt: skip
        for ts, saved in zip(inputs, before):
            assert all(torch.equal(t, u) for t, u in zip(ts, saved)), isa  # inputs untouched
        copies_in = [torch.empty(s, dtype=torch.bfloat16) for s in shapes]
        cpu_optim.adam(inputs[0], grads, inputs[1], inputs[2], param_copies=copies_in, **options)
        for out, updated in zip(outs, inputs):
            assert all(torch.equal(o, u) for o, u in zip(out, updated)), isa  # bit for bit
        assert all(torch.equal(a, b) for a, b in zip(copies_out, copies_in)), isa


def test_cpp_adam_out_of_place_refuses_outputs_that_overlap_inputs(cpu_optim) -> None:
    param, grad, m, v = (torch.randn(64) for _ in range(4))
    options = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0,
                   adam_w_mode=True, bias_correction=True, step=1)  # fmt: skip
    buffer = torch.empty(200)
    with pytest.raises(RuntimeError, match="overlaps an input"):
        cpu_optim.adam([param], [grad], [m], [v], out=([buffer[:64]], [m[:]], [buffer[128:192]]),
                       **options)  # fmt: skip
    with pytest.raises(RuntimeError, match="one tensor per param"):
        cpu_optim.adam([param], [grad], [m], [v], out=([buffer[:64]], [], []), **options)


def test_cpp_adagrad_and_lion_match_references(cpu_optim) -> None:
    params, lion_params = _tensors("cpu"), _tensors("cpu", seed=3)
    expected, lion_expected = [p.clone() for p in params], [p.clone() for p in lion_params]
    sums, sums_ref, moms, moms_ref = (_zeros("cpu") for _ in range(4))
    for step in range(3):
        grads = _tensors("cpu", seed=90 + step)
        cpu_optim.adagrad(params, grads, sums, lr=0.05, eps=1e-10, weight_decay=0.1)
        adagrad_reference(expected, grads, sums_ref, lr=0.05, eps=1e-10, weight_decay=0.1)
        options = dict(lr=0.01, beta1=0.9, beta2=0.99, weight_decay=0.1)
        cpu_optim.lion(lion_params, grads, moms, **options)
        lion_reference(lion_expected, grads, moms_ref, **options)
    for ours, theirs in zip(params + sums, expected + sums_ref):
        torch.testing.assert_close(ours, theirs, **FP32_STEP)
    for ours, theirs in zip(lion_params + moms, lion_expected + moms_ref):
        torch.testing.assert_close(ours, theirs, **FP32_STEP)


@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cpp_copies_into_unaligned_views_on_every_isa(cpu_optim, monkeypatch, copy_dtype) -> None:
    # The copies are streamed out with non-temporal stores in aligned 16-byte pieces: views at
    # odd offsets into one flat buffer (ZeRO's staging buffers are such views) must get exactly
    # the rounded params, in place and out of place, and the elements between them and past
    # the last one must stay as they were.
    shapes = [(1,), (7,), (2100,), (40_000,), (9,)]
    sizes = [math.prod(s) for s in shapes]
    options = {
        "adam": dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1,
                     adam_w_mode=True, bias_correction=True, step=2),
        "adagrad": dict(lr=0.05, eps=1e-10, weight_decay=0.1),
        "lion": dict(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1),
    }  # fmt: skip
    for isa in _isas(cpu_optim):
        monkeypatch.setenv("SLIPSTREAM_CPU_ISA", isa)
        for name, kwargs in [*options.items(), ("adam out of place", options["adam"])]:
            gen = torch.Generator().manual_seed(11)
            params = [torch.randn(s, generator=gen) for s in shapes]
            grads = [torch.randn(s, generator=gen) for s in shapes]
            states = [[torch.rand(s, generator=gen) for s in shapes] for _ in range(2)]
            flat = torch.full((3 + sum(sizes) + 2 * len(sizes),), 7.0, dtype=copy_dtype)
            copies, at = [], 3
            for size, shape in zip(sizes, shapes):
                copies.append(flat[at : at + size].view(shape))
                at += size + 2  # two untouched elements after each view
            if name == "adam out of place":
                outs = tuple([torch.empty(s) for s in shapes] for _ in range(3))
                cpu_optim.adam(params, grads, *states, param_copies=copies, out=outs, **kwargs)
                params = outs[0]
            elif name == "adam":
                cpu_optim.adam(params, grads, *states, param_copies=copies, **kwargs)
            elif name == "adagrad":
                cpu_optim.adagrad(params, grads, states[0], param_copies=copies, **kwargs)
            else:
                cpu_optim.lion(params, grads, states[0], param_copies=copies, **kwargs)
            for param, copy in zip(params, copies):
                assert torch.equal(copy, param.to(copy_dtype)), (isa, name)
            untouched = torch.ones_like(flat, dtype=torch.bool)
            at = 3
            for size in sizes:
                untouched[at : at + size] = False
                at += size + 2
            assert bool((flat[untouched] == 7.0).all()), (isa, name)


def test_cpp_grad_scale_equals_prescaled_gradients(cpu_optim) -> None:
    """grad_scale (unscale x clip, folded into the step) gives the step of pre-scaled grads."""
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(1031, generator=gen)
    grad = torch.randn(1031, generator=gen) * 8
    scale = 0.37
    cases = {
        "adam": lambda p, g, s, **k: cpu_optim.adam(
            [p],
            [g],
            [s[0]],
            [s[1]],
            lr=1e-2,
            beta1=0.9,
            beta2=0.99,
            eps=1e-8,
            weight_decay=0.1,
            adam_w_mode=False,
            bias_correction=True,
            step=3,
            **k,
        ),
        "adagrad": lambda p, g, s, **k: cpu_optim.adagrad(
            [p], [g], [s[0]], lr=0.05, eps=1e-10, weight_decay=0.1, **k
        ),
        "lion": lambda p, g, s, **k: cpu_optim.lion(
            [p], [g], [s[0]], lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1, **k
        ),
    }
    for name, run in cases.items():
        folded, prescaled = base.clone(), base.clone()
        states_a = [torch.rand(1031, generator=gen) for _ in range(2)]
        states_b = [s.clone() for s in states_a]
        run(folded, grad, states_a, grad_scale=scale)
        run(prescaled, grad * scale, states_b)
        torch.testing.assert_close(folded, prescaled, rtol=1e-6, atol=1e-7, msg=name)
        torch.testing.assert_close(states_a[0], states_b[0], rtol=1e-6, atol=1e-7, msg=name)
        assert not torch.equal(folded, base), name


def test_cpp_optimizer_errors_name_the_problem(cpu_optim, monkeypatch) -> None:
    param = torch.randn(8)
    with pytest.raises(RuntimeError, match="must be float32"):
        cpu_optim.lion([param.double()], [param], [param.clone()], lr=0.1, beta1=0.9,
                       beta2=0.99, weight_decay=0.0)  # fmt: skip
    with pytest.raises(RuntimeError, match="must be contiguous"):
        square = torch.randn(4, 4)
        cpu_optim.adagrad([square.t()], [square], [torch.zeros(4, 4)], lr=0.1, eps=1e-8,
                          weight_decay=0.0)  # fmt: skip
    monkeypatch.setenv("SLIPSTREAM_CPU_ISA", "sve512")
    with pytest.raises(RuntimeError, match="ISA 'sve512' is not supported"):
        cpu_optim.adagrad([param], [param], [torch.zeros(8)], lr=0.1, eps=1e-8, weight_decay=0)


def test_registry_selects_cpp_for_fp32_cpu_params(cpu_optim) -> None:
    from slipstream.kernels.registry import default_registry

    for op in ("adam", "adagrad", "lion"):
        assert default_registry().select(op, "cpu", torch.float32)[0] == "cpp"
        assert default_registry().select(op, "cpu", torch.bfloat16)[0] == "reference"


def test_missing_cpp_build_falls_back_with_one_warning(tmp_path, monkeypatch, caplog) -> None:
    from slipstream.kernels import build_ops

    monkeypatch.setenv(build_ops.CACHE_ENV, str(tmp_path))  # an empty cache: nothing built
    monkeypatch.setenv(build_ops.ON_DEMAND_ENV, "0")
    monkeypatch.setattr(build_ops, "_loaded", {})
    ok, reason = build_ops.cpu_optimizer_probe()
    assert not ok and "build_ops" in reason
    registry = OpRegistry()
    registry.register("adam", "reference", adam_reference, device_types=("*",))
    registry.register(
        "adam",
        "cpp",
        "slipstream.kernels.ops.cpu_optim:adam",
        device_types=("cpu",),
        dtypes=(torch.float32,),
        priority=10,
        available=build_ops.cpu_optimizer_probe,
    )
    with caplog.at_level(logging.WARNING, logger="slipstream.kernels.registry"):
        for _ in range(2):
            assert registry.select("adam", "cpu", torch.float32)[0] == "reference"
    warnings = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
    assert len(warnings) == 1 and "'cpp'" in warnings[0]
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv(build_ops.ON_DEMAND_ENV, "1")
    ok, reason = build_ops.cpu_optimizer_probe()
    assert not ok and "no C++ compiler" in reason


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
@pytest.mark.parametrize(("param_dtype", "grad_dtype", "state_dtype", "adam_w", "bias"), ADAM_CASES)
def test_cuda_cpp_adam_matches_reference(param_dtype, grad_dtype, state_dtype, adam_w, bias):
    from slipstream.kernels.build_ops import fused_adam_cuda_probe
    from slipstream.kernels.ops.adam.cuda import adam

    ok, reason = fused_adam_cuda_probe()
    if not ok:
        pytest.skip(reason)
    ours = _tensors("cuda", param_dtype)
    theirs = [p.clone() for p in ours]
    states = [_zeros("cuda", state_dtype) for _ in range(4)]
    options = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, adam_w_mode=adam_w)
    for step in range(1, 4):
        grads = _tensors("cuda", grad_dtype, seed=40 + step)
        adam(ours, grads, states[0], states[1], bias_correction=bias, step=step, **options)
        adam_reference(
            theirs, grads, states[2], states[3], bias_correction=bias, step=step, **options
        )
    for got, want in zip(ours + states[0] + states[1], theirs + states[2] + states[3]):
        tolerance = FP32_STEP if got.dtype == torch.float32 else HALF_STEPS
        torch.testing.assert_close(got.float(), want.float(), **tolerance)


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_optimizer_matches_torch(cpu_optim, adam_w_mode) -> None:
    from slipstream.kernels.optim import FusedAdam

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 3))
    twin = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 3))
    twin.load_state_dict(model.state_dict())
    ours = FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.1, adam_w_mode=adam_w_mode)
    torch_class = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    theirs = torch_class(twin.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(4):
        batch = torch.randn(5, 7)
        for module, optimizer in ((model, ours), (twin, theirs)):
            optimizer.zero_grad()
            module(batch).square().mean().backward()
            optimizer.step()
    for mine, reference in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(mine, reference, **FP32_STEP)
    with pytest.raises(ValueError, match=r"betas\[1\] must be a number in \[0, 1\)"):
        FusedAdam(model.parameters(), betas=(0.9, 1.0))
