"""Registration helpers for the fast backends that sit beside each op's reference."""

from __future__ import annotations

import torch

from slipstream.kernels.registry import register_op
from slipstream.kernels.triton_support import triton_probe

TRITON_PRIORITY = 10
CPP_PRIORITY = 10
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def register_triton(op: str, target: str, dtypes: tuple[torch.dtype, ...] = TRITON_DTYPES) -> None:
    """Register ``target`` (``"module:attr"``) as backend ``"triton"`` of ``op`` on CUDA/ROCm GPUs.

    The device type ``"cuda"`` covers ROCm too. The backend is unavailable (with the reason in
    ``slipstream report``) when Triton is not installed or too old, and the registry then falls
    back to the reference with one warning.
    """
    register_op(
        op,
        "triton",
        target,
        device_types=("cuda",),
        dtypes=dtypes,
        priority=TRITON_PRIORITY,
        available=triton_probe,
    )


def _cpp_probe() -> tuple[bool, str]:
    from slipstream.kernels.build_ops import cpu_optimizer_probe

    return cpu_optimizer_probe()


def register_cpp(op: str, target: str) -> None:
    """Register ``target`` as backend ``"cpp"`` of ``op`` on the CPU, for fp32 params.

    Available when the C++ extension is already built in the cache, or can be built now (a
    C++ compiler is present): see :mod:`slipstream.kernels.build_ops`.
    """
    register_op(
        op,
        "cpp",
        target,
        device_types=("cpu",),
        dtypes=(torch.float32,),
        priority=CPP_PRIORITY,
        available=_cpp_probe,
    )
