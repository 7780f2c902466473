"""Loss scalers: DeepSpeed's transition rules, written out by hand step by step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from slipstream.kernels.loss_scaler import (
    DynamicLossScaler,
    LossScaler,
    LossScaleUnderflowError,
    StaticLossScaler,
    grads_have_inf_or_nan,
    inf_or_nan_flag,
)

OVF, OK = True, False  # overflow / clean step


def _run(scaler: DynamicLossScaler, table: list[tuple[bool, float, int]]) -> None:
    for step, (overflow, scale_after, hysteresis_after) in enumerate(table):
        scaler.update(overflow)
        assert (scaler.loss_scale, scaler.cur_hysteresis) == (scale_after, hysteresis_after), (
            f"step {step} (overflow={overflow})"
        )


def test_transition_table_non_consecutive_hysteresis() -> None:
    # window 3, hysteresis 2: (overflow?, scale after, hysteresis after), computed by hand.
    scaler = DynamicLossScaler(init_scale=16.0, scale_window=3, min_scale=1.0, hysteresis=2)
    _run(
        scaler,
        [
            (OK, 16.0, 2),  # iter 0: 1 step since the virtual overflow at -1
            (OK, 16.0, 2),  # iter 1
            (OK, 32.0, 2),  # iter 2: 3 clean steps -> grow
            (OVF, 32.0, 1),  # iter 3: first overflow spends hysteresis, scale kept (step skipped)
            (OK, 32.0, 1),  # iter 4: a clean step does NOT refill hysteresis
            (OVF, 16.0, 1),  # iter 5: hysteresis exhausted -> back off
            (OVF, 8.0, 1),  # iter 6: still exhausted -> back off again
            (OK, 8.0, 1),  # iter 7
            (OK, 8.0, 1),  # iter 8
            (OK, 16.0, 2),  # iter 9: 3 clean steps after the overflow at 6 -> grow, refill
            (OVF, 16.0, 1),  # iter 10
            (OVF, 8.0, 1),  # iter 11: two overflows in a row -> back off
        ],
    )
    assert scaler.last_overflow_iter == 11
    assert scaler.cur_iter == 12


def test_transition_table_consecutive_hysteresis() -> None:
    scaler = DynamicLossScaler(
        init_scale=64.0, scale_window=4, min_scale=1.0, hysteresis=2, consecutive_hysteresis=True
    )
    _run(
        scaler,
        [
            (OVF, 64.0, 1),  # iter 0: spend hysteresis
            (OK, 64.0, 2),  # iter 1: refilled at once
            (OVF, 64.0, 1),  # iter 2: isolated overflows never lower the scale
            (OK, 64.0, 2),  # iter 3
            (OVF, 64.0, 1),  # iter 4
            (OVF, 32.0, 1),  # iter 5: two consecutive overflows -> back off
            (OK, 32.0, 2),  # iter 6
            (OK, 32.0, 2),  # iter 7
            (OK, 32.0, 2),  # iter 8
            (OK, 64.0, 2),  # iter 9: 4 clean steps after the overflow at 5 -> grow
        ],
    )


def test_hysteresis_one_backs_off_on_every_overflow() -> None:
    scaler = DynamicLossScaler(init_scale=1024.0, scale_window=1000, hysteresis=1)
    _run(scaler, [(OVF, 512.0, 1), (OVF, 256.0, 1), (OK, 256.0, 1), (OVF, 128.0, 1)])


def test_growth_after_exactly_window_clean_steps() -> None:
    window = 5
    scaler = DynamicLossScaler(init_scale=8.0, scale_window=window, hysteresis=1)
    scaler.update(OVF)  # iter 0 -> scale 4
    for _ in range(window - 1):
        scaler.update(OK)
        assert scaler.loss_scale == 4.0
    scaler.update(OK)  # the window-th clean step
    assert scaler.loss_scale == 8.0
    for _ in range(window - 1):
        scaler.update(OK)
        assert scaler.loss_scale == 8.0
    scaler.update(OK)  # windows keep counting from the same overflow
    assert scaler.loss_scale == 16.0


def test_floor_at_min_scale_without_error() -> None:
    scaler = DynamicLossScaler(
        init_scale=3.0, min_scale=2.0, hysteresis=1, raise_error_at_min_scale=False
    )
    _run(scaler, [(OVF, 2.0, 1), (OVF, 2.0, 1), (OVF, 2.0, 1)])


def test_overflow_at_min_scale_raises_by_default() -> None:
    scaler = DynamicLossScaler(init_scale=4.0, min_scale=1.0, hysteresis=1)
    scaler.update(OVF)
    scaler.update(OVF)
    assert scaler.loss_scale == 1.0
    with pytest.raises(LossScaleUnderflowError, match="minimum"):
        scaler.update(OVF)


def test_hysteresis_spent_at_min_scale_does_not_raise() -> None:
    scaler = DynamicLossScaler(init_scale=1.0, min_scale=1.0, hysteresis=3)
    _run(scaler, [(OVF, 1.0, 2), (OVF, 1.0, 1)])
    with pytest.raises(LossScaleUnderflowError):
        scaler.update(OVF)


def test_static_scaler_never_changes() -> None:
    scaler = StaticLossScaler(128.0)
    for overflow in [OVF, OVF, OK, OK, OK, OVF] * 5:
        scaler.update(overflow)
        assert scaler.loss_scale == 128.0
    assert not scaler.dynamic
    assert scaler.scale_loss(torch.tensor(0.5)).item() == 64.0


def test_state_round_trip_continues_identically() -> None:
    kwargs = dict(init_scale=2.0**10, scale_window=3, min_scale=1.0, hysteresis=2)
    sequence = [
        OK,
        OVF,
        OK,
        OVF,
        OK,
        OK,
        OK,
        OVF,
        OVF,
        OK,
        OK,
        OK,
        OK,
        OVF,
        OK,
        OVF,
        OVF,
        OK,
        OK,
        OK,
        OK,
    ]
    original = DynamicLossScaler(**kwargs)
    for overflow in sequence[:8]:
        original.update(overflow)
    state = original.state_dict()
    assert set(state) >= {"cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis"}
    restored = DynamicLossScaler(**kwargs)
    restored.load_state_dict(state)
    for overflow in sequence[8:]:
        original.update(overflow)
        restored.update(overflow)
        assert restored.state_dict() == original.state_dict()


def test_load_state_dict_names_missing_keys() -> None:
    with pytest.raises(ValueError, match="cur_hysteresis"):
        DynamicLossScaler(init_scale=2.0).load_state_dict(
            {"cur_scale": 1.0, "cur_iter": 0, "last_overflow_iter": -1}
        )


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(init_scale=0.0),
        dict(init_scale=float("inf")),
        dict(init_scale=1.0, scale_window=0),
        dict(init_scale=1.0, hysteresis=0),
        dict(init_scale=1.0, scale_factor=1.0),
        dict(init_scale=1.0, min_scale=-1.0),
    ],
)
def test_bad_arguments_are_rejected(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        DynamicLossScaler(**kwargs)


def _fp16(**overrides: object) -> SimpleNamespace:
    fields: dict[str, object] = dict(
        enabled=True,
        loss_scale=0,
        initial_scale_power=16,
        loss_scale_window=1000,
        hysteresis=2,
        consecutive_hysteresis=False,
        min_loss_scale=1,
    )
    fields.update(overrides)
    return SimpleNamespace(**fields)


def test_from_config_dynamic() -> None:
    scaler = LossScaler.from_config(
        _fp16(
            initial_scale_power=12,
            loss_scale_window=50,
            hysteresis=3,
            min_loss_scale=0.5,
            consecutive_hysteresis=True,
        )
    )
    assert isinstance(scaler, DynamicLossScaler) and scaler.dynamic
    assert scaler.loss_scale == 4096.0
    assert (scaler.scale_window, scaler.hysteresis, scaler.min_scale) == (50, 3, 0.5)
    assert scaler.consecutive_hysteresis and scaler.scale_factor == 2.0


def test_from_config_static_and_disabled() -> None:
    static = LossScaler.from_config(_fp16(loss_scale=256))
    assert isinstance(static, StaticLossScaler) and static.loss_scale == 256.0
    disabled = LossScaler.from_config(_fp16(enabled=False))
    assert isinstance(disabled, StaticLossScaler) and disabled.loss_scale == 1.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_detects_inf_and_nan_in_gradients(dtype: torch.dtype, bad: float) -> None:
    clean = torch.randn(7, 3).to(dtype)
    dirty = torch.randn(5).to(dtype)
    dirty[3] = bad
    assert not grads_have_inf_or_nan([clean, clean.clone()])
    assert grads_have_inf_or_nan([clean, dirty])
    assert grads_have_inf_or_nan([dirty, None])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_checks_parameter_gradients_and_skips_missing_ones(dtype: torch.dtype) -> None:
    with_grad = torch.nn.Parameter(torch.zeros(4, dtype=dtype))
    without_grad = torch.nn.Parameter(torch.zeros(2, dtype=dtype))
    with_grad.grad = torch.ones(4, dtype=dtype)
    assert not grads_have_inf_or_nan([with_grad, without_grad, None])
    with_grad.grad[1] = float("nan")
    assert grads_have_inf_or_nan([without_grad, with_grad])
    # The parameter's own data is not what is checked.
    clean_param = torch.nn.Parameter(torch.full((3,), float("inf"), dtype=dtype))
    clean_param.grad = torch.zeros(3, dtype=dtype)
    assert not grads_have_inf_or_nan([clean_param])


def test_large_finite_fp16_gradients_are_not_overflow() -> None:
    # A sum in fp16 (or of many such values) would overflow; each value is finite.
    grad = torch.full((4096,), 65504.0, dtype=torch.float16)
    assert not grads_have_inf_or_nan([grad])


def test_nothing_to_check() -> None:
    assert not grads_have_inf_or_nan([])
    assert not grads_have_inf_or_nan([None, torch.nn.Parameter(torch.zeros(1))])
    assert inf_or_nan_flag([]) is None


def test_flag_stays_a_tensor_for_all_reduce() -> None:
    flag = inf_or_nan_flag([torch.tensor([1.0, float("inf")])])
    assert isinstance(flag, torch.Tensor) and flag.dtype == torch.float32 and flag.item() == 1.0
    assert inf_or_nan_flag([torch.ones(3)]).item() == 0.0


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_sparse_gradients() -> None:
    indices = torch.tensor([[0, 2]])
    clean = torch.sparse_coo_tensor(indices, torch.tensor([1.0, 2.0]), (4,), check_invariants=True)
    dirty = torch.sparse_coo_tensor(
        indices, torch.tensor([1.0, float("nan")]), (4,), check_invariants=True
    )
    assert not grads_have_inf_or_nan([clean])
    assert grads_have_inf_or_nan([clean, dirty])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_detection_on_the_accelerator_and_across_devices(dtype: torch.dtype) -> None:
    clean = [torch.randn(1000, device="cuda").to(dtype) for _ in range(3)]
    assert not grads_have_inf_or_nan(clean)
    dirty = torch.randn(1000, device="cuda").to(dtype)
    dirty[-1] = float("inf")
    assert grads_have_inf_or_nan([*clean, dirty])
    flag = inf_or_nan_flag([*clean, dirty])
    assert flag is not None and flag.device.type == "cuda"
    # Gradients on the host and on the device in one check.
    cpu_dirty = torch.tensor([float("nan")], dtype=dtype)
    assert grads_have_inf_or_nan([*clean, cpu_dirty])
    assert not grads_have_inf_or_nan([torch.zeros(2, dtype=dtype), *clean])
