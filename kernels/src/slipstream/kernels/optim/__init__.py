"""Optimizers: pure-PyTorch references (LAMB, Lion) and ``FusedAdam`` over the ``adam`` op."""

from __future__ import annotations

from slipstream.kernels.optim.fused_adam import FusedAdam
from slipstream.kernels.optim.lamb import Lamb
from slipstream.kernels.optim.lion import Lion

__all__ = ["FusedAdam", "Lamb", "Lion"]
