"""Accelerator detection and a uniform device API over CUDA (NVIDIA), ROCm/HIP (AMD) and CPU."""

from __future__ import annotations

import abc
import contextlib
import logging
import os
import platform
import threading
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

ACCELERATOR_ENV = "SLIPSTREAM_ACCELERATOR"
ACCELERATOR_NAMES = ("cuda", "rocm", "cpu")

# One caching-allocator segment of the large pool: allocations between 1 MiB and 10 MiB are
# served from 20 MiB segments, so one such block leaves a reusable segment in the pool.
_ROCM_WARMUP_BYTES = 20 * 1024 * 1024


class NullStream:
    """A stand-in for a device stream where there is none (CPU): work runs in program order.

    It offers the parts of the ``torch.cuda.Stream`` API that Slipstream code calls, so code
    that overlaps communication with compute runs unchanged (and serially) on CPU.
    """

    def __init__(self, priority: int = 0) -> None:
        self.priority = priority

    def synchronize(self) -> None:
        """Nothing to wait for: CPU work has already finished when this is called."""

    def query(self) -> bool:
        """Always True: there is never outstanding work."""
        return True

    def wait_stream(self, stream: Any) -> None:
        """No-op: program order already orders CPU work."""

    def wait_event(self, event: Any) -> None:
        """No-op: program order already orders CPU work."""

    def __repr__(self) -> str:
        return f"NullStream(priority={self.priority})"


@dataclass(frozen=True)
class CpuInfo:
    """What the host CPU is and which SIMD extensions later CPU kernels can use."""

    model_name: str
    logical_cores: int
    usable_cores: int
    simd: tuple[str, ...]


_SIMD_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_bf16",
    "avx512_fp16",
    "amx_bf16",
    "amx_tile",
    "asimd",
    "asimdhp",
    "sve",
    "sve2",
    "bf16",
)


