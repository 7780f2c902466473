"""ZeroSettings: the knobs of ZeRO sharding, as plain values (the umbrella maps its config to it)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from slipstream.offload.settings import OptimizerOffload, ParamOffload

__all__ = ["DEFAULT_TAIL_NUMEL", "ZeroSettings", "stage3_reduce_bucket_numel"]

# reduce_bucket_tail_numel's default with the masters on the device: at 1.3B on 2 H200s the
# split last bucket (with the other opt-in keys of the time) took the step from 1.023x to
# 1.047x FSDP2's rate (docs/benchmarks.md, 2026-11-26); the results are the same.
DEFAULT_TAIL_NUMEL = 50_000_000


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroSettings:
    """How ZeRO shards and communicates; DeepSpeed's ``zero_optimization`` keys, in elements.

    Attributes:
        stage: 1 (optimizer states), 2 (+ gradients) or 3 (+ parameters).
        reduce_bucket_numel: elements per gradient reduce-scatter bucket.
        stage3_reduce_bucket_parts: stage 3: cap each reduce-scatter bucket at 1/parts of the
            model's trainable elements (never below its largest parameter), so the two live
            buckets' send buffers stay a small share of the model states whatever
            ``reduce_bucket_numel`` says; 0: no cap. See docs/zero.md, "Bucket sizes".
        allgather_bucket_numel: elements per all-gather of updated shards (stages 1-2).
        reduce_bucket_tail_numel: stages 1-2: the last reduce-scatter bucket of a backward (the
            first parameters, whose gradients come last) is split into buckets of at most
            this many elements, so the reduction left after backward is short; 0: no split;
            None (the default): :data:`DEFAULT_TAIL_NUMEL` with the masters on the device,
            no split with optimizer offload (its buckets follow ``offload_optimizer``).
        publish_transport: stages 1-2: how the updated shards reach the other ranks after a
            step. ``"collective"``: all-gathers. ``"copy_engine"``: the parameters live in a
            symmetric-memory buffer and each rank pulls the others' shards with peer copies
            (the GPUs' copy engines over NVLink, no SMs; one node, NCCL, CUDA); falls back to
            ``"collective"`` elsewhere (CPU, gloo, several hosts, optimizer offload), saying
            why at info level. ``"auto"`` (the default): ``"copy_engine"`` where it works and
            the instance publishes on its own (not one of several sharing an optimizer, as
            expert parallelism builds), ``"collective"`` elsewhere (why at debug level).
        reduce_scatter_max_ctas: stages 1-2: at most this many CTAs (SMs) for the gradient
            reduce-scatters, which overlap backward's matmuls: they run on a communicator of
            their own created with NCCL's ``maxCTAs`` (NCCL, the group of every rank only;
            elsewhere the group's own communicator); 0: NCCL's choice.
        average_in_reduce_scatter: stages 1-2: average the gradients inside the NCCL
            reduce-scatter (``ReduceOp.AVG``) instead of a pass over each landed bucket
            afterwards; only where it is exact (NCCL, a power-of-two group, no
            ``gradient_predivide_factor``/``prescale_gradients``, the mean over the group
            itself); elsewhere the pass after. On by default (the results are the same).
        overlap_comm: launch gradient reduce-scatters during backward as buckets fill (stage
            2-3) instead of all at once after it.
        prefetch_numel: stage 3: elements of upcoming modules' parameters gathered ahead.
        max_live_numel: stage 3: prefetch stops while more gathered elements than this are live.
        max_reuse_numel: stage 3: a module's parameters stay gathered after its forward when
            the recorded trace calls it again before this many other elements are gathered.
        param_persistence_numel: stage 3: parameters this small stay gathered between modules
            (until the next optimizer step).
        model_persistence_numel: stage 3: at most this many elements in all persist.
        communication_dtype: dtype of gradient reductions (None: the fp32 master-grad dtype).
        gradient_predivide_factor: divide by this before the reduction and by
            ``world_size / factor`` after (DeepSpeed's overflow guard for fp16).
        prescale_gradients: divide by the world size before the reduction instead.
        offload_optimizer: ZeRO-Offload / ZeRO-Infinity: fp32 masters, gradients and optimizer
            states in host memory (or on NVMe) and the step on the CPU (needs
            slipstream-offload-io; see slipstream.zero.offload).
        offload_param: stage 3: parameter shards in host memory (or on NVMe) between uses.
        leaf_module_classes / leaf_module_names / leaf_module_name_suffixes: stage 3: modules
            (by class name or ``module.QualName``, by name in ``named_modules()``, by name
            suffix) whose whole subtree is one unit: one all-gather around the module's
            forward and backward instead of one per submodule holding parameters
            (DeepSpeed's ``leaf_module``).
    """

    stage: int
    reduce_bucket_numel: int = 500_000_000
    stage3_reduce_bucket_parts: int = 64
    allgather_bucket_numel: int = 500_000_000
    reduce_bucket_tail_numel: int | None = None
    publish_transport: Literal["auto", "collective", "copy_engine"] = "auto"
    reduce_scatter_max_ctas: int = 0
    average_in_reduce_scatter: bool = True
    overlap_comm: bool = True
    prefetch_numel: int = 50_000_000
    max_live_numel: int = 1_000_000_000
    max_reuse_numel: int = 1_000_000_000
    param_persistence_numel: int = 100_000
    model_persistence_numel: int = sys.maxsize
    communication_dtype: torch.dtype | None = None
    gradient_predivide_factor: float = 1.0
    prescale_gradients: bool = False
    offload_optimizer: OptimizerOffload | None = None
    offload_param: ParamOffload | None = None
    leaf_module_classes: tuple[str, ...] = ()
    leaf_module_names: tuple[str, ...] = ()
    leaf_module_name_suffixes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.stage not in (1, 2, 3):
            raise ValueError(
                f"ZeroSettings.stage={self.stage!r}: slipstream.zero shards at stages 1, 2 or 3; "
                "stage 0 is plain data parallelism (no slipstream.zero needed)"
            )
        for name in ("reduce_bucket_numel", "allgather_bucket_numel"):
            if getattr(self, name) < 1:
                raise ValueError(f"ZeroSettings.{name}={getattr(self, name)!r} must be >= 1")
        if self.reduce_bucket_tail_numel is not None and self.reduce_bucket_tail_numel < 0:
            raise ValueError(
                f"ZeroSettings.reduce_bucket_tail_numel={self.reduce_bucket_tail_numel!r} "
                "must be >= 0 (0: no split)"
            )
        if not 0 <= self.reduce_scatter_max_ctas <= 64:
            raise ValueError(
                f"ZeroSettings.reduce_scatter_max_ctas={self.reduce_scatter_max_ctas!r} must be "
                "between 0 (NCCL's choice) and 64"
            )
        if self.publish_transport not in ("auto", "collective", "copy_engine"):
            raise ValueError(
                f"ZeroSettings.publish_transport={self.publish_transport!r}: expected "
                "'auto', 'collective' or 'copy_engine'"
            )
        if self.stage3_reduce_bucket_parts < 0:
            raise ValueError(
                "ZeroSettings.stage3_reduce_bucket_parts="
                f"{self.stage3_reduce_bucket_parts!r} must be >= 0 (0: no cap)"
            )
        if self.offload_param is not None and self.stage != 3:
            raise ValueError(
                f"offload_param needs ZeRO stage 3 (parameters are sharded only there), got "
                f"stage {self.stage}; use offload_optimizer at stages 1-2"
            )
        if self.gradient_predivide_factor <= 0:
            raise ValueError(
                f"ZeroSettings.gradient_predivide_factor={self.gradient_predivide_factor!r} "
                "must be > 0"
            )

    def tail_numel(self, *, offloaded: bool) -> int:
        """The split of the last reduce-scatter bucket that applies (0: none), resolving
        ``reduce_bucket_tail_numel=None``."""
        if self.reduce_bucket_tail_numel is not None:
            return self.reduce_bucket_tail_numel
        return 0 if offloaded else DEFAULT_TAIL_NUMEL


def stage3_reduce_bucket_numel(settings: ZeroSettings, numels: list[int]) -> int:
    """Stage 3's reduce-scatter bucket for trainable parameters of ``numels`` elements:
    ``reduce_bucket_numel``, capped at ``max(largest, total // stage3_reduce_bucket_parts)``.

    [Note: stage-3 bucket size] Two buckets' send buffers are live at once (one in flight,
    one filling), ``4 * bucket`` bytes each in the default fp32 reduction. At DeepSpeed's 5e8
    that is 3.7 GiB, more than the margin between ZeRO-3's and FSDP2's peak at 7B on 2 ranks
    (docs/benchmarks.md, 2026-11-25: 60.13 vs 58.88 GiB; 58.13 GiB with 1e8). FSDP2 reduces
    one block's gradients at a time; 1/64 of the model (1.05e8 elements at 7B) is about two
    blocks of a 32-layer model, and keeps every collective large enough to run at bandwidth.
    """
    bucket = settings.reduce_bucket_numel
    if settings.stage3_reduce_bucket_parts > 0 and numels:
        cap = max(max(numels), sum(numels) // settings.stage3_reduce_bucket_parts)
        bucket = min(bucket, cap)
    return max(1, bucket)
