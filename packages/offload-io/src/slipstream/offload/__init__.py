"""The memory tiers below the GPU: ZeRO-Offload (CPU) and ZeRO-Infinity (NVMe).

- :class:`HostOptimizer`: a torch optimizer's update run on the CPU by the C++ kernels of
  slipstream.kernels, sub-group by sub-group, with the low-precision copies written in the
  same pass.
- :class:`NvmeStateSwapper`: fp32 masters and optimizer states in swap files between steps.
- :class:`ParamSwapStore`: ZeRO-3 parameter shards in swap files between uses.
- :class:`AsyncIOEngine`, :class:`SwapSpace`, :class:`PinnedBufferPool`: asynchronous direct
  I/O of tensors to NVMe, checked swap files, aligned (pinned) host buffers.
- ``python -m slipstream.offload.io_bench``: the engine's GB/s against the raw device.

slipstream.zero uses these when ``ZeroSettings.offload_optimizer``/``offload_param`` are set
(``pip install slipstream-zero[offload]``); ``slipstream.initialize`` sets them from the
DeepSpeed ``offload_optimizer``/``offload_param`` and ``aio`` blocks. See docs/offload.md.
"""

from __future__ import annotations

from slipstream.offload.aio import AioSettings, AsyncIOEngine, IORequest
from slipstream.offload.aio.errors import (
    DirectIOUnsupportedError,
    DiskFullError,
    OffloadIOError,
    SwapFileCorruptError,
    SwapPathError,
)
from slipstream.offload.host_optimizer import HostOptimizer, kernel_for, step_subset
from slipstream.offload.nvme import NvmeStateSwapper
from slipstream.offload.param_swap import ParamSwapStore
from slipstream.offload.pinned import PinnedBufferPool, aligned_empty
from slipstream.offload.settings import OptimizerOffload, ParamOffload
from slipstream.offload.swap import SwapSpace
from slipstream.offload.threads import ThreadChoice, choose_threads

__all__ = [
    "AioSettings",
    "AsyncIOEngine",
    "DirectIOUnsupportedError",
    "DiskFullError",
    "HostOptimizer",
    "IORequest",
    "NvmeStateSwapper",
    "OffloadIOError",
    "OptimizerOffload",
    "ParamOffload",
    "ParamSwapStore",
    "PinnedBufferPool",
    "SwapFileCorruptError",
    "SwapPathError",
    "SwapSpace",
    "ThreadChoice",
    "aligned_empty",
    "choose_threads",
    "kernel_for",
    "step_subset",
]
