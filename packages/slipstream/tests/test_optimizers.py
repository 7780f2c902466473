"""build_optimizer / resolve_optimizer: DeepSpeed names, hyperparameters, errors, param groups."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
import torch

from slipstream.kernels.config_schema import ConfigError, NotImplementedFeatureError
from slipstream.kernels.optim import Lamb, Lion
from slipstream.runtime.optimizers import build_optimizer, resolve_optimizer


def block(type_: str, **params: object) -> SimpleNamespace:
    return SimpleNamespace(type=type_, params=params)


def params(n: int = 2) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.ones(3)) for _ in range(n)]


@pytest.mark.parametrize(
    ("config", "cls", "expected"),
    [
        (
            block("adam", lr=1e-4, betas=[0.8, 0.9], eps=1e-6, weight_decay=0.1),
            torch.optim.AdamW,
            dict(lr=1e-4, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1),
        ),
        (
            block("adam", adam_w_mode=False, weight_decay=0.1),
            torch.optim.Adam,
            dict(weight_decay=0.1),
        ),
        (block("adamw", adam_w_mode=False, lr=0.5), torch.optim.AdamW, dict(lr=0.5)),
        (block("adam", torch_adam=True, amsgrad=True), torch.optim.AdamW, dict(amsgrad=True)),
        (
            block(
                "lamb",
                lr=2e-3,
                weight_decay=0.01,
                bias_correction=False,
                max_coeff=0.3,
                min_coeff=0.01,
            ),
            Lamb,
            dict(lr=2e-3, weight_decay=0.01, bias_correction=False, max_coeff=0.3, min_coeff=0.01),
        ),
        (
            block("lion", lr=1e-4, betas=[0.95, 0.98], weight_decay=0.5),
            Lion,
            dict(lr=1e-4, betas=(0.95, 0.98), weight_decay=0.5),
        ),
        (
            block("adagrad", lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1),
            torch.optim.Adagrad,
            dict(lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1),
        ),
        (
            block("sgd", lr=0.1, momentum=0.9, nesterov=True),
            torch.optim.SGD,
            dict(lr=0.1, momentum=0.9, nesterov=True),
        ),
        (block("RMSprop", lr=0.01, alpha=0.95), torch.optim.RMSprop, dict(lr=0.01, alpha=0.95)),
        (block("nadam", momentum_decay=0.005), torch.optim.NAdam, dict(momentum_decay=0.005)),
    ],
)
def test_names_build_the_right_class(
    config: SimpleNamespace, cls: type[torch.optim.Optimizer], expected: dict
) -> None:
    optimizer = build_optimizer(config, params())
    assert type(optimizer) is cls
    for key, value in expected.items():
        assert optimizer.defaults[key] == value, key
    # DeepSpeed-only switches are consumed, not passed on.
    assert "adam_w_mode" not in optimizer.defaults and "torch_adam" not in optimizer.defaults


@pytest.mark.parametrize(
    "name", ["ADAMW", "AdamW", "Lamb", "LiOn", "SGD", "Adagrad", "rmsprop", "  adam "]
)
def test_names_are_case_insensitive(name: str) -> None:
    expected: dict[str, type] = {
        "adamw": torch.optim.AdamW,
        "lamb": Lamb,
        "lion": Lion,
        "sgd": torch.optim.SGD,
        "adagrad": torch.optim.Adagrad,
        "rmsprop": torch.optim.RMSprop,
        "adam": torch.optim.AdamW,
    }[name.strip().lower()]
    assert type(build_optimizer(block(name), params())) is expected


def _one_adam_step(config: SimpleNamespace, w0: list[float], g: list[float]) -> list[float]:
    param = torch.nn.Parameter(torch.tensor(w0, dtype=torch.float64))
    optimizer = build_optimizer(config, [param])
    param.grad = torch.tensor(g, dtype=torch.float64)
    optimizer.step()
    return param.detach().tolist()


def _adam_formula(
    w: list[float], g: list[float], lr: float, wd: float, eps: float, decoupled: bool
) -> list[float]:
    # First step: m_hat = g, v_hat = g^2 after bias correction.
    out = []
    for wi, gi in zip(w, g):
        if decoupled:
            out.append(wi * (1 - lr * wd) - lr * gi / (abs(gi) + eps))
        else:
            gl2 = gi + wd * wi
            out.append(wi - lr * gl2 / (abs(gl2) + eps))
    return out


def test_adam_weight_decay_semantics_numerically() -> None:
    # wd * w flips the sign of the gradient here, so L2 and decoupled decay move opposite ways.
    w0, g, lr, wd, eps = [1.0, -2.0], [-0.05, 0.3], 0.01, 0.1, 1e-8
    decoupled = _adam_formula(w0, g, lr, wd, eps, decoupled=True)
    coupled = _adam_formula(w0, g, lr, wd, eps, decoupled=False)
    assert decoupled[0] > w0[0] > coupled[0]
    common = dict(lr=lr, weight_decay=wd, eps=eps)
    assert _one_adam_step(block("adam", **common), w0, g) == pytest.approx(decoupled, rel=1e-12)
    assert _one_adam_step(block("adamw", **common), w0, g) == pytest.approx(decoupled, rel=1e-12)
    assert _one_adam_step(block("adam", adam_w_mode=False, **common), w0, g) == pytest.approx(
        coupled, rel=1e-12
    )
    assert _one_adam_step(block("adamw", adam_w_mode=False, **common), w0, g) == pytest.approx(
        decoupled, rel=1e-12
    )
    assert _one_adam_step(
        block("adam", torch_adam=True, adam_w_mode=False, **common), w0, g
    ) == pytest.approx(coupled, rel=1e-12)


def test_lamb_and_lion_configs_step_like_their_formulas() -> None:
    # Lion, one step from zero momentum: w <- w (1 - lr wd) - lr sign((1 - beta1) g).
    param = torch.nn.Parameter(torch.tensor([1.0, -1.0], dtype=torch.float64))
    optimizer = build_optimizer(block("lion", lr=0.1, weight_decay=0.5), [param])
    param.grad = torch.tensor([2.0, -3.0], dtype=torch.float64)
    optimizer.step()
    assert param.detach().tolist() == pytest.approx(
        [1.0 * 0.95 - 0.1, -1.0 * 0.95 + 0.1], rel=1e-15
    )
    # Lamb without bias correction, first step: update = g/(|g| + eps) = sign(g), trust = ||w|| / ||u||.
    param = torch.nn.Parameter(torch.tensor([3.0, 4.0], dtype=torch.float64))
    optimizer = build_optimizer(
        block("lamb", lr=0.1, bias_correction=False, betas=[0.0, 0.0], eps=0.0), [param]
    )
    param.grad = torch.tensor([1.0, -1.0], dtype=torch.float64)
    optimizer.step()
    trust = 5.0 / math.sqrt(2.0)
    assert param.detach().tolist() == pytest.approx(
        [3.0 - 0.1 * trust, 4.0 + 0.1 * trust], rel=1e-12
    )


def test_cpu_parameters_do_not_request_fused_adam() -> None:
    optimizer = build_optimizer(block("adam"), params())
    assert not optimizer.defaults.get("fused")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device")
def test_cuda_parameters_use_fused_adam_unless_torch_adam() -> None:
    cuda_params = [torch.nn.Parameter(torch.ones(3, device="cuda"))]
    assert build_optimizer(block("adam"), cuda_params).defaults["fused"] is True
    assert not build_optimizer(block("adam", torch_adam=True), cuda_params).defaults.get("fused")
    assert not build_optimizer(block("adam", foreach=True), cuda_params).defaults.get("fused")


def test_unknown_name_suggests_closest() -> None:
    with pytest.raises(ConfigError, match=r"optimizer.type='adamww'.*Did you mean 'adamw'") as info:
        build_optimizer(block("adamww"), params())
    assert "lamb" in str(info.value) and "rmsprop" in str(info.value)
    with pytest.raises(ConfigError, match="not a known optimizer"):
        build_optimizer(block("zzzzzz"), params())


@pytest.mark.parametrize(
    "name", ["OneBitAdam", "zerooneadam", "OneBitLamb", "MuAdam", "muadamw", "MuSGD", "Muon"]
)
def test_known_but_unimplemented_deepspeed_optimizers(name: str) -> None:
    with pytest.raises(NotImplementedFeatureError, match="not implement yet") as info:
        build_optimizer(block(name), params())
    assert name in str(info.value)


def test_unknown_param_names_the_key_and_suggests() -> None:
    with pytest.raises(
        ConfigError, match=r"optimizer\.params\.weight_decya.*optimizer\.params\.weight_decay"
    ):
        build_optimizer(block("adamw", weight_decya=0.1), params())
    with pytest.raises(ConfigError, match=r"optimizer\.params\.max_coef.*max_coeff"):
        build_optimizer(block("lamb", max_coef=1.0), params())
    with pytest.raises(ConfigError, match=r"optimizer\.params\.adam_w_mode"):
        build_optimizer(block("sgd", adam_w_mode=True), params())


def test_bad_param_values_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="gradient_clipping"):
        build_optimizer(block("adam", max_grad_norm=1.0), params())
    with pytest.raises(ConfigError, match=r"optimizer\.params\.adam_w_mode"):
        build_optimizer(block("adam", adam_w_mode="yes"), params())
    with pytest.raises(ConfigError, match=r"optimizer\.params\.lr = -1\.0"):
        build_optimizer(block("adam", lr=-1.0), params())
    with pytest.raises(ConfigError, match="rejected"):
        build_optimizer(block("sgd", lr=0.1, momentum=-1.0), params())
    with pytest.raises(ConfigError, match="betas"):
        build_optimizer(block("lion", betas=[0.9, 1.5]), params())
    with pytest.raises(NotImplementedFeatureError, match=r"optimizer\.params\.amsgrad"):
        build_optimizer(block("adam", bias_correction=False, amsgrad=True), params())
    assert (
        type(build_optimizer(block("adam", bias_correction=True, set_grad_none=True), params()))
        is torch.optim.AdamW
    )


def test_param_groups() -> None:
    a, b, c = params(3)
    groups = [
        {"params": iter([a, b]), "weight_decay": 0.0},
        {"params": c, "lr": 0.5, "betas": [0.5, 0.6]},
    ]
    optimizer = build_optimizer(block("adamw", lr=0.01, weight_decay=0.2), groups)
    first, second = optimizer.param_groups
    assert first["params"] == [a, b] and first["weight_decay"] == 0.0 and first["lr"] == 0.01
    assert second["params"] == [c] and second["lr"] == 0.5 and second["betas"] == (0.5, 0.6)
    assert second["weight_decay"] == 0.2
    # A generator of tensors also works.
    assert len(build_optimizer(block("sgd"), (p for p in params())).param_groups[0]["params"]) == 2


def test_empty_or_malformed_parameters() -> None:
    with pytest.raises(ValueError, match="empty"):
        build_optimizer(block("adam"), [])
    with pytest.raises(ValueError, match="'params'"):
        build_optimizer(block("adam"), [{"lr": 0.1}])


def test_resolve_optimizer(caplog: pytest.LogCaptureFixture) -> None:
    ps = params()
    client = torch.optim.SGD(ps, lr=0.1)
    assert resolve_optimizer(client, None, ps) is client
    assert resolve_optimizer(None, None, ps) is None
    built = resolve_optimizer(None, block("lion"), ps)
    assert isinstance(built, Lion)

    seen: list = []

    def factory(given):
        seen.append(given)
        return torch.optim.Adam(given)

    made = resolve_optimizer(factory, None, iter(ps))
    assert isinstance(made, torch.optim.Adam) and seen[0] == ps

    # DeepSpeed uses the client optimizer and ignores the config block; so do we, with a warning.
    with caplog.at_level(logging.WARNING, logger="slipstream.runtime.optimizers"):
        assert resolve_optimizer(client, block("adam"), ps) is client
    assert "using the client optimizer" in caplog.text and "'adam'" in caplog.text
    with pytest.raises(TypeError, match="returned"):
        resolve_optimizer(lambda given: "not an optimizer", None, ps)
    with pytest.raises(TypeError, match="initialize"):
        resolve_optimizer(42, None, ps)


def _adam_without_bias_correction(
    param: torch.Tensor,
    grads: list[torch.Tensor],
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    decoupled: bool,
) -> torch.Tensor:
    """Adam as DeepSpeed writes it with bias_correction=False: raw moments, no 1 - beta^t."""
    param = param.clone()
    m = torch.zeros_like(param)
    v = torch.zeros_like(param)
    for grad in grads:
        if decoupled:
            param.mul_(1 - lr * weight_decay)
        else:
            grad = grad + weight_decay * param
        m.mul_(betas[0]).add_(grad, alpha=1 - betas[0])
        v.mul_(betas[1]).addcmul_(grad, grad, value=1 - betas[1])
        param.addcdiv_(m, v.sqrt().add_(eps), value=-lr)
    return param


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_adam_without_bias_correction_matches_the_formula(adam_w_mode: bool) -> None:
    torch.manual_seed(0)
    start = torch.randn(1000)
    grads = [torch.randn(1000) for _ in range(4)]
    settings = dict(lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    param = torch.nn.Parameter(start.clone())
    optimizer = build_optimizer(
        block("adam", bias_correction=False, adam_w_mode=adam_w_mode, **settings), [param]
    )
    assert type(optimizer).__name__ == "FusedAdam"
    assert optimizer.param_groups[0]["bias_correction"] is False
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()
    expected = _adam_without_bias_correction(start, grads, decoupled=adam_w_mode, **settings)
    # fp32 on both sides; the C++/torch kernels fuse the arithmetic differently.
    torch.testing.assert_close(param.detach(), expected, rtol=1e-5, atol=1e-6)
    # The first step differs from bias-corrected Adam by far more than that tolerance.
    corrected = torch.nn.Parameter(start.clone())
    torch_adam = torch.optim.AdamW(
        [corrected], lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1
    )
    corrected.grad = grads[0].clone()
    torch_adam.step()
    first = _adam_without_bias_correction(start, grads[:1], decoupled=True, **settings)
    assert (corrected.detach() - first).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("name", "params", "key"),
    [
        ("AdamW", {"betas": [0.9]}, "optimizer.params.betas"),
        ("Adam", {"betas": [0.9, 0.999, 0.5]}, "optimizer.params.betas"),
        ("Lion", {"betas": "0.9"}, "optimizer.params.betas"),
        ("AdamW", {"betas": [0.9, 1.5]}, "optimizer.params.betas"),
        ("Lamb", {"lr": "1e-3"}, "optimizer.params.lr"),
        ("AdamW", {"eps": -1.0}, "optimizer.params.eps"),
        ("SGD", {"lr": 0.1, "weight_decay": True}, "optimizer.params.weight_decay"),
    ],
)
def test_wrong_length_or_typed_hyperparameters_name_the_key(
    name: str, params: dict, key: str
) -> None:
    # betas: [0.9] used to build, then fail inside torch's first step with an IndexError.
    block = SimpleNamespace(type=name, params=params)
    with pytest.raises(ConfigError) as info:
        build_optimizer(block, [torch.nn.Parameter(torch.zeros(2))])
    assert info.value.path == key
    assert key in str(info.value)
