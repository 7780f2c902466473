"""Reference optimizers (LAMB, Lion) against step-by-step float64 formulas written out here."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from slipstream.kernels.optim import Lamb, Lion


# --- independent formula implementations (element lists in float64, no torch optimizer code) ---
class LambFormula:
    """DeepSpeed FusedLamb's update, one tensor at a time, in float64."""

    def __init__(
        self,
        lr,
        betas,
        eps,
        weight_decay,
        bias_correction=True,
        eps_inside_sqrt=False,
        max_coeff=10.0,
        min_coeff=0.01,
    ):
        self.lr, (self.b1, self.b2), self.eps, self.wd = lr, betas, eps, weight_decay
        self.bias_correction, self.eps_inside_sqrt = bias_correction, eps_inside_sqrt
        self.max_coeff, self.min_coeff = max_coeff, min_coeff
        self.m: dict[int, list[float]] = {}
        self.v: dict[int, list[float]] = {}
        self.t: dict[int, int] = {}
        self.coeffs: list[float] = []

    def step(self, key: int, w: list[float], g: list[float]) -> list[float]:
        m = self.m.setdefault(key, [0.0] * len(w))
        v = self.v.setdefault(key, [0.0] * len(w))
        self.t[key] = t = self.t.get(key, 0) + 1
        update = []
        for i in range(len(w)):
            m[i] = self.b1 * m[i] + (1 - self.b1) * g[i]
            v[i] = self.b2 * v[i] + (1 - self.b2) * g[i] * g[i]
            denom = (
                math.sqrt(v[i] + self.eps) if self.eps_inside_sqrt else math.sqrt(v[i]) + self.eps
            )
            update.append(m[i] / denom + self.wd * w[i])
        w_norm = math.sqrt(sum(x * x for x in w))
        u_norm = math.sqrt(sum(x * x for x in update))
        coeff = 1.0
        if w_norm != 0 and u_norm != 0:
            coeff = min(max(w_norm / u_norm, self.min_coeff), self.max_coeff)
        self.coeffs.append(coeff)
        if self.bias_correction:
            step_size = self.lr * math.sqrt(1 - self.b2**t) / (1 - self.b1**t)
        else:
            step_size = self.lr
        return [w[i] - step_size * coeff * update[i] for i in range(len(w))]


class LionFormula:
    """Lion's update, one tensor at a time, in float64."""

    def __init__(self, lr, betas, weight_decay):
        self.lr, (self.b1, self.b2), self.wd = lr, betas, weight_decay
        self.m: dict[int, list[float]] = {}

    def step(self, key: int, w: list[float], g: list[float]) -> list[float]:
        m = self.m.setdefault(key, [0.0] * len(w))
        out = []
        for i in range(len(w)):
            c = self.b1 * m[i] + (1 - self.b1) * g[i]
            sign = (c > 0) - (c < 0)
            out.append(w[i] * (1 - self.lr * self.wd) - self.lr * sign)
            m[i] = self.b2 * m[i] + (1 - self.b2) * g[i]
        return out


def _flat(t: torch.Tensor) -> list[float]:
    return t.detach().double().flatten().tolist()


def _params(dtype: torch.dtype = torch.float64, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(4, 3, generator=gen, dtype=torch.float64).to(dtype)),
        torch.nn.Parameter(torch.randn(5, generator=gen, dtype=torch.float64).to(dtype)),
    ]


def _grads(step: int, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=gen, dtype=torch.float64) * (0.1 + step) for p in params]


