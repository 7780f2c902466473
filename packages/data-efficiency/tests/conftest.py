"""Shared set-up for slipstream-data-efficiency tests."""

from __future__ import annotations

import os

import torch

# Without a GPU the Triton token kernels run in Triton's CPU interpreter; the switch is read
# when a @triton.jit function is defined, so it is set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
