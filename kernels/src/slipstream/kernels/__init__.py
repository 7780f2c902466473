"""slipstream.kernels: accelerator detection, the op registry, and each op's backends.

Importing this package is cheap: the names below load their module (and torch) on first use.

>>> from slipstream.kernels import get_accelerator, get_op
>>> acc = get_accelerator()
>>> rms_norm = get_op("rms_norm", acc.device_type)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slipstream.kernels.accelerator import (
        Accelerator,
        CpuAccelerator,
        CudaAccelerator,
        NullStream,
        RocmAccelerator,
        available_accelerators,
        get_accelerator,
        set_accelerator,
    )
    from slipstream.kernels.registry import (
        OpRegistry,
        OpRow,
        OpUnavailableError,
        UnknownOpError,
        get_op,
        list_ops,
        register_op,
    )
    from slipstream.kernels.report import environment_report, format_report

_LAZY = {
    "Accelerator": "slipstream.kernels.accelerator",
    "CpuAccelerator": "slipstream.kernels.accelerator",
    "CudaAccelerator": "slipstream.kernels.accelerator",
    "NullStream": "slipstream.kernels.accelerator",
    "RocmAccelerator": "slipstream.kernels.accelerator",
    "available_accelerators": "slipstream.kernels.accelerator",
    "get_accelerator": "slipstream.kernels.accelerator",
    "set_accelerator": "slipstream.kernels.accelerator",
    "OpRegistry": "slipstream.kernels.registry",
    "OpRow": "slipstream.kernels.registry",
    "OpUnavailableError": "slipstream.kernels.registry",
    "UnknownOpError": "slipstream.kernels.registry",
    "get_op": "slipstream.kernels.registry",
    "list_ops": "slipstream.kernels.registry",
    "register_op": "slipstream.kernels.registry",
    "environment_report": "slipstream.kernels.report",
    "format_report": "slipstream.kernels.report",
}

__all__ = [
    "Accelerator",
    "CpuAccelerator",
    "CudaAccelerator",
    "NullStream",
    "OpRegistry",
    "OpRow",
    "OpUnavailableError",
    "RocmAccelerator",
    "UnknownOpError",
    "available_accelerators",
    "environment_report",
    "format_report",
    "get_accelerator",
    "get_op",
    "list_ops",
    "register_op",
    "set_accelerator",
]


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'slipstream.kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
