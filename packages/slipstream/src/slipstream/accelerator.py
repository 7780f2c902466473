"""DeepSpeed's ``deepspeed.accelerator``: ``get_accelerator()`` with DeepSpeed's method meanings.

Slipstream's own accelerator (:func:`slipstream.kernels.get_accelerator`) names things its
way: there ``device_name()`` is the hardware's product name. Scripts written for DeepSpeed
build device strings from ``get_accelerator().device_name(local_rank)`` and expect
``"cuda:0"``; this module gives them DeepSpeed's meanings over the same detection.

>>> from slipstream.accelerator import get_accelerator
>>> get_accelerator().device_name()
'cpu'
>>> get_accelerator().device_name(0)
'cpu:0'
>>> get_accelerator().communication_backend_name()
'gloo'
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch

from slipstream.kernels import accelerator as _kernels_accelerator

__all__ = [
    "DeepSpeedAccelerator",
    "get_accelerator",
    "is_current_accelerator_supported",
    "set_accelerator",
]

_NO_OP_BUILDERS = (
    "DeepSpeed's op builders (create_op_builder, get_op_builder, build_extension) do not exist "
    "in Slipstream: its kernels are picked per device by slipstream.kernels.get_op(name, "
    "device_type) (the C++ CPU optimizers are built on first use); list them with "
    "`slipstream report`"
)


class DeepSpeedAccelerator:
    """DeepSpeed's accelerator interface over a Slipstream :class:`~slipstream.kernels.Accelerator`.

    Method names and meanings follow ``deepspeed.accelerator.abstract_accelerator``;
    ``slipstream`` holds the wrapped Slipstream accelerator for everything else.
    """

    def __init__(self, accelerator: _kernels_accelerator.Accelerator) -> None:
        self.slipstream = accelerator
        self._name = accelerator.device_type  # DeepSpeed's `_name`: "cuda" or "cpu"
        self._communication_backend_name = accelerator.communication_backend

    def _on_gpu(self) -> bool:
        return self.slipstream.device_type == "cuda"

    # -- devices -----------------------------------------------------------------------------
    def is_available(self) -> bool:
        """Whether this accelerator can run here (always true for the CPU)."""
        return torch.cuda.is_available() if self._on_gpu() else True

    def device_name(self, device_index: int | None = None) -> str:
        """``"cuda"``/``"cpu"``, or with an index ``"cuda:1"`` (DeepSpeed's meaning)."""
        if device_index is None:
            return self._name
        return f"{self._name}:{device_index}"

    def current_device_name(self) -> str:
        """The current device as a string: ``"cuda:<index>"`` on GPUs, ``"cpu"`` on the CPU."""
        if self._on_gpu():
            return f"{self._name}:{self.current_device()}"
        return self._name

    def device(self, device_index: int | None = None) -> torch.device:
        """The ``torch.device`` for ``device_index`` (DeepSpeed returns a device context on GPUs)."""
        return self.slipstream.device(device_index)

    def current_device(self) -> int:
        """The index of the current device."""
        return self.slipstream.current_device_index()

    def set_device(self, device_index: int) -> None:
        """Make ``device_index`` the current device."""
        self.slipstream.set_device(device_index)

    def device_count(self) -> int:
        """How many devices of this kind the process sees."""
        return self.slipstream.device_count()

    def synchronize(self, device_index: int | None = None) -> None:
        """Wait for the device's queued work."""
        self.slipstream.synchronize(device_index)

    def communication_backend_name(self) -> str:
        """The ``torch.distributed`` backend: ``"nccl"`` on GPUs (RCCL on ROCm), ``"gloo"`` on CPU."""
        return self._communication_backend_name

    def is_synchronized_device(self) -> bool:
        """True on the CPU, where work runs in program order (no streams)."""
        return not self._on_gpu()

    def use_host_timers(self) -> bool:
        """Whether timers must be read on the host (synchronized devices)."""
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        """Whether the device orders dependent work itself (synchronized devices)."""
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        """Whether the device throttles allocations itself (synchronized devices)."""
        return self.is_synchronized_device()

    # -- random number generators ------------------------------------------------------------
    def random(self) -> Any:
        """The ``torch.random`` module."""
        return torch.random

    def manual_seed(self, seed: int) -> None:
        """Seed the CPU generator and every device generator."""
        self.slipstream.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        """Seed every generator (the same as :meth:`manual_seed` here)."""
        self.slipstream.manual_seed(seed)

    def initial_seed(self) -> int:
        """The seed of the current device's generator (the CPU's on the CPU)."""
        return torch.cuda.initial_seed() if self._on_gpu() else torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        """The generator state of the device (a byte tensor, as torch gives it)."""
        if self._on_gpu():
            return torch.cuda.get_rng_state(device_index if device_index is not None else "cuda")
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        """Restore a state from :meth:`get_rng_state`."""
        if self._on_gpu():
            torch.cuda.set_rng_state(
                new_state, device_index if device_index is not None else "cuda"
            )
        else:
            torch.set_rng_state(new_state)

    def default_generator(self, device_index: int) -> torch.Generator:
        """The default generator of device ``device_index``."""
        if self._on_gpu():
            return torch.cuda.default_generators[device_index]
        return torch.default_generator

    # -- streams and events ------------------------------------------------------------------
    @property
    def Stream(self) -> type:
        """The stream class (``torch.cuda.Stream``; a no-op stream on the CPU)."""
        return self.slipstream.Stream

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Queue the work inside the block on ``stream``."""
        return self.slipstream.stream(stream)

    def current_stream(self, device_index: int | None = None) -> Any:
        """The stream work is queued on now."""
        return self.slipstream.current_stream()

    def default_stream(self, device_index: int | None = None) -> Any:
        """The device's default stream."""
        if self._on_gpu():
            return torch.cuda.default_stream(device_index)
        return self.slipstream.current_stream()

    @property
    def Event(self) -> Any:
        """The event class (``torch.cuda.Event``; ``torch.Event`` on the CPU)."""
        return torch.cuda.Event if self._on_gpu() else torch.Event

    # -- memory ------------------------------------------------------------------------------
    def empty_cache(self) -> None:
        """Return cached, unused device memory to the driver."""
        self.slipstream.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        """Bytes held by tensors (0 on the CPU)."""
        return self.slipstream.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """Peak of :meth:`memory_allocated` (0 on the CPU)."""
        return self.slipstream.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        """Restart the peak (all peak statistics, as torch does now)."""
        self.slipstream.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        """Bytes held by the caching allocator (0 on the CPU)."""
        return self.slipstream.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        """Peak of :meth:`memory_reserved` (0 on the CPU)."""
        if self._on_gpu():
            return int(torch.cuda.max_memory_reserved(device_index))
        return 0

    memory_cached = memory_reserved
    max_memory_cached = max_memory_reserved

    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        """Restart the peak statistics."""
        self.slipstream.reset_peak_memory_stats(device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        """Restart the peak statistics."""
        self.slipstream.reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        """The caching allocator's statistics (empty on the CPU)."""
        return dict(torch.cuda.memory_stats(device_index)) if self._on_gpu() else {}

    def total_memory(self, device_index: int | None = None) -> int:
        """The device's capacity in bytes (0 on the CPU)."""
        return self.slipstream.total_memory(device_index)

    def available_memory(self, device_index: int | None = None) -> int:
        """Free device memory in bytes, as the driver reports it (0 on the CPU)."""
        if self._on_gpu():
            return int(torch.cuda.mem_get_info(device_index)[0])
        return 0

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """``tensor`` in page-locked host memory where a GPU is present, else unchanged."""
        return tensor.pin_memory() if self._on_gpu() else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is in page-locked host memory."""
        return tensor.is_pinned() if self._on_gpu() else False

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on this accelerator's device type."""
        return tensor.device.type == self._name

    # -- precision ---------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        """Whether bfloat16 math is supported."""
        return self.slipstream.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        """Whether float16 math is supported."""
        return self.slipstream.is_fp16_supported()

    def supported_dtypes(self) -> list[torch.dtype]:
        """The usable training dtypes, float32 first."""
        return self.slipstream.supported_dtypes()

    def amp(self) -> Any:
        """``torch.amp``'s module for this device (``torch.cuda.amp`` on GPUs)."""
        return torch.cuda.amp if self._on_gpu() else torch.amp

    def is_triton_supported(self) -> bool:
        """Whether Triton kernels run here (GPUs with compute capability 8.0+, and ROCm)."""
        if not self._on_gpu() or not torch.cuda.is_available():
            return False
        return bool(torch.version.hip) or torch.cuda.get_device_capability()[0] >= 8

    # -- profiling ranges and lazy init ------------------------------------------------------
    def range_push(self, msg: str) -> None:
        """Open an NVTX range (a no-op on the CPU)."""
        if self._on_gpu():
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        """Close the innermost NVTX range (a no-op on the CPU)."""
        if self._on_gpu():
            torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: Callable[[], Any]) -> None:
        """Run ``callback`` once the device is initialised (at once on the CPU)."""
        if self._on_gpu():
            torch.cuda._lazy_call(callback)
        else:
            callback()

    # -- what Slipstream does not have -------------------------------------------------------
    def create_op_builder(self, class_name: str) -> Any:
        """Not available: see :func:`slipstream.kernels.get_op`."""
        raise NotImplementedError(f"get_accelerator().create_op_builder: {_NO_OP_BUILDERS}")

    def get_op_builder(self, class_name: str) -> Any:
        """Not available: see :func:`slipstream.kernels.get_op`."""
        raise NotImplementedError(f"get_accelerator().get_op_builder: {_NO_OP_BUILDERS}")

    def build_extension(self) -> Any:
        """Not available: see :func:`slipstream.kernels.get_op`."""
        raise NotImplementedError(f"get_accelerator().build_extension: {_NO_OP_BUILDERS}")

    def __repr__(self) -> str:
        return f"DeepSpeedAccelerator({self.slipstream!r})"


_lock = threading.Lock()
_adapter: DeepSpeedAccelerator | None = None


def get_accelerator() -> DeepSpeedAccelerator:
    """The process's accelerator with DeepSpeed's interface (detected once, as in DeepSpeed)."""
    global _adapter
    current = _kernels_accelerator.get_accelerator()
    with _lock:
        if _adapter is None or _adapter.slipstream is not current:
            _adapter = DeepSpeedAccelerator(current)
        return _adapter


def set_accelerator(accelerator: Any) -> None:
    """Pin the accelerator: a name (``"cuda"``, ``"rocm"``, ``"cpu"``), a Slipstream accelerator,
    or one returned by :func:`get_accelerator`."""
    if isinstance(accelerator, DeepSpeedAccelerator):
        accelerator = accelerator.slipstream
    _kernels_accelerator.set_accelerator(accelerator)


def is_current_accelerator_supported() -> bool:
    """True: Slipstream runs on every accelerator it detects (CUDA, ROCm, CPU)."""
    return True
