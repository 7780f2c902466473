"""Pure-PyTorch reference optimizers (LAMB, Lion) that fused kernels must match."""

from __future__ import annotations

from slipstream.kernels.optim.lamb import Lamb
from slipstream.kernels.optim.lion import Lion

__all__ = ["Lamb", "Lion"]