def cpu_info(cpuinfo_path: str = "/proc/cpuinfo") -> CpuInfo:
    """Describe the host CPU: model name, core counts and SIMD flags (from /proc/cpuinfo on Linux).

    ``asimd`` is how Linux reports ARM NEON. Where /proc/cpuinfo is missing (macOS, Windows)
    the model comes from :mod:`platform` and the SIMD list is empty.
    """
    model = ""
    flags: set[str] = set()
    try:
        with open(cpuinfo_path, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("model name", "cpu model", "hardware") and not model:
                    model = value.strip()
                elif key in ("flags", "features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    if not model:
        model = platform.processor() or platform.machine() or "unknown"
    logical = os.cpu_count() or 1
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = logical
    simd = tuple(flag for flag in _SIMD_FLAGS if flag in flags)
    return CpuInfo(model_name=model, logical_cores=logical, usable_cores=usable, simd=simd)


class Accelerator(abc.ABC):
    """One kind of compute device, as Slipstream sees it.

    Attributes:
        name: ``"cuda"``, ``"rocm"`` or ``"cpu"``.
        device_type: the torch device type: ``"cuda"`` for both NVIDIA and AMD GPUs (PyTorch's
            ROCm build keeps the ``cuda`` name), ``"cpu"`` otherwise.
        communication_backend: the ``torch.distributed`` backend name: ``"nccl"`` on GPUs
            (on ROCm, RCCL answers to the ``"nccl"`` name), ``"gloo"`` on CPU.
        backend_library: the library doing the collectives: ``"nccl"``, ``"rccl"`` or ``"gloo"``.

    >>> from slipstream.kernels import get_accelerator
    >>> acc = get_accelerator()
    >>> x = torch.zeros(4, device=acc.device())
    """

    name: str
    device_type: str
    communication_backend: str
    backend_library: str

    def __init__(self) -> None:
        self._stream_priority = 0

    # -- devices ---------------------------------------------------------------------------
    @abc.abstractmethod
    def device_count(self) -> int:
        """How many devices of this kind this process can see."""

    @abc.abstractmethod
    def current_device_index(self) -> int:
        """The index of the device that new tensors go to by default."""

    @abc.abstractmethod
    def set_device(self, index: int) -> None:
        """Make device ``index`` the default for this process."""

    def device(self, index: int | None = None) -> torch.device:
        """The torch device for ``index`` (default: the current device)."""
        if index is None:
            index = self.current_device_index()
        return torch.device(self.device_type, index)

    @abc.abstractmethod
    def synchronize(self, index: int | None = None) -> None:
        """Wait until all queued work on the device (default: current) has finished."""

    @abc.abstractmethod
    def device_name(self, index: int | None = None) -> str:
        """The marketing name of the device, e.g. ``"NVIDIA H100 80GB HBM3"``."""

    @abc.abstractmethod
    def arch(self, index: int | None = None) -> str:
        """The compile target of the device: ``"sm_90"``, ``"gfx942"``, or the CPU's machine."""

    @abc.abstractmethod
    def version(self) -> str | None:
        """The CUDA or HIP runtime version torch was built with, or None on CPU."""

    def _check_index(self, index: int) -> None:
        count = self.device_count()
        if not 0 <= index < count:
            raise ValueError(
                f"device index {index} is out of range: this process sees {count} "
                f"{self.name} device(s) (indices 0..{count - 1}); check LOCAL_RANK and "
                "CUDA_VISIBLE_DEVICES/HIP_VISIBLE_DEVICES"
            )

    # -- precision -------------------------------------------------------------------------
    @abc.abstractmethod
    def is_bf16_supported(self) -> bool:
        """Whether bfloat16 math is supported on the current device."""

    @abc.abstractmethod
    def is_fp16_supported(self) -> bool:
        """Whether float16 math is supported on the current device."""

    def supported_dtypes(self) -> list[torch.dtype]:
        """The floating-point training dtypes usable here, float32 first."""
        dtypes = [torch.float32]
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        return dtypes

    # -- random number generators ----------------------------------------------------------
    def get_rng_state(self) -> dict[str, torch.Tensor]:
        """The CPU generator's state and the current device's, as tensors (safetensors-ready).

        Keys: ``"cpu"`` always, ``"device"`` on GPU accelerators.
        """
        return {"cpu": torch.get_rng_state()}

    def set_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore generator states saved by :meth:`get_rng_state`."""
        if "cpu" not in state:
            raise KeyError(
                f"RNG state has no 'cpu' entry (keys: {sorted(state)}); pass the dict that "
                "get_rng_state() returned"
            )
        torch.set_rng_state(state["cpu"].cpu())

    def manual_seed(self, seed: int) -> None:
        """Seed the CPU generator and every device generator."""
        torch.manual_seed(seed)

    # -- memory ----------------------------------------------------------------------------
    def memory_allocated(self, index: int | None = None) -> int:
        """Bytes currently held by tensors on the device (0 on CPU: not tracked)."""
        return 0

    def max_memory_allocated(self, index: int | None = None) -> int:
        """Peak of :meth:`memory_allocated` since the last reset (0 on CPU)."""
        return 0

    def memory_reserved(self, index: int | None = None) -> int:
        """Bytes held by the caching allocator, in use or not (0 on CPU)."""
        return 0

    # B027 here and at empty_cache: deliberately not abstract; the no-op is the CPU behaviour.
    def reset_peak_memory_stats(self, index: int | None = None) -> None:  # noqa: B027
        """Restart peak tracking (no-op on CPU)."""

    def total_memory(self, index: int | None = None) -> int:
        """The device's memory capacity in bytes (0 on CPU: host memory is not a budget here)."""
        return 0

    def empty_cache(self) -> None:  # noqa: B027
        """Give cached, unused device memory back to the driver (no-op on CPU)."""

    # -- streams ---------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def Stream(self) -> type:
        """The stream class: ``torch.cuda.Stream`` on GPUs, :class:`NullStream` on CPU."""

    @abc.abstractmethod
    def create_stream(self, priority: int | None = None) -> Any:
        """A new stream; ``priority`` None uses the accelerator's default (see apply_amd_specific).

        Lower numbers are higher priority, as in ``torch.cuda.Stream``.
        """

    @abc.abstractmethod
    def current_stream(self) -> Any:
        """The stream that work is queued on now."""

    @abc.abstractmethod
    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """A context manager that queues work inside it on ``stream``."""

    @property
    def default_stream_priority(self) -> int:
        """The priority :meth:`create_stream` uses when none is given."""
        return self._stream_priority

    # -- vendor settings -------------------------------------------------------------------
    def apply_amd_specific(self, mem_pool_init: bool, stream_priority: int) -> dict[str, Any]:
        """Apply the ``amd_specific`` config block; outside ROCm this changes nothing.

        Returns what was applied: ``{"mem_pool_init": bool, "stream_priority": int | None,
        "note": str}``. The arguments are checked on every accelerator (a bad config value is
        an error on CPU too), then ignored here: only :class:`RocmAccelerator` applies them.
        """
        check_amd_specific(mem_pool_init, stream_priority)
        return {
            "mem_pool_init": False,
            "stream_priority": None,
            "note": f"amd_specific settings apply only on ROCm; ignored on {self.name}",
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, device_type={self.device_type!r})"


class CpuAccelerator(Accelerator):
    """The host CPU as the compute device: one device, program-order streams, gloo.

    Every process sees the CPU as device 0, so ``set_device(local_rank)`` is accepted for any
    rank and changes nothing; memory statistics read 0.
    """

    name = "cpu"
    device_type = "cpu"
    communication_backend = "gloo"
    backend_library = "gloo"

    def device_count(self) -> int:
        """Always 1: the host is one device."""
        return 1

    def current_device_index(self) -> int:
        """Always 0."""
        return 0

    def set_device(self, index: int) -> None:
        """Accepted for any non-negative index (each rank's ``local_rank``); a no-op on CPU."""
        if index < 0:
            raise ValueError(f"device index must be >= 0, got {index}")

    def device(self, index: int | None = None) -> torch.device:
        """``torch.device("cpu")`` whatever the index."""
        return torch.device("cpu")

    def synchronize(self, index: int | None = None) -> None:
        """No-op: CPU ops have finished when they return."""

    def device_name(self, index: int | None = None) -> str:
        """The CPU model name."""
        return cpu_info().model_name

    def arch(self, index: int | None = None) -> str:
        """The machine architecture, e.g. ``"x86_64"`` or ``"aarch64"``."""
        return platform.machine() or "unknown"

    def version(self) -> str | None:
        """None: no device runtime on CPU."""
        return None

    def is_bf16_supported(self) -> bool:
        """True: PyTorch's CPU kernels implement bfloat16."""
        return True

    def is_fp16_supported(self) -> bool:
        """True: PyTorch's CPU kernels implement float16 (slower than bfloat16 on most CPUs)."""
        return True

    @property
    def Stream(self) -> type:
        """:class:`NullStream`."""
        return NullStream

    def create_stream(self, priority: int | None = None) -> NullStream:
        """A :class:`NullStream`."""
        return NullStream(self._stream_priority if priority is None else priority)

    def current_stream(self) -> NullStream:
        """A :class:`NullStream`."""
        return NullStream(self._stream_priority)

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """A do-nothing context manager."""
        return contextlib.nullcontext(stream)


class CudaAccelerator(Accelerator):
    """NVIDIA GPUs through PyTorch's CUDA build; collectives through NCCL."""

    name = "cuda"
    device_type = "cuda"
    communication_backend = "nccl"
    backend_library = "nccl"

    def device_count(self) -> int:
        """``torch.cuda.device_count()``."""
        return torch.cuda.device_count()

    def current_device_index(self) -> int:
        """``torch.cuda.current_device()``."""
        return torch.cuda.current_device()

    def set_device(self, index: int) -> None:
        """``torch.cuda.set_device(index)`` after a range check."""
        self._check_index(index)
        torch.cuda.set_device(index)

    def synchronize(self, index: int | None = None) -> None:
        """``torch.cuda.synchronize``."""
        torch.cuda.synchronize(index)

    def device_name(self, index: int | None = None) -> str:
        """``torch.cuda.get_device_name``."""
        return torch.cuda.get_device_name(self._index(index))

    def arch(self, index: int | None = None) -> str:
        """``"sm_<major><minor>"`` from the compute capability."""
        major, minor = torch.cuda.get_device_capability(self._index(index))
        return f"sm_{major}{minor}"

    def version(self) -> str | None:
        """``torch.version.cuda``."""
        return torch.version.cuda

    def is_bf16_supported(self) -> bool:
        """``torch.cuda.is_bf16_supported()`` (Ampere and newer on NVIDIA)."""
        return bool(torch.cuda.is_bf16_supported())

    def is_fp16_supported(self) -> bool:
        """True from compute capability 5.3 on, where half arithmetic exists."""
        major, minor = torch.cuda.get_device_capability(self.current_device_index())
        return (major, minor) >= (5, 3)

    def get_rng_state(self) -> dict[str, torch.Tensor]:
        """CPU state under ``"cpu"``, the current device's under ``"device"``."""
        state = super().get_rng_state()
        state["device"] = torch.cuda.get_rng_state(self.current_device_index())
        return state

    def set_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore CPU state and, when saved, the current device's."""
        super().set_rng_state(state)
        if "device" in state:
            torch.cuda.set_rng_state(state["device"].cpu(), self.current_device_index())
        else:
            logger.warning(
                "RNG state has no 'device' entry (saved on CPU?); the %s generator keeps "
                "its current state",
                self.name,
            )

    def manual_seed(self, seed: int) -> None:
        """Seed the CPU generator and every GPU's."""
        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)

    def memory_allocated(self, index: int | None = None) -> int:
        """``torch.cuda.memory_allocated``."""
        return torch.cuda.memory_allocated(index)

    def max_memory_allocated(self, index: int | None = None) -> int:
        """``torch.cuda.max_memory_allocated``."""
        return torch.cuda.max_memory_allocated(index)

    def memory_reserved(self, index: int | None = None) -> int:
        """``torch.cuda.memory_reserved``."""
        return torch.cuda.memory_reserved(index)

    def reset_peak_memory_stats(self, index: int | None = None) -> None:
        """``torch.cuda.reset_peak_memory_stats``."""
        torch.cuda.reset_peak_memory_stats(index)

    def total_memory(self, index: int | None = None) -> int:
        """The device's total memory from its properties."""
        return int(torch.cuda.get_device_properties(self._index(index)).total_memory)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache``."""
        torch.cuda.empty_cache()

    @property
    def Stream(self) -> type:
        """``torch.cuda.Stream``."""
        return torch.cuda.Stream

    def create_stream(self, priority: int | None = None) -> torch.cuda.Stream:
        """A new ``torch.cuda.Stream`` on the current device."""
        return torch.cuda.Stream(priority=self._stream_priority if priority is None else priority)

    def current_stream(self) -> torch.cuda.Stream:
        """``torch.cuda.current_stream()``."""
        return torch.cuda.current_stream()

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """``torch.cuda.stream(stream)``."""
        return torch.cuda.stream(stream)

    def _index(self, index: int | None) -> int:
        return self.current_device_index() if index is None else index


def check_amd_specific(mem_pool_init: Any, stream_priority: Any) -> None:
    """Raise TypeError unless ``mem_pool_init`` is a bool and ``stream_priority`` an int."""
    if not isinstance(mem_pool_init, bool):
        raise TypeError(
            "amd_specific.rocm_mem_pool_init must be true or false, got "
            f"{type(mem_pool_init).__name__} {mem_pool_init!r}"
        )
    if isinstance(stream_priority, bool) or not isinstance(stream_priority, int):
        raise TypeError(
            "amd_specific.rocm_stream_priority must be an integer (0 is the default priority, "
            f"negative numbers are higher), got {type(stream_priority).__name__} "
            f"{stream_priority!r}"
        )


def parse_gcn_arch(gcn_arch_name: str) -> str:
    """The bare target from a ROCm arch name: ``"gfx942:sramecc+:xnack-"`` -> ``"gfx942"``."""
    return gcn_arch_name.split(":", 1)[0].strip()


class RocmAccelerator(CudaAccelerator):
    """AMD GPUs through PyTorch's ROCm build (device type ``cuda``); collectives through RCCL."""

    name = "rocm"
    backend_library = "rccl"

    def arch(self, index: int | None = None) -> str:
        """The gfx target, e.g. ``"gfx942"`` (MI300) or ``"gfx90a"`` (MI200)."""
        props = torch.cuda.get_device_properties(self._index(index))
        return parse_gcn_arch(str(getattr(props, "gcnArchName", "")) or "unknown")

    def version(self) -> str | None:
        """``torch.version.hip``."""
        return torch.version.hip

    def is_fp16_supported(self) -> bool:
        """True: every GPU that PyTorch's ROCm build runs on has half arithmetic."""
        return True

    def apply_amd_specific(self, mem_pool_init: bool, stream_priority: int) -> dict[str, Any]:
        """Warm the caching allocator (when asked) and set the priority for new streams.

        ``mem_pool_init`` allocates and frees one block so the allocator holds a segment
        before the first step; ``stream_priority`` becomes the default of
        :meth:`create_stream` (lower is higher priority; torch clamps it to what HIP allows).
        """
        check_amd_specific(mem_pool_init, stream_priority)
        if mem_pool_init:
            block = torch.empty(_ROCM_WARMUP_BYTES, dtype=torch.uint8, device=self.device())
            del block  # freed into the cache, not back to the driver
        self._stream_priority = int(stream_priority)
        return {
            "mem_pool_init": bool(mem_pool_init),
            "stream_priority": self._stream_priority,
            "note": "applied on ROCm",
        }


_ACCELERATOR_CLASSES: dict[str, type[Accelerator]] = {
    "cuda": CudaAccelerator,
    "rocm": RocmAccelerator,
    "cpu": CpuAccelerator,
}

_lock = threading.Lock()
_current: Accelerator | None = None


def available_accelerators() -> list[str]:
    """Names of the accelerators usable in this process, best first; ``"cpu"`` is always last."""
    names: list[str] = []
    if torch.cuda.is_available():
        names.append("rocm" if torch.version.hip else "cuda")
    names.append("cpu")
    return names


def _detect() -> str:
    requested = os.environ.get(ACCELERATOR_ENV, "").strip().lower()
    available = available_accelerators()
    if not requested:
        return available[0]
    if requested not in ACCELERATOR_NAMES:
        raise ValueError(
            f"{ACCELERATOR_ENV}={requested!r} is not an accelerator name; use one of "
            f"{', '.join(ACCELERATOR_NAMES)} (available here: {', '.join(available)})"
        )
    if requested not in available:
        hint = ""
        if requested == "cuda" and "rocm" in available:
            hint = "; this torch is a ROCm build, so ask for 'rocm'"
        elif requested == "rocm" and "cuda" in available:
            hint = "; this torch is a CUDA build, so ask for 'cuda'"
        raise RuntimeError(
            f"{ACCELERATOR_ENV}={requested!r} but no {requested} device is usable in this "
            f"process (available: {', '.join(available)}){hint}; unset {ACCELERATOR_ENV} "
            "to pick automatically"
        )
    return requested


def get_accelerator() -> Accelerator:
    """The process's accelerator, detected once and cached.

    Detection prefers a GPU (ROCm when ``torch.version.hip`` is set, else CUDA) and falls back
    to CPU. ``SLIPSTREAM_ACCELERATOR=cpu|cuda|rocm`` forces one, and is an error if that one is
    not available.
    """
    global _current
    with _lock:
        if _current is None:
            name = _detect()
            _current = _ACCELERATOR_CLASSES[name]()
            logger.debug("accelerator: %s", name)
        return _current


def set_accelerator(accelerator: Accelerator | str | None) -> None:
    """Replace the cached accelerator (an instance or a name); None re-detects on next use.

    Meant for tests and for programs that must pin the choice before anything asks for it.
    """
    global _current
    if isinstance(accelerator, str):
        if accelerator not in _ACCELERATOR_CLASSES:
            raise ValueError(
                f"unknown accelerator {accelerator!r}; use one of {', '.join(ACCELERATOR_NAMES)}"
            )
        accelerator = _ACCELERATOR_CLASSES[accelerator]()
    with _lock:
        _current = accelerator