# ----------------------------------------------------------------- LAMB
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("eps_inside_sqrt", [False, True])
def test_lamb_matches_formula_over_steps(bias_correction: bool, eps_inside_sqrt: bool) -> None:
    params = _params()
    kwargs = dict(lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    optimizer = Lamb(
        params, bias_correction=bias_correction, eps_inside_sqrt=eps_inside_sqrt, **kwargs
    )
    formula = LambFormula(
        bias_correction=bias_correction, eps_inside_sqrt=eps_inside_sqrt, **kwargs
    )
    expected = [_flat(p) for p in params]
    for step in range(6):
        for p, g in zip(params, _grads(step, params)):
            p.grad = g.clone()
        optimizer.step()
        formula.coeffs.clear()
        expected = [
            formula.step(i, expected[i], _flat(g)) for i, g in enumerate(_grads(step, params))
        ]
        for p, e in zip(params, expected):
            torch.testing.assert_close(
                p.detach(), torch.tensor(e, dtype=torch.float64).view_as(p), rtol=1e-12, atol=1e-12
            )
        assert optimizer.get_lamb_coeffs() == pytest.approx(formula.coeffs, rel=1e-12)


def test_lamb_param_groups_use_their_own_hyperparameters() -> None:
    params = _params()
    optimizer = Lamb(
        [{"params": [params[0]], "weight_decay": 0.0}, {"params": [params[1]], "lr": 0.05}],
        lr=0.01,
        weight_decay=0.2,
    )
    formulas = [
        LambFormula(0.01, (0.9, 0.999), 1e-8, 0.0),
        LambFormula(0.05, (0.9, 0.999), 1e-8, 0.2),
    ]
    expected = [_flat(p) for p in params]
    for step in range(3):
        grads = _grads(step, params)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizer.step()
        expected = [formulas[i].step(i, expected[i], _flat(grads[i])) for i in range(2)]
    for p, e in zip(params, expected):
        torch.testing.assert_close(
            p.detach(), torch.tensor(e, dtype=torch.float64).view_as(p), rtol=1e-12, atol=1e-12
        )


def test_lamb_trust_ratio_is_clamped() -> None:
    big = torch.nn.Parameter(torch.full((4,), 1000.0, dtype=torch.float64))
    tiny = torch.nn.Parameter(torch.full((4,), 1e-6, dtype=torch.float64))
    big.grad = torch.ones(4, dtype=torch.float64)
    tiny.grad = torch.ones(4, dtype=torch.float64)
    optimizer = Lamb([big, tiny], lr=0.1, max_coeff=3.0, min_coeff=0.5)
    optimizer.step()
    # First step, unit grads: m/(sqrt(v)+eps) ~= 1 elementwise, so ||update|| ~= 2; ||w|| = 2000 and 2e-6.
    assert optimizer.get_lamb_coeffs() == [3.0, 0.5]
    # Bias-corrected step size on step 1 is lr * sqrt(1 - b2) / (1 - b1).
    step_size = 0.1 * math.sqrt(1 - 0.999) / (1 - 0.9)
    update = 0.1 / (math.sqrt(0.001) + 1e-8)
    assert big.detach()[0].item() == pytest.approx(1000.0 - step_size * 3.0 * update, rel=1e-12)


def test_lamb_zero_weight_norm_uses_trust_one() -> None:
    # With w = 0 the ratio ||w||/||u|| is 0; DeepSpeed then uses 1, not min_coeff.
    param = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    param.grad = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    optimizer = Lamb([param], lr=0.1, bias_correction=False, betas=(0.5, 0.5), eps=0.0)
    optimizer.step()
    assert optimizer.get_lamb_coeffs() == [1.0]
    # m = 0.5 g, v = 0.5 g^2 -> update = sign(g) * sqrt(0.5).
    expected = [-0.1 * math.sqrt(0.5), 0.1 * math.sqrt(0.5), -0.1 * math.sqrt(0.5)]
    torch.testing.assert_close(param.detach(), torch.tensor(expected, dtype=torch.float64))


def test_lamb_zero_update_norm_leaves_weights() -> None:
    param = torch.nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.float64))
    param.grad = torch.zeros(2, dtype=torch.float64)
    optimizer = Lamb([param], lr=0.1)
    optimizer.step()
    assert optimizer.get_lamb_coeffs() == [1.0]
    assert param.detach().tolist() == [1.0, 2.0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_lamb_low_precision_tracks_formula(dtype: torch.dtype) -> None:
    params = _params(dtype)
    optimizer = Lamb(params, lr=0.01, weight_decay=0.01)
    formula = LambFormula(0.01, (0.9, 0.999), 1e-8, 0.01)
    tol = torch.finfo(dtype).eps
    for step in range(3):
        grads = [g.to(dtype) for g in _grads(step, params)]
        # The formula starts from the same (rounded) weights each step, so rounding does not compound.
        before = [_flat(p) for p in params]
        for p, g in zip(params, grads):
            p.grad = g
        optimizer.step()
        for i, p in enumerate(params):
            expected = torch.tensor(
                formula.step(i, before[i], _flat(grads[i])), dtype=torch.float64
            )
            assert p.dtype == dtype
            torch.testing.assert_close(p.detach().double(), expected.view_as(p), rtol=tol, atol=tol)
    expected_state_dtype = torch.float32 if dtype != torch.float32 else dtype
    assert optimizer.state[params[0]]["exp_avg"].dtype == expected_state_dtype


def test_lamb_skips_parameters_without_gradients_and_runs_closure() -> None:
    params = _params()
    before = params[1].detach().clone()
    params[0].grad = torch.ones_like(params[0])
    optimizer = Lamb(params)
    assert optimizer.step(lambda: 3.5) == 3.5
    assert torch.equal(params[1].detach(), before)
    assert params[1] not in optimizer.state
    assert len(optimizer.get_lamb_coeffs()) == 1


def test_lamb_state_dict_round_trip_continues_identically() -> None:
    params_a = _params()
    opt_a = Lamb(params_a, lr=0.02, weight_decay=0.05)
    for step in range(3):
        for p, g in zip(params_a, _grads(step, params_a)):
            p.grad = g.clone()
        opt_a.step()
    params_b = [torch.nn.Parameter(p.detach().clone()) for p in params_a]
    opt_b = Lamb(params_b, lr=0.5)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    for step in range(3, 6):
        for pa, pb, g in zip(params_a, params_b, _grads(step, params_a)):
            pa.grad, pb.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    for pa, pb in zip(params_a, params_b):
        assert torch.equal(pa.detach(), pb.detach())


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_lamb_rejects_sparse_gradients_and_bad_arguments() -> None:
    param = torch.nn.Parameter(torch.zeros(4))
    param.grad = torch.sparse_coo_tensor(
        torch.tensor([[1]]), torch.tensor([1.0]), (4,), check_invariants=True
    )
    with pytest.raises(RuntimeError, match="sparse"):
        Lamb([param]).step()
    with pytest.raises(ValueError, match="max_coeff"):
        Lamb([param], max_coeff=0.001, min_coeff=0.01)
    with pytest.raises(ValueError, match="betas"):
        Lamb([param], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="lr"):
        Lamb([param], lr=-1.0)


# ----------------------------------------------------------------- Lion
@pytest.mark.parametrize("weight_decay", [0.0, 0.3])
def test_lion_matches_formula_over_steps(weight_decay: float) -> None:
    params = _params()
    optimizer = Lion(params, lr=0.01, betas=(0.9, 0.99), weight_decay=weight_decay)
    formula = LionFormula(0.01, (0.9, 0.99), weight_decay)
    expected = [_flat(p) for p in params]
    for step in range(6):
        grads = _grads(step, params)
        # Flip some gradients so the sign of the interpolation changes between steps.
        grads = [g * (-1) ** step if i == 0 else g for i, g in enumerate(grads)]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizer.step()
        expected = [formula.step(i, expected[i], _flat(grads[i])) for i in range(2)]
        for p, e in zip(params, expected):
            torch.testing.assert_close(
                p.detach(), torch.tensor(e, dtype=torch.float64).view_as(p), rtol=1e-12, atol=1e-12
            )


def test_lion_zero_direction_does_not_move() -> None:
    param = torch.nn.Parameter(torch.tensor([1.0, -1.0, 2.0], dtype=torch.float64))
    param.grad = torch.tensor([0.0, 3.0, 0.0], dtype=torch.float64)
    optimizer = Lion([param], lr=0.1, weight_decay=0.5)
    optimizer.step()
    # Decay first (factor 1 - 0.1 * 0.5), then only the element with a non-zero direction moves.
    assert param.detach().tolist() == pytest.approx([0.95, -0.95 - 0.1, 1.9], rel=1e-15)


def test_lion_defaults_and_param_groups() -> None:
    params = _params()
    optimizer = Lion(
        [{"params": [params[0]]}, {"params": [params[1]], "lr": 0.5, "weight_decay": 0.1}]
    )
    assert optimizer.param_groups[0]["lr"] == 1e-3
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.999)
    assert optimizer.param_groups[1]["lr"] == 0.5
    formulas = [LionFormula(1e-3, (0.9, 0.999), 0.0), LionFormula(0.5, (0.9, 0.999), 0.1)]
    grads = _grads(0, params)
    expected = [formulas[i].step(i, _flat(params[i]), _flat(grads[i])) for i in range(2)]
    for p, g in zip(params, grads):
        p.grad = g
    optimizer.step()
    for p, e in zip(params, expected):
        torch.testing.assert_close(
            p.detach(), torch.tensor(e, dtype=torch.float64).view_as(p), rtol=1e-12, atol=1e-12
        )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_lion_low_precision_keeps_momentum_in_param_dtype(dtype: torch.dtype) -> None:
    params = _params(dtype)
    optimizer = Lion(params, lr=0.01, weight_decay=0.1)
    formula = LionFormula(0.01, (0.9, 0.999), 0.1)
    for step in range(3):
        grads = [g.to(dtype) for g in _grads(step, params)]
        before = [_flat(p) for p in params]
        momentum = [
            _flat(optimizer.state[p]["exp_avg"]) if p in optimizer.state else [0.0] * p.numel()
            for p in params
        ]
        for i in range(2):
            formula.m[i] = momentum[i]
        for p, g in zip(params, grads):
            p.grad = g
        optimizer.step()
        for i, p in enumerate(params):
            expected = (
                torch.tensor(formula.step(i, before[i], _flat(grads[i]))).to(dtype).view_as(p)
            )
            torch.testing.assert_close(p.detach(), expected, rtol=0, atol=0)
            assert optimizer.state[p]["exp_avg"].dtype == dtype


