"""Argument checks shared by the reference optimizers."""

from __future__ import annotations

import math
from collections.abc import Sequence


def check_non_negative(name: str, value: float) -> None:
    """Raise ValueError unless ``value`` is a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def check_betas(betas: Sequence[float]) -> tuple[float, float]:
    """Return ``betas`` as a tuple after checking it holds two numbers in [0, 1)."""
    if len(betas) != 2:
        raise ValueError(f"betas must hold two numbers (beta1, beta2), got {betas!r}")
    for index, beta in enumerate(betas):
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
            raise ValueError(f"betas[{index}] must be a number in [0, 1), got {beta!r}")
    return (float(betas[0]), float(betas[1]))
