"""What the Triton backends share: the availability probe, launch helpers, and AOT kernel specs.

This module never imports ``triton`` at import time, so the registry can ask whether Triton is
usable without paying for (or failing on) the import. The Triton backends themselves live beside
each op's reference (``ops/<op>/triton.py``) and import ``triton`` at their top: when it is
missing, the registry's lazy load fails and the op falls back to its reference with one warning.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any

import torch

MIN_TRITON = (3, 0)
INTERPRET_ENV = "TRITON_INTERPRET"


def triton_version() -> tuple[int, ...] | None:
    """The installed Triton version as a tuple of ints, or None when Triton is not installed."""
    try:
        import triton
    except ImportError:  # not installed, or blocked (sys.modules["triton"] = None)
        return None

    parts = []
    for piece in str(triton.__version__).split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def triton_probe() -> tuple[bool, str]:
    """The registry probe for Triton backends: ``(True, "")`` or ``(False, why not)``."""
    version = triton_version()
    if version is None:
        return False, "triton is not installed (pip install triton)"
    if version < MIN_TRITON:
        wanted = ".".join(map(str, MIN_TRITON))
        return False, f"triton {'.'.join(map(str, version))} is too old; need >= {wanted}"
    return True, ""


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get(INTERPRET_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def check_kernel_device(op: str, *tensors: torch.Tensor | None) -> None:
    """Raise unless every tensor is on one GPU, or on the CPU under Triton's interpreter."""
    present = [t for t in tensors if t is not None]
    devices = {t.device for t in present}
    if len(devices) > 1:
        raise ValueError(
            f"{op} (triton): tensors are on different devices {sorted(map(str, devices))}; "
            "move them to one device"
        )
    device = next(iter(devices)) if devices else None
    if device is not None and device.type != "cuda" and not interpreting():
        raise ValueError(
            f"{op} (triton): tensors are on {device}, but Triton kernels run on CUDA/ROCm "
            f"GPUs (or on the CPU with {INTERPRET_ENV}=1); use the op's reference backend "
            "for this device"
        )


@functools.cache
def _gdc_available() -> bool:
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_supported(device: torch.device) -> bool:
    """Whether a Triton kernel on ``device`` can launch with programmatic dependent launch
    (``launch_pdl``, grid-dependency control): NVIDIA sm_90+ with a Triton that has it, not
    under the interpreter. Elsewhere a kernel asked for PDL launches plainly (same results)."""
    if device.type != "cuda" or torch.version.hip is not None or interpreting():
        return False
    if not _gdc_available():
        return False
    return _sm90(device.index if device.index is not None else torch.cuda.current_device())


# Arrival counters of kernels whose last program of a group finishes the group's work, per
# (owner, device), grown on demand. Every launch leaves its counters at 0 (the finishing program
# resets its own), so one zeroed buffer serves every later call and stays at a fixed address for
# CUDA-graph replays. Calls on one device run in stream order; each owner has its own buffer, so
# kernels of two ops that may overlap (programmatic dependent launch) never share a counter.
_ARRIVAL_COUNTERS: dict[tuple[str, torch.device], torch.Tensor] = {}


def arrival_counters(owner: str, device: torch.device, count: int) -> torch.Tensor:
    """At least ``count`` zeroed ``int32`` arrival counters of ``owner`` (an op's name) on
    ``device``, left at 0 by every launch that uses them."""
    found = _ARRIVAL_COUNTERS.get((owner, device))
    if found is None or found.numel() < count:
        found = torch.zeros(max(count, 256), device=device, dtype=torch.int32)
        _ARRIVAL_COUNTERS[(owner, device)] = found
    return found


def next_power_of_2(value: int) -> int:
    """The smallest power of two >= ``value`` (1 for ``value <= 1``)."""
    return 1 if value <= 1 else 1 << (int(value) - 1).bit_length()


def block_for(columns: int, cap: int = 4096) -> int:
    """A Triton block width for rows of ``columns`` elements: a power of two, at most ``cap``."""
    # Wide enough to cover the row in one pass for common hidden sizes; capped so a block stays
    # in registers. Kernels loop over the row when it is longer than the block.
    return max(16, min(next_power_of_2(columns), cap))


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` viewed as ``(rows, last dim)`` with unit stride along the last dim (copies if not)."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() > 0 else x.reshape(1, 1)
    if rows.shape[1] > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()  # a copy: the kernels address rows as (row * stride + column)
    return rows


@dataclass(frozen=True)
class AotSpec:
    """One Triton kernel specialisation to compile ahead of time (see ``slipstream.kernels.aot``).

    Attributes:
        name: a readable name for the report, e.g. ``"rms_norm.forward[bf16]"``.
        kernel: the ``@triton.jit`` function.
        signature: argument name -> Triton type (``"*fp32"``, ``"i32"``, ``"fp32"``,
            ``"constexpr"``, ...), in argument order, as ``triton.compiler.ASTSource`` takes it.
        constexprs: values of the ``constexpr`` arguments.
    """

    name: str
    kernel: Any
    signature: dict[str, str]
    constexprs: dict[str, Any] = field(default_factory=dict)


TRITON_DTYPE_NAMES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.uint8: "u8",
    torch.int8: "i8",
}