def test_lion_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="weight_decay"):
        Lion([torch.nn.Parameter(torch.zeros(1))], weight_decay=-0.1)
    with pytest.raises(ValueError, match="betas"):
        Lion([torch.nn.Parameter(torch.zeros(1))], betas=(0.9,))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lamb_and_lion_on_the_accelerator_track_the_formulas(dtype: torch.dtype) -> None:
    tol = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps
    for make, formula in (
        (
            lambda ps: Lamb(ps, lr=0.01, weight_decay=0.1),
            LambFormula(0.01, (0.9, 0.999), 1e-8, 0.1),
        ),
        (lambda ps: Lion(ps, lr=0.01, weight_decay=0.1), LionFormula(0.01, (0.9, 0.999), 0.1)),
    ):
        params = [torch.nn.Parameter(p.detach().to("cuda", dtype)) for p in _params()]
        optimizer = make(params)
        for step in range(3):
            grads = [g.to("cuda", dtype) for g in _grads(step, params)]
            before = [_flat(p) for p in params]
            if isinstance(formula, LionFormula):
                for i, p in enumerate(params):
                    state = optimizer.state.get(p)
                    formula.m[i] = _flat(state["exp_avg"]) if state else [0.0] * p.numel()
            for p, g in zip(params, grads):
                p.grad = g
            optimizer.step()
            for i, p in enumerate(params):
                expected = torch.tensor(
                    formula.step(i, before[i], _flat(grads[i])), dtype=torch.float64
                )
                torch.testing.assert_close(
                    p.detach().double().cpu(), expected.view_as(p), rtol=tol, atol=tol
                )
