"""fp16 loss scaling with DeepSpeed's semantics: a static scale, or a dynamic one with hysteresis."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "DynamicLossScaler",
    "LossScaleUnderflowError",
    "LossScaler",
    "StaticLossScaler",
    "grads_have_inf_or_nan",
    "inf_or_nan_flag",
]


class LossScaleUnderflowError(RuntimeError):
    """Gradients overflowed while the dynamic loss scale was already at its minimum."""


class LossScaler:
    """Base of the loss scalers: holds the current scale and scales losses by it.

    The scaler never skips an optimizer step itself; the caller checks the gradients
    (:func:`grads_have_inf_or_nan`), skips the step on overflow and then calls
    :meth:`update` with the result, every step:

    >>> scaler = DynamicLossScaler(init_scale=2.0**16)
    >>> # loss.mul(scaler.loss_scale).backward()
    >>> overflow = False  # grads_have_inf_or_nan(model.parameters())
    >>> # if not overflow: unscale the gradients by 1 / scaler.loss_scale, optimizer.step()
    >>> scaler.update(overflow)
    """

    dynamic: bool = False

    def __init__(self, scale: float) -> None:
        self.cur_scale = float(scale)

    @property
    def loss_scale(self) -> float:
        """The scale to multiply the loss by before ``backward()``."""
        return self.cur_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Return ``loss * loss_scale`` (no backward is run)."""
        return loss * self.cur_scale

    def update(self, overflow: bool) -> None:
        """Record one optimizer step's overflow result (no-op for a static scale)."""

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state, for checkpoints."""
        return {"cur_scale": self.cur_scale}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the state written by :meth:`state_dict`."""
        _require_keys(self, state_dict, ("cur_scale",))
        self.cur_scale = float(state_dict["cur_scale"])

    @classmethod
    def from_config(cls, fp16_config: Any) -> LossScaler:
        """Build the scaler a DeepSpeed ``fp16`` config block asks for.

        ``fp16_config`` is any object with DeepSpeed's fp16 fields: ``enabled``, ``loss_scale``
        (0 selects dynamic scaling), ``initial_scale_power``, ``loss_scale_window``,
        ``hysteresis``, ``consecutive_hysteresis`` and ``min_loss_scale``. When fp16 is not
        enabled the result is a static scaler with scale 1 (DeepSpeed does the same for bf16
        and fp32), so callers need no special case.
        """
        if not getattr(fp16_config, "enabled", False):
            return StaticLossScaler(1.0)
        loss_scale = float(fp16_config.loss_scale)
        if loss_scale != 0:
            return StaticLossScaler(loss_scale)
        return DynamicLossScaler(
            init_scale=2.0 ** float(fp16_config.initial_scale_power),
            scale_window=int(fp16_config.loss_scale_window),
            min_scale=float(fp16_config.min_loss_scale),
            hysteresis=int(fp16_config.hysteresis),
            consecutive_hysteresis=bool(fp16_config.consecutive_hysteresis),
        )


class StaticLossScaler(LossScaler):
    """A loss scale that never changes (DeepSpeed's ``fp16.loss_scale`` > 0)."""

    dynamic = False

    def __init__(self, scale: float = 1.0) -> None:
        _check_positive_finite("scale", scale)
        super().__init__(scale)

    def __repr__(self) -> str:
        return f"StaticLossScaler(scale={self.cur_scale:g})"


