"""The reference ``adam`` op against torch.optim.Adam/AdamW and against the formula."""

from __future__ import annotations

import math

import pytest
import torch

from slipstream.kernels.ops import adam as dispatched_adam
from slipstream.kernels.ops.adam.reference import adam

SHAPES = [(7, 5), (13,), (3, 4, 2)]
STEPS = 5
HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8}
# Tolerances: same math, different operation order -> a few ulps per step.
TOLERANCE = {
    torch.float64: {"rtol": 1e-12, "atol": 1e-14},
    torch.float32: {"rtol": 1e-5, "atol": 1e-7},
}


def _make_params(dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    params = [torch.randn(shape, dtype=dtype, device=device) for shape in SHAPES]
    # One non-contiguous parameter: updates must land in the strided storage.
    params.append(torch.randn(6, 9, dtype=dtype, device=device).t())
    return params


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("adam_w_mode", [False, True])
def test_matches_torch_optim_over_several_steps(
    kernel_device: torch.device, dtype: torch.dtype, adam_w_mode: bool
) -> None:
    weight_decay = 0.1
    ours = _make_params(dtype, kernel_device)
    assert not ours[-1].is_contiguous()
    theirs = [p.clone().requires_grad_() for p in ours]
    optimizer_class = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    optimizer = optimizer_class(
        theirs,
        lr=HYPER["lr"],
        betas=(HYPER["beta1"], HYPER["beta2"]),
        eps=HYPER["eps"],
        weight_decay=weight_decay,
        foreach=False,
    )
    exp_avgs = [torch.zeros_like(p) for p in ours]
    exp_avg_sqs = [torch.zeros_like(p) for p in ours]
    for step in range(1, STEPS + 1):
        grads = [torch.randn_like(p) for p in ours]
        for param, grad in zip(theirs, grads):
            param.grad = grad.clone()
        optimizer.step()
        adam(
            ours,
            grads,
            exp_avgs,
            exp_avg_sqs,
            **HYPER,
            weight_decay=weight_decay,
            adam_w_mode=adam_w_mode,
            bias_correction=True,
            step=step,
        )
        for mine, reference in zip(ours, theirs):
            torch.testing.assert_close(mine, reference.detach(), **TOLERANCE[dtype])
    for index, reference in enumerate(theirs):
        state = optimizer.state[reference]
        torch.testing.assert_close(exp_avgs[index], state["exp_avg"], **TOLERANCE[dtype])
        torch.testing.assert_close(exp_avg_sqs[index], state["exp_avg_sq"], **TOLERANCE[dtype])


@pytest.mark.parametrize("adam_w_mode", [False, True])
def test_without_bias_correction_matches_the_formula(adam_w_mode: bool) -> None:
    lr, beta1, beta2, eps, decay = 0.05, 0.8, 0.95, 1e-6, 0.2
    param = torch.randn(11, dtype=torch.float64)
    expected = param.clone()
    m = torch.zeros_like(param)
    v = torch.zeros_like(param)
    m_ref = [0.0] * 11
    v_ref = [0.0] * 11
    for step in range(1, 4):
        grad = torch.randn(11, dtype=torch.float64)
        adam(
            [param],
            [grad],
            [m],
            [v],
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=decay,
            adam_w_mode=adam_w_mode,
            bias_correction=False,
            step=step,
        )
        for i in range(11):  # element by element, in plain Python floats
            p, g = float(expected[i]), float(grad[i])
            if not adam_w_mode:
                g = g + decay * p
            m_ref[i] = beta1 * m_ref[i] + (1 - beta1) * g
            v_ref[i] = beta2 * v_ref[i] + (1 - beta2) * g * g
            update = m_ref[i] / (math.sqrt(v_ref[i]) + eps)
            if adam_w_mode:
                update += decay * p
            expected[i] = p - lr * update
        torch.testing.assert_close(param, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(m, torch.tensor(m_ref, dtype=torch.float64), rtol=1e-12, atol=1e-14)


def test_bf16_params_are_updated_in_fp32_and_rounded_once() -> None:
    params = [torch.randn(64, dtype=torch.bfloat16), torch.randn(8, 8, dtype=torch.bfloat16)]
    exp_avgs = [torch.randn_like(p).abs() * 0.1 for p in params]
    exp_avg_sqs = [torch.rand_like(p) * 0.1 for p in params]
    grads = [torch.randn_like(p) for p in params]
    # Independent fp32 computation with torch.optim.AdamW from the same (upcast) state.
    fp32 = [p.float().requires_grad_() for p in params]
    optimizer = torch.optim.AdamW(fp32, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    for param, m, v, g in zip(fp32, exp_avgs, exp_avg_sqs, grads):
        param.grad = g.float()
        optimizer.state[param] = {
            "step": torch.tensor(2.0),  # AdamW increments to 3 inside step()
            "exp_avg": m.float(),
            "exp_avg_sq": v.float(),
        }
    optimizer.step()
    adam(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        lr=1e-2,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.01,
        adam_w_mode=True,
        bias_correction=True,
        step=3,
    )
    for mine, reference in zip(params, fp32):
        assert mine.dtype == torch.bfloat16
        # bf16 keeps 8 significant bits: allow one rounding of the fp32 result.
        torch.testing.assert_close(mine.float(), reference.detach(), rtol=2**-7, atol=1e-6)
    for mine, reference in zip(exp_avgs, fp32):
        expected = optimizer.state[reference]["exp_avg"]
        torch.testing.assert_close(mine.float(), expected, rtol=2**-7, atol=1e-6)


def test_fp16_grads_with_fp32_params() -> None:
    params = [torch.randn(32)]
    reference = [params[0].clone().requires_grad_()]
    grads = [torch.randn(32).half()]
    reference[0].grad = grads[0].float()
    torch.optim.Adam(reference, lr=1e-3).step()
    adam(
        params,
        grads,
        [torch.zeros(32)],
        [torch.zeros(32)],
        lr=1e-3,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.0,
        adam_w_mode=False,
        bias_correction=True,
        step=1,
    )
    torch.testing.assert_close(params[0], reference[0].detach(), rtol=1e-6, atol=1e-7)


def test_dispatching_function_uses_the_registry(monkeypatch) -> None:
    monkeypatch.setenv("SLIPSTREAM_OP_BACKEND", "adam=reference")  # cpp is tested elsewhere
    params = [torch.randn(5)]
    expected = params[0].clone()
    grads = [torch.randn(5)]
    common = dict(
        lr=0.1,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.0,
        adam_w_mode=True,
        bias_correction=True,
        step=1,
    )
    dispatched_adam(params, grads, [torch.zeros(5)], [torch.zeros(5)], **common)
    adam([expected], grads, [torch.zeros(5)], [torch.zeros(5)], **common)
    assert torch.equal(params[0], expected)
    dispatched_adam([], [], [], [], **common)  # nothing to do, no error


def test_argument_errors() -> None:
    p, g = torch.zeros(3), torch.zeros(3)
    common = dict(
        lr=0.1,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.0,
        adam_w_mode=True,
        bias_correction=True,
    )
    with pytest.raises(ValueError, match="equal lengths, got 1, 2, 1, 1"):
        adam([p], [g, g], [p.clone()], [p.clone()], step=1, **common)
    with pytest.raises(ValueError, match="step must be >= 1"):
        adam([p], [g], [p.clone()], [p.clone()], step=0, **common)
    with pytest.raises(ValueError, match=r"tensor 0 has mismatched shapes.*grad \(4,\)"):
        adam([p], [torch.zeros(4)], [p.clone()], [p.clone()], step=1, **common)
