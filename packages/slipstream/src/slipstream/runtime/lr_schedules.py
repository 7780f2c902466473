"""DeepSpeed's per-batch learning-rate schedules, and building one from a ``scheduler`` block."""

from __future__ import annotations

import difflib
import inspect
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from slipstream.kernels.config_schema import ConfigError, config_fail
from slipstream.runtime.optimizers import check_constructor_params

logger = logging.getLogger(__name__)

__all__ = [
    "LRRangeTest",
    "OneCycle",
    "ScheduleParamError",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_scheduler",
    "resolve_scheduler",
]

WARMUP_TYPES = ("log", "linear")


class ScheduleParamError(ValueError):
    """A schedule argument has an invalid value; names the argument, the value and what is allowed."""

    def __init__(self, param: str, value: Any, allowed: str) -> None:
        self.param, self.value, self.allowed = param, value, allowed
        super().__init__(f"{param}={value!r} is invalid: expected {allowed}")


class _BatchSchedule:
    """Shared mechanics: a batch counter, writing lrs into the optimizer, checkpoint state.

    ``last_batch_iteration`` is the index of the last batch trained; -1 means training has not
    started, and then the constructor already writes the schedule's first learning rate into
    the optimizer (as DeepSpeed does). Call :meth:`step` after every optimizer step.
    """

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        if isinstance(last_batch_iteration, bool) or not isinstance(last_batch_iteration, int):
            raise ScheduleParamError(
                "last_batch_iteration", last_batch_iteration, "an integer (-1 to start)"
            )
        self.optimizer = _torch_optimizer(optimizer)
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] | None = None

    def get_lr(self) -> list[float]:
        """The learning rate of every parameter group at ``last_batch_iteration``."""
        raise NotImplementedError

    def get_last_lr(self) -> list[float]:
        """The learning rates last written into the optimizer."""
        if self._last_lr is None:
            raise RuntimeError(
                f"{type(self).__name__}.get_last_lr(): no learning rate was set yet; call step() first"
            )
        return list(self._last_lr)

    def step(
        self, last_batch_iteration: int | None = None, *, batch_iteration: int | None = None
    ) -> None:
        """Advance to the next batch (or to ``last_batch_iteration``) and set the optimizer's lrs.

        ``batch_iteration`` is the name DeepSpeed's OneCycle and LRRangeTest use for the same
        argument.
        """
        if batch_iteration is not None:
            if last_batch_iteration is not None:
                raise TypeError("pass last_batch_iteration or batch_iteration, not both")
            last_batch_iteration = batch_iteration
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._set_lrs(self.get_lr())

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint state (the same single key DeepSpeed stores)."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the batch counter; the next :meth:`step` continues the schedule from there."""
        if "last_batch_iteration" not in state_dict:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: no 'last_batch_iteration' in the given "
                f"state (keys: {sorted(state_dict)}); pass a dict produced by state_dict()"
            )
        self.last_batch_iteration = int(state_dict["last_batch_iteration"])

    def _set_lrs(self, lrs: Sequence[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs):
            if isinstance(group["lr"], torch.Tensor):
                # Tensor lrs (capturable/fused optimizers) are updated in place, keeping the tensor.
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = [float(lr) for lr in lrs]

    def _per_group(self, name: str, value: float | Sequence[float]) -> list[float]:
        count = len(self.optimizer.param_groups)
        if isinstance(value, (list, tuple)):
            if len(value) != count:
                raise ScheduleParamError(
                    name, value, f"one number, or a list of {count} (one per parameter group)"
                )
            return [_number(name, v) for v in value]
        return [_number(name, value)] * count


class LRRangeTest(_BatchSchedule):
    """Learning-rate range test: the lr grows from a base value to find where training diverges.

    ``lr = lr_range_test_min_lr * (1 + lr_range_test_step_rate * interval)`` with
    ``interval = (last_batch_iteration + 1) / lr_range_test_step_size``, floored when
    ``lr_range_test_staircase`` is true. Per-group min lrs may be given as a list.

    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    >>> sched = LRRangeTest(opt, lr_range_test_min_lr=0.1, lr_range_test_step_size=10)
    >>> opt.param_groups[0]["lr"]
    0.1
    """

    def __init__(
        self,
        optimizer: Any,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lr = self._per_group("lr_range_test_min_lr", lr_range_test_min_lr)
        if _number("lr_range_test_step_size", lr_range_test_step_size) <= 0:
            raise ScheduleParamError(
                "lr_range_test_step_size", lr_range_test_step_size, "a positive number of steps"
            )
        self.step_size = lr_range_test_step_size
        self.step_rate = _number("lr_range_test_step_rate", lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        if last_batch_iteration == -1:
            self._set_lrs(self.min_lr)

    def get_lr(self) -> list[float]:
        """``min_lr * (1 + step_rate * interval)`` for every group."""
        interval = float(self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        increase = 1.0 + self.step_rate * interval
        return [min_lr * increase for min_lr in self.min_lr]


class OneCycle(_BatchSchedule):
    """1Cycle: lr rises from ``cycle_min_lr`` to ``cycle_max_lr`` and falls back, then decays.

    With ``b = last_batch_iteration + 1`` and ``total = first + second`` step sizes, the cycle
    position ``x = b / total - floor(b / total)`` gives a scale ``x / ratio`` while rising
    (``ratio = first / total``) and ``(x - 1) / (ratio - 1)`` while falling; with a stair count
    > 0 for that half, the scale is floored to ``1 / stair_count`` steps. During the cycle
    (``last_batch_iteration < total``) ``lr = min + (max - min) * scale`` and momentum (first
    beta, or SGD's momentum) ``= max_mom - (max_mom - min_mom) * scale``. After it, with
    ``n = last_batch_iteration - total + 1``: ``lr = min / (1 + decay_lr_rate * n /
    decay_step_size)`` and momentum ``= max_mom * (1 + decay_mom_rate * n / decay_step_size)``;
    a ``decay_step_size`` or rate of 0 holds ``min`` lr / ``max_mom``. At construction the lr
    is set to ``cycle_min_lr`` and the momentum to ``cycle_min_mom``.
    """

    def __init__(
        self,
        optimizer: Any,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        first = _number("cycle_first_step_size", cycle_first_step_size)
        second = (
            first
            if cycle_second_step_size is None
            else _number("cycle_second_step_size", cycle_second_step_size)
        )
        for name, size in (("cycle_first_step_size", first), ("cycle_second_step_size", second)):
            if size <= 0:
                raise ScheduleParamError(name, size, "a positive number of steps")
        if _number("decay_step_size", decay_step_size) < 0:
            raise ScheduleParamError(
                "decay_step_size", decay_step_size, "a number of steps >= 0 (0: no decay)"
            )
        self.first_step_size = float(first)
        self.second_step_size = float(second)
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = _integer("cycle_first_stair_count", cycle_first_stair_count)
        self.second_stair_count = (
            self.first_stair_count
            if cycle_second_stair_count is None
            else _integer("cycle_second_stair_count", cycle_second_stair_count)
        )
        self.decay_step_size = decay_step_size

        self.min_lrs = self._per_group("cycle_min_lr", cycle_min_lr)
        self.max_lrs = self._per_group("cycle_max_lr", cycle_max_lr)
        self.decay_lr_rate = _number("decay_lr_rate", decay_lr_rate)
        self.skip_lr_decay = math.isclose(decay_step_size, 0) or math.isclose(self.decay_lr_rate, 0)
        if last_batch_iteration == -1:
            self._set_lrs(self.min_lrs)

        self.cycle_momentum = bool(cycle_momentum)
        self._momentum_key = _momentum_key(self.optimizer) if self.cycle_momentum else None
        if self.cycle_momentum and self._momentum_key is None:
            logger.warning(
                "OneCycle: cycle_momentum is disabled because %s has neither 'betas' nor "
                "'momentum' in its defaults",
                type(self.optimizer).__name__,
            )
            self.cycle_momentum = False
        self.min_moms = self._per_group("cycle_min_mom", cycle_min_mom)
        self.max_moms = self._per_group("cycle_max_mom", cycle_max_mom)
        self.decay_mom_rate = _number("decay_mom_rate", decay_mom_rate)
        self.skip_mom_decay = math.isclose(decay_step_size, 0) or math.isclose(
            self.decay_mom_rate, 0
        )
        if self.cycle_momentum and last_batch_iteration == -1:
            self._set_momentums(self.min_moms)

    def _scale_factor(self) -> float:
        batch = self.last_batch_iteration + 1
        cycle = math.floor(1 + batch / self.total_size)
        x = 1.0 + batch / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            # Quantise from the integer position in the cycle, not from `scale`: at a half-cycle
            # boundary the float scale can sit 1 ulp under a stair and floor a whole stair down.
            in_cycle = batch % self.total_size
            if in_cycle <= self.first_step_size:
                position = in_cycle * stairs / self.first_step_size
            else:
                position = (self.total_size - in_cycle) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def _decay_interval(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> list[float]:
        """The learning rate of every group at ``last_batch_iteration``."""
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1.0 + self.decay_lr_rate * self._decay_interval()
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list[float] | None:
        """The momentum (first beta) of every group at ``last_batch_iteration``; None when not cycled."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1.0 + self.decay_mom_rate * self._decay_interval()
        return [hi * factor for hi in self.max_moms]

    def step(
        self, last_batch_iteration: int | None = None, *, batch_iteration: int | None = None
    ) -> None:
        """Advance one batch: set the lr and, with ``cycle_momentum``, the momentum."""
        super().step(last_batch_iteration, batch_iteration=batch_iteration)
        momentums = self.get_mom()
        if momentums is not None:
            self._set_momentums(momentums)

    def _set_momentums(self, momentums: Sequence[float]) -> None:
        for group, momentum in zip(self.optimizer.param_groups, momentums):
            if self._momentum_key == "betas":
                group["betas"] = (momentum, *tuple(group["betas"])[1:])
            else:
                group["momentum"] = momentum


class WarmupLR(_BatchSchedule):
    """Warm the lr up from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``, then hold.

    With ``W = max(2, warmup_num_steps)`` and ``i = last_batch_iteration``:
    ``lr = min + (max - min) * gamma``, ``gamma = log(i + 1) / log(W)`` (``warmup_type="log"``)
    or ``i / W`` (``"linear"``) while ``i < W``, and 1 afterwards. ``warmup_max_lr`` defaults
    to each group's lr at construction; both bounds may be per-group lists.

    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    >>> sched = WarmupLR(opt, warmup_max_lr=0.01, warmup_num_steps=100, warmup_type="linear")
    >>> sched.step(); sched.step()
    >>> opt.param_groups[0]["lr"]
    0.0001
    """

    def __init__(
        self,
        optimizer: Any,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        if (
            isinstance(warmup_num_steps, bool)
            or not isinstance(warmup_num_steps, int)
            or warmup_num_steps < 0
        ):
            raise ScheduleParamError("warmup_num_steps", warmup_num_steps, "an integer >= 0")
        if warmup_type not in WARMUP_TYPES:
            raise ScheduleParamError(
                "warmup_type", warmup_type, f"one of {', '.join(map(repr, WARMUP_TYPES))}"
            )
        if warmup_max_lr is None:
            warmup_max_lr = [float(group["lr"]) for group in self.optimizer.param_groups]
        self.min_lrs = self._per_group("warmup_min_lr", warmup_min_lr)
        self.max_lrs = self._per_group("warmup_max_lr", warmup_max_lr)
        self.delta_lrs = [hi - lo for lo, hi in zip(self.min_lrs, self.max_lrs)]
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        if last_batch_iteration == -1:
            self._set_lrs(self.get_lr())

    def get_lr(self) -> list[float]:
        """``min + (max - min) * gamma`` for every group (``min`` before the first step)."""
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._get_gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]

    def _warmup_gamma(self) -> float:
        if self.warmup_type == "log":
            return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
        return self.last_batch_iteration / self.warmup_num_steps

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        return 1.0


class WarmupDecayLR(WarmupLR):
    """:class:`WarmupLR`, then a linear decay to 0 at ``total_num_steps``.

    After warm-up (``i >= W``): ``gamma = max(0, (total_num_steps - i) / max(1, total_num_steps - W))``.
    Unlike :class:`WarmupLR`, ``warmup_max_lr`` defaults to 0.001, as in DeepSpeed.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        _check_total_steps(total_num_steps, warmup_num_steps)
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer,
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
            last_batch_iteration,
        )

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        remaining = float(self.total_num_steps - self.last_batch_iteration)
        return max(0.0, remaining / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_BatchSchedule):
    """Warm up from ``warmup_min_ratio`` of each group's lr to the full lr, then cosine-decay.

    The lr is ``base_lr * ratio`` where ``base_lr`` is each group's lr at construction. With
    ``W = max(2, warmup_num_steps)`` and ``i = last_batch_iteration``: while ``i < W``,
    ``ratio = warmup_min_ratio + (1 - warmup_min_ratio) * r`` with ``r = log(i + 1) / log(W)``
    or ``i / W``; afterwards ``p = min(1, (i - W + 1) / max(1, total_num_steps - W))`` and
    ``ratio = max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2)``, so the lr
    stays at ``cos_min_ratio`` past the end. The lr is 0 until the first :meth:`step`.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        if (
            isinstance(warmup_num_steps, bool)
            or not isinstance(warmup_num_steps, int)
            or warmup_num_steps < 0
        ):
            raise ScheduleParamError("warmup_num_steps", warmup_num_steps, "an integer >= 0")
        _check_total_steps(total_num_steps, warmup_num_steps)
        if warmup_type not in WARMUP_TYPES:
            raise ScheduleParamError(
                "warmup_type", warmup_type, f"one of {', '.join(map(repr, WARMUP_TYPES))}"
            )
        for name, ratio in (
            ("warmup_min_ratio", warmup_min_ratio),
            ("cos_min_ratio", cos_min_ratio),
        ):
            if _number(name, ratio) < 0:
                raise ScheduleParamError(
                    name, ratio, "a ratio >= 0 (a fraction of the optimizer's lr)"
                )
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_type = warmup_type
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.org_lrs = [float(group["lr"]) for group in self.optimizer.param_groups]
        if last_batch_iteration == -1:
            self._set_lrs(self.get_lr())

    def get_lr_ratio(self) -> float:
        """The fraction of the base lr at ``last_batch_iteration`` (0 before the first step)."""
        i = self.last_batch_iteration
        if i < 0:
            return 0.0
        if i < self.warmup_num_steps:
            if self.warmup_type == "log":
                progress = self.inverse_log_warm_up * math.log(i + 1)
            else:
                progress = i / self.warmup_num_steps
            return self.warmup_min_ratio + progress * (1.0 - self.warmup_min_ratio)
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, (i - self.warmup_num_steps + 1) / decay_steps)
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        """``base_lr * ratio`` for every group."""
        ratio = self.get_lr_ratio()
        return [base * ratio for base in self.org_lrs]


SCHEDULES: dict[str, type[_BatchSchedule]] = {
    cls.__name__.lower(): cls
    for cls in (LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR)
}


def _torch_schedulers() -> dict[str, type]:
    module = torch.optim.lr_scheduler
    found: dict[str, type] = {}
    for name in dir(module):
        candidate = getattr(module, name)
        if (
            isinstance(candidate, type)
            and not name.startswith("_")
            and name != "LRScheduler"
            and candidate.__module__ == module.__name__
            and callable(getattr(candidate, "step", None))
            and _first_parameter(candidate) == "optimizer"  # not ChainedScheduler(schedulers)
        ):
            found[name.lower()] = candidate
    return found


def _first_parameter(cls: type) -> str | None:
    try:
        parameters = list(inspect.signature(cls).parameters)
    except (TypeError, ValueError):
        return None
    return parameters[0] if parameters else None


def build_scheduler(scheduler_config: Any, optimizer: Any) -> Any:
    """Create the schedule a DeepSpeed ``scheduler`` block names, for ``optimizer``.

    ``scheduler_config`` has ``.type`` (case-insensitive: ``WarmupLR``, ``WarmupDecayLR``,
    ``WarmupCosineLR``, ``OneCycle``, ``LRRangeTest``, or any ``torch.optim.lr_scheduler``
    class such as ``CosineAnnealingLR``) and ``.params`` (its keyword arguments).

    Raises:
        ConfigError: an unknown name, or an unknown, missing or invalid parameter; the
            message names ``scheduler.params.<key>`` (with the closest valid key).

    >>> from types import SimpleNamespace
    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    >>> block = SimpleNamespace(type="WarmupLR", params={"warmup_max_lr": 0.1, "warmup_num_steps": 10})
    >>> type(build_scheduler(block, opt)).__name__
    'WarmupLR'
    """
    name = str(scheduler_config.type)
    key = name.strip().lower()
    params = dict(scheduler_config.params or {})
    if optimizer is None:
        raise ConfigError(
            f"the config has a 'scheduler' block (type {name!r}) but there is no optimizer to "
            "schedule; add an 'optimizer' block or pass initialize(optimizer=...)"
        )
    torch_classes = _torch_schedulers()
    cls: type | None = SCHEDULES.get(key) or torch_classes.get(key)
    if cls is None:
        valid = sorted(
            {c.__name__ for c in SCHEDULES.values()} | {c.__name__ for c in torch_classes.values()}
        )
        close = difflib.get_close_matches(key, [v.lower() for v in valid], n=1, cutoff=0.5)
        hint = ""
        if close:
            hint = f" Did you mean {next(v for v in valid if v.lower() == close[0])!r}?"
        raise ConfigError(
            f"scheduler.type={name!r} is not a known LR schedule.{hint} Valid names "
            f"(case-insensitive): {', '.join(valid)}",
            "scheduler.type",
        )
    kwargs = check_constructor_params(cls, params, path="scheduler.params")
    try:
        return cls(optimizer, **kwargs)
    except ScheduleParamError as error:
        config_fail(f"scheduler.params.{error.param}", error.value, error.allowed)
    except (TypeError, ValueError) as error:
        raise ConfigError(
            f"scheduler.type={name!r}: {cls.__name__} rejected scheduler.params={kwargs!r}: {error}",
            "scheduler.params",
        ) from error


def resolve_scheduler(
    client_scheduler: Any | Callable[[Any], Any] | None, scheduler_config: Any, optimizer: Any
) -> Any | None:
    """Pick the LR schedule the way ``deepspeed.initialize`` does.

    ``client_scheduler`` is a callable taking the optimizer and returning a schedule, or a
    schedule object (anything with ``step()``), used as is. Otherwise the ``scheduler``
    config block is built with :func:`build_scheduler`. With neither, returns ``None``.

    Raises:
        ConfigError: both a client schedule and a ``scheduler`` block were given (DeepSpeed
            silently prefers one of them, which one depending on its version).
        TypeError: the client schedule has no ``step()``.
    """
    if client_scheduler is not None and scheduler_config is not None:
        raise ConfigError(
            "an LR scheduler was passed to initialize(lr_scheduler=...) and the config also has "
            f"a 'scheduler' block (type {getattr(scheduler_config, 'type', '?')!r}); remove one of them"
        )
    if client_scheduler is None:
        return None if scheduler_config is None else build_scheduler(scheduler_config, optimizer)
    schedule = client_scheduler(optimizer) if callable(client_scheduler) else client_scheduler
    if not callable(getattr(schedule, "step", None)):
        raise TypeError(
            f"the LR scheduler given to initialize() ({type(schedule).__name__}) has no step() "
            "method; pass a scheduler object, or a callable(optimizer) that returns one"
        )
    return schedule


def _torch_optimizer(optimizer: Any) -> Any:
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    if isinstance(getattr(optimizer, "param_groups", None), list):
        return optimizer
    raise TypeError(
        f"{type(optimizer).__name__} is not an optimizer: a schedule needs a torch.optim.Optimizer "
        "(or a wrapper with .optimizer or .param_groups)"
    )


def _momentum_key(optimizer: Any) -> str | None:
    defaults = getattr(optimizer, "defaults", None) or optimizer.param_groups[0]
    if "betas" in defaults:
        return "betas"
    if "momentum" in defaults:
        return "momentum"
    return None


def _check_total_steps(total_num_steps: Any, warmup_num_steps: Any) -> None:
    if isinstance(total_num_steps, bool) or not isinstance(total_num_steps, int):
        raise ScheduleParamError("total_num_steps", total_num_steps, "an integer number of steps")
    if isinstance(warmup_num_steps, int) and total_num_steps < warmup_num_steps:
        raise ScheduleParamError(
            "total_num_steps",
            total_num_steps,
            f"an integer >= warmup_num_steps ({warmup_num_steps})",
        )


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ScheduleParamError(name, value, "a finite number")
    return float(value)


def _integer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScheduleParamError(name, value, "an integer")
    return value
