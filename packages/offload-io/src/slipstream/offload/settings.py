"""Offload settings as plain values: what the umbrella maps ``offload_optimizer``/``offload_param`` to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from slipstream.offload.aio.config import AioSettings

__all__ = ["OptimizerOffload", "ParamOffload"]

Device = Literal["cpu", "nvme"]


def _check_device(owner: str, device: str, nvme_path: str | None) -> None:
    if device not in ("cpu", "nvme"):
        raise ValueError(f"{owner}.device={device!r}: offload goes to 'cpu' or 'nvme'")
    if device == "nvme" and not nvme_path:
        raise ValueError(
            f"{owner}.device='nvme' needs nvme_path: a folder on a local NVMe drive where "
            "Slipstream may create its swap files"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerOffload:
    """Where the fp32 master weights and optimizer states live, and how the step runs.

    Attributes:
        device: ``"cpu"`` (pinned host memory) or ``"nvme"`` (swap files under ``nvme_path``,
            read into host buffers one sub-group at a time around its step).
        nvme_path: the folder for swap files (``device="nvme"``).
        pin_memory: page-lock the host buffers (faster, asynchronous transfers; costs
            non-swappable memory). Has an effect only where a GPU is present.
        buffer_count: NVMe: how many sub-groups' masters and states may be in host memory
            at once: the one stepping, the one read ahead (``pipeline_read``) and those still
            being written (``pipeline_write``, which overlaps only when this leaves room for
            at least one). Bounds host memory when the drive is slower than the step.
        pipeline_read: NVMe: read the next sub-group while the current one steps.
        pipeline_write: NVMe: write a stepped sub-group back while the next one steps.
        sub_group_numel: elements per sub-group of the step (``zero_optimization.sub_group_size``):
            the unit of NVMe swapping and of the step/upload pipeline.
        cores_fraction: share of this rank's cores the step uses (``cpuadam_cores_perc``).
        convert_grad_on_cpu: accepted for DeepSpeed configs; not used: reduced gradients
            reach the host in the communication dtype (fp32 unless communication_data_type
            says otherwise) and land in fp32 buffers.
        aio: the ``aio`` block's settings for the NVMe engine (None: its defaults).
        overlap_step: CPU, ZeRO 1-2: step each gradient bucket's masters as soon as the bucket
            reaches the host, during the rest of backward. Exact only when the update does
            not depend on the global gradient norm: no clipping, no fp16 loss scaling (the
            umbrella turns it on exactly then).
        speculative_step: CPU, ZeRO 1-2, for updates that do depend on the norm (gradient
            clipping, fp16 loss scaling): step each bucket during backward as
            ``overlap_step`` does, but out of place, as if the clip coefficient were 1 and
            nothing overflowed (the fp16 unscale applied); keep that step when the global
            norm says so (it is then exactly the step), else discard it and step (or, on an
            overflow, skip) after backward. Needs the C++ Adam/AdamW and 12 spare bytes of
            host memory per parameter.
        ratio: the share of the optimizer's elements (masters, their gradients and states)
            that is offloaded (``offload_optimizer.ratio``, DeepSpeed's partial offload); the
            rest stays on the GPU and steps there, with the GPU's optimizer, after backward.
            The parameters kept on the GPU are the model's first ones (in parameter order):
            their gradients are the last to arrive in backward, so the CPU no longer steps
            them after it. 1.0 (the default) offloads everything. Not with ``device="nvme"``.
        threads: OpenMP threads of the CPU step in this process; 0 (the default) chooses
            from the cores this rank may use and ``cores_fraction`` (see
            :func:`slipstream.offload.choose_threads`).
        cpu_schedule: how those threads share a step's elements: ``"static"`` (one
            contiguous share each) or ``"dynamic"`` (16 Ki-element chunks handed out in
            turn; better when other threads of the process share the cores).
        cpu_stores: how the C++ Adam/AdamW step writes its results (the same values, bit for
            bit, whatever is chosen): ``"stream_out"`` (the default: an out-of-place step,
            the speculative one, writes with full-line non-temporal stores, 512 elements at a
            time through L1 buffers; an in-place step with ordinary stores), ``"mixed"`` (the
            earlier kernel: out of place with 16-byte non-temporal stores) or ``"stream"``
            (non-temporal stores in place too).
        cpu_prefetch: where the step streams (see ``cpu_stores``), software-prefetch each block's inputs
            this many elements ahead (0: the hardware prefetchers only).
        early_upload: ZeRO 1-2 with ``overlap_forward`` on a GPU: upload each deferred
            bucket's updated shards on a side stream as soon as its CPU step ends, instead
            of from the forward hook that needs them.
        overlap_bucket_numel: ZeRO 1-2 stepping during backward (``overlap_step`` or
            ``speculative_step``): the reduce buckets hold at most this many elements (the
            smaller of it and ``reduce_bucket_size``), so the CPU starts stepping early.
        gpu_share: CPU, ZeRO 1-2, Adam/AdamW on the C++ step, with a GPU: the share of each
            step's elements that is stepped on the GPU instead of by the CPU cores, at the
            same time as the rest: their masters and states stay in host memory and are
            copied to the GPU and back chunk by chunk by its copy engines
            (:class:`slipstream.offload.gpu_stream.StreamedAdam`). 0.0 (the default): the
            CPU steps everything. The states are then allocated like the masters (pinned).
        upload_model_dtype: CPU, ZeRO 1-2 with a 16-bit model: the CPU step also writes each
            updated master in the model's dtype into a pinned staging buffer, and the
            all-gather uploads that (2 bytes per element instead of the fp32 master's 4).
        merge_bucket_numel: CPU, ZeRO 1-2 stepping during backward: when the CPU step's
            worker is behind the gradients, the buckets that have landed and would be stepped
            next are stepped with the current one in one C++ call, up to this many elements
            per call (fewer calls: fewer OpenMP wake-ups and returns to Python per step; the
            same update). 0: one call per bucket.
        gil_switch_interval_us: CPU, ZeRO 1-2 stepping during backward: while the CPU
            step's worker thread runs, Python's switch interval (``sys.setswitchinterval``)
            in microseconds: how long the worker, which needs the GIL around every bucket's
            C++ step, waits before the thread running the forward or backward is asked to
            let it have it (Python's default is 5000). 0 (the default) leaves the
            interpreter's setting.
    """

    device: Device = "cpu"
    nvme_path: str | None = None
    pin_memory: bool = False
    buffer_count: int = 4
    pipeline_read: bool = False
    pipeline_write: bool = False
    sub_group_numel: int = 1_000_000_000
    cores_fraction: float = 0.8
    convert_grad_on_cpu: bool = True
    aio: AioSettings | None = None
    overlap_step: bool = False
    speculative_step: bool = False
    ratio: float = 1.0
    threads: int = 0
    cpu_schedule: Literal["static", "dynamic"] = "dynamic"
    cpu_stores: Literal["stream_out", "mixed", "stream"] = "stream_out"
    cpu_prefetch: int = 0
    early_upload: bool = True
    overlap_bucket_numel: int = 100_000_000
    gpu_share: float = 0.0
    gil_switch_interval_us: float = 0.0
    merge_bucket_numel: int = 0
    upload_model_dtype: bool = False

    def __post_init__(self) -> None:
        if self.merge_bucket_numel < 0:
            raise ValueError(
                f"offload_optimizer.merge_bucket_size={self.merge_bucket_numel} must be >= 0 "
                "(0: one C++ call per bucket)"
            )
        if not self.gil_switch_interval_us >= 0.0:
            raise ValueError(
                f"offload_optimizer.gil_switch_interval_us={self.gil_switch_interval_us} must "
                "be >= 0 (0: leave Python's switch interval as it is)"
            )
        _check_device("offload_optimizer", self.device, self.nvme_path)
        if not 0.0 <= self.gpu_share <= 1.0:
            raise ValueError(f"offload_optimizer.gpu_share={self.gpu_share} must be in [0, 1]")
        if self.gpu_share > 0 and self.device != "cpu":
            raise ValueError(
                f"offload_optimizer.gpu_share={self.gpu_share} needs device='cpu' (NVMe "
                "offload swaps the states one sub-group at a time); set it to 0"
            )
        if self.threads < 0:
            raise ValueError(
                f"offload_optimizer.threads={self.threads} must be >= 0 (0: chosen from the cores)"
            )
        if self.cpu_schedule not in ("static", "dynamic"):
            raise ValueError(
                f"offload_optimizer.cpu_schedule={self.cpu_schedule!r}: use 'static' or 'dynamic'"
            )
        if self.cpu_stores not in ("stream_out", "mixed", "stream"):
            raise ValueError(
                f"offload_optimizer.cpu_stores={self.cpu_stores!r}: use 'stream_out', 'mixed' "
                "or 'stream'"
            )
        if self.cpu_prefetch < 0:
            raise ValueError(
                f"offload_optimizer.cpu_prefetch={self.cpu_prefetch} must be >= 0 elements (0: off)"
            )
        if self.overlap_bucket_numel < 1:
            raise ValueError(
                f"offload_optimizer.overlap_bucket_size={self.overlap_bucket_numel} must be >= 1"
            )
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"offload_optimizer.ratio={self.ratio} must be in [0, 1]")
        if self.ratio < 1.0 and self.device != "cpu":
            raise ValueError(
                f"offload_optimizer.ratio={self.ratio} (partial offload) needs device='cpu'; "
                "NVMe offload swaps every state (set ratio to 1.0)"
            )
        for name in ("overlap_step", "speculative_step", "upload_model_dtype"):
            if getattr(self, name) and self.device != "cpu":
                raise ValueError(
                    f"offload_optimizer {name} needs device='cpu' (NVMe steps whole sub-groups)"
                )
        if self.overlap_step and self.speculative_step:
            raise ValueError(
                "offload_optimizer: choose overlap_step (exact without clipping) or "
                "speculative_step (with clipping), not both"
            )
        if self.buffer_count < 1:
            raise ValueError(f"offload_optimizer.buffer_count={self.buffer_count} must be >= 1")
        if self.sub_group_numel < 1:
            raise ValueError(f"sub_group_size={self.sub_group_numel} must be >= 1")
        if not 0.0 < self.cores_fraction <= 1.0:
            raise ValueError(
                f"offload_optimizer.cpuadam_cores_perc={self.cores_fraction} must be in (0, 1]"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamOffload:
    """Where ZeRO-3's parameter shards live between uses.

    Attributes:
        device: ``"cpu"`` (host memory; copied to the device before each all-gather) or
            ``"nvme"`` (swap files; read into host buffers ahead of use).
        nvme_path: the folder for swap files (``device="nvme"``).
        pin_memory: page-lock the host copies (asynchronous uploads).
        buffer_count: NVMe: host buffers for shards in flight between disk and device.
        buffer_size: NVMe: elements per such buffer (a shard larger than this is read in
            one piece anyway; the setting bounds what is prefetched).
        max_in_cpu: NVMe: parameter elements kept resident in host memory (a cache in front
            of the swap files); the rest are read from disk on use.
        aio: the ``aio`` block's settings (None: defaults).
    """

    device: Device = "cpu"
    nvme_path: str | None = None
    pin_memory: bool = False
    buffer_count: int = 5
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000
    aio: AioSettings | None = None

    def __post_init__(self) -> None:
        _check_device("offload_param", self.device, self.nvme_path)
        for name in ("buffer_count", "buffer_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"offload_param.{name}={getattr(self, name)} must be >= 1")
        if self.max_in_cpu < 0:
            raise ValueError(f"offload_param.max_in_cpu={self.max_in_cpu} must be >= 0")