class DynamicLossScaler(LossScaler):
    """Dynamic loss scaling with hysteresis, step for step as DeepSpeed's ``DynamicLossScaler``.

    On an overflow the scale is divided by ``scale_factor`` (never below ``min_scale``), but
    only once ``hysteresis`` overflows have been seen: each earlier overflow just uses up one
    unit of hysteresis. After ``scale_window`` steps counted from the last overflow (the
    start counts as an overflow at step -1) without a new overflow, the scale is multiplied
    by ``scale_factor`` and the hysteresis is refilled. With ``consecutive_hysteresis`` the
    hysteresis is also refilled on every step without overflow, so only *consecutive*
    overflows lower the scale.

    Args:
        init_scale: the first scale tried (DeepSpeed: ``2**initial_scale_power``).
        scale_factor: how much the scale shrinks on backoff and grows after a clean window.
        scale_window: clean steps after the last overflow before the scale grows.
        min_scale: the scale never goes below this.
        hysteresis: overflows needed before the scale is lowered (DeepSpeed's ``delayed_shift``).
        consecutive_hysteresis: refill the hysteresis on every step without overflow.
        raise_error_at_min_scale: raise :class:`LossScaleUnderflowError` when an overflow
            would lower a scale that is already at ``min_scale`` (DeepSpeed's default), rather
            than skipping steps forever.
    """

    dynamic = True

    def __init__(
        self,
        init_scale: float,
        scale_factor: float = 2.0,
        scale_window: int = 1000,
        min_scale: float = 1.0,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        *,
        raise_error_at_min_scale: bool = True,
    ) -> None:
        _check_positive_finite("init_scale", init_scale)
        _check_positive_finite("min_scale", min_scale)
        _check_positive_int("scale_window", scale_window)
        _check_positive_int("hysteresis", hysteresis)
        if not (math.isfinite(scale_factor) and scale_factor > 1.0):
            raise ValueError(f"scale_factor must be a finite number > 1, got {scale_factor!r}")
        super().__init__(init_scale)
        self.scale_factor = float(scale_factor)
        self.scale_window = int(scale_window)
        self.min_scale = float(min_scale)
        self.hysteresis = int(hysteresis)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.raise_error_at_min_scale = bool(raise_error_at_min_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = self.hysteresis

    def update(self, overflow: bool) -> None:
        """Advance one step: back off (or spend hysteresis) on overflow, grow after a clean window."""
        if overflow:
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise LossScaleUnderflowError(
                        f"fp16 gradients overflowed at step {self.cur_iter} while the loss scale was "
                        f"already at its minimum ({self.min_scale:g}); the model produces inf/nan "
                        "gradients at any scale. Lower the learning rate, check the data and the "
                        "loss for inf/nan, or train in bf16."
                    )
                next_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
                # DEBUG: the training loop reports skipped steps on rank 0 itself.
                logger.debug(
                    "fp16 gradient overflow: skipping step %d, loss scale %g -> %g",
                    self.cur_iter,
                    self.cur_scale,
                    next_scale,
                )
                self.cur_scale = next_scale
            else:
                logger.debug(
                    "fp16 gradient overflow: skipping step %d, loss scale stays %g, hysteresis %d -> %d",
                    self.cur_iter,
                    self.cur_scale,
                    self.cur_hysteresis,
                    self.cur_hysteresis - 1,
                )
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        """The dynamic state: scale, step counter, last overflow step and remaining hysteresis."""
        return {
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the state written by :meth:`state_dict` (the configuration is not restored)."""
        _require_keys(
            self, state_dict, ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
        )
        self.cur_scale = float(state_dict["cur_scale"])
        self.cur_iter = int(state_dict["cur_iter"])
        self.last_overflow_iter = int(state_dict["last_overflow_iter"])
        self.cur_hysteresis = int(state_dict["cur_hysteresis"])

    def __repr__(self) -> str:
        return (
            f"DynamicLossScaler(scale={self.cur_scale:g}, scale_factor={self.scale_factor:g}, "
            f"scale_window={self.scale_window}, min_scale={self.min_scale:g}, "
            f"hysteresis={self.cur_hysteresis}/{self.hysteresis}, "
            f"consecutive_hysteresis={self.consecutive_hysteresis})"
        )


def inf_or_nan_flag(params_or_grads: Iterable[torch.Tensor | None]) -> torch.Tensor | None:
    """An on-device 0-d float tensor: 1.0 if any gradient holds an inf or nan, else 0.0.

    Nothing here waits for the device, so a data-parallel caller can all-reduce the flag
    (MAX) before reading it. Each item may be a parameter (its ``.grad`` is checked; a
    parameter without a gradient is skipped), a gradient tensor, or ``None`` (skipped). A
    tensor counts as a parameter when it is an ``nn.Parameter`` or requires grad. Returns
    ``None`` when there is no gradient at all.
    """
    flags_by_device: dict[torch.device, list[torch.Tensor]] = {}
    for item in params_or_grads:
        grad = _gradient_of(item)
        if grad is None:
            continue
        if grad.is_sparse:
            grad = grad.coalesce().values()
        # One reduction kernel per tensor, no host round trip; isfinite is exact, unlike the
        # sum-based check whose fp32 accumulator can itself overflow on large finite values.
        flags_by_device.setdefault(grad.device, []).append(torch.isfinite(grad).all())
    if not flags_by_device:
        return None
    per_device = [torch.stack(flags).all() for flags in flags_by_device.values()]
    target = per_device[0].device
    all_finite = torch.stack([flag.to(target, non_blocking=True) for flag in per_device]).all()
    return (~all_finite).to(torch.float32)


def grads_have_inf_or_nan(params_or_grads: Iterable[torch.Tensor | None]) -> bool:
    """Whether any gradient holds an inf or nan (see :func:`inf_or_nan_flag` for the inputs).

    Costs one host-device synchronisation in all, however many tensors are checked.
    """
    flag = inf_or_nan_flag(params_or_grads)
    if flag is None:
        return False
    # The only CPU-GPU sync of the check: the step must know now whether to skip.
    return bool(flag.item())


def _gradient_of(item: torch.Tensor | None) -> torch.Tensor | None:
    if item is None:
        return None
    if isinstance(item, torch.nn.Parameter) or item.requires_grad:
        return item.grad
    return item


def _check_positive_finite(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def _check_positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _require_keys(owner: object, state_dict: Mapping[str, Any], keys: tuple[str, ...]) -> None:
    missing = [key for key in keys if key not in state_dict]
    if missing:
        raise ValueError(
            f"{type(owner).__name__}.load_state_dict: missing {missing} in the given state "
            f"(it has {sorted(state_dict)}); pass a dict produced by {type(owner).__name__}.state_dict()"
        )
