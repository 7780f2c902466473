"""ZeRO-Offload and ZeRO-Infinity for the optimizer: the step on the CPU, states in RAM or on NVMe.

Optional: needs the slipstream-offload-io distribution (``pip install slipstream-zero[offload]``),
imported only when ``ZeroSettings.offload_optimizer`` is set. The stage's master shards (and
their gradients) then live in host memory (:class:`~slipstream.zero.ShardedMasterWeights` with
``device="cpu"``); :class:`OffloadedStep` runs the update there with the C++ CPU optimizers,
writing the model-dtype copy of each updated shard into a (pinned) staging buffer in the same
pass, from which the stage publishes it to the device.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch

from slipstream.zero.group import DataParallelGroup
from slipstream.zero.masters import ShardedMasterWeights

if TYPE_CHECKING:
    from slipstream.offload.settings import OptimizerOffload

__all__ = ["OVERLAP_BUCKET_NUMEL", "OffloadedStep", "require_offload_package"]

logger = logging.getLogger(__name__)

# With overlap_step, gradient buckets are at most this many elements (whatever
# reduce_bucket_size says): a bucket's CPU step can start only once the whole bucket has
# landed, so smaller buckets start the CPU sooner in backward and leave less after it.
OVERLAP_BUCKET_NUMEL = 100_000_000

_SubGroupHook = Callable[[list[torch.Tensor]], None]


def require_offload_package(what: str) -> Any:
    """Import slipstream.offload, or say which distribution ``what`` needs."""
    try:
        import slipstream.offload as offload
    except ImportError as exc:
        raise ImportError(
            f"{what} needs the slipstream-offload-io package: pip install "
            f"'slipstream-zero[offload]' (or slipstream-offload-io) ({exc})"
        ) from exc
    return offload


class OffloadedStep:
    """The CPU step of a ZeRO stage whose masters are in host memory.

    Args:
        optimizer: the torch optimizer, already re-homed onto ``masters`` (host fp32).
        masters: the host master shards.
        offload: the offload settings (``device``, ``nvme_path``, sub-groups, threads, aio).
        group: the data-parallel group (its rank names this rank's swap folder).
        copies: ``id(master) -> tensor`` refreshed with each updated master in the model dtype
            (host staging buffers, or the shard itself when it lives on the host too).
        names: parameter names by ``id(master)`` (NVMe swap file names).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        masters: ShardedMasterWeights,
        offload: OptimizerOffload,
        group: DataParallelGroup,
        copies: dict[int, torch.Tensor],
        names: dict[int, str] | None = None,
    ) -> None:
        package = require_offload_package("offload_optimizer")
        self.masters = masters
        self.offload = offload
        self._pool: ThreadPoolExecutor | None = None
        self._eager_steps = 0
        # (before, after) each sub-group's update: stage 3 with NVMe parameters reads the
        # sub-group's shards (the step's copy targets) in before and writes them back after.
        self.sub_group_hooks: tuple[_SubGroupHook | None, _SubGroupHook | None] | None = None
        self.swapper: Any = None
        self.space: Any = None
        if offload.device == "nvme":
            assert offload.nvme_path is not None  # OptimizerOffload checks
            engine = package.AsyncIOEngine(offload.aio)
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            self.space = package.SwapSpace(offload.nvme_path, engine, name="optimizer", rank=rank)
            self.swapper = package.NvmeStateSwapper(optimizer, self.space, offload, names)
        self.host = package.HostOptimizer(
            optimizer, offload, copies=copies, swapper=self.swapper, announce=group.rank == 0
        )
        if self.swapper is not None:
            # Adam/AdamW keep 2 states per parameter, Lion and Adagrad 1; another optimizer
            # (its own step on the host) is assumed to keep 2, like Adam.
            states = {"adam": 2, "lion": 1, "adagrad": 1}.get(self.host.kernel or "", 2)
            ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
            self.swapper.check_room(states, ranks_sharing=ranks)
            self.swapper.evict_all()
            if group.rank == 0:
                logger.info(
                    "optimizer offload to NVMe: swap files in %s (%d sub-group(s), aio backend %s)",
                    self.space.path,
                    len(self.host.sub_groups),
                    engine.backend_name,
                )

    # ------------------------------------------------------------------ eager (overlapped) steps
    @property
    def eager(self) -> bool:
        """Whether buckets are stepped during backward (``overlap_step``)."""
        return self.offload.overlap_step

    def submit(self, run: Callable[[], None]) -> Future[None]:
        """Queue ``run`` (a landed bucket's hand-over and step) on the CPU step's worker."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slipstream-cpu-step")
        self._eager_steps += 1
        return self._pool.submit(run)

    def step_indices(self, indices: list[int], grad_scale: float = 1.0) -> None:
        """Step the masters at ``indices`` now (``grad_scale`` folded into the gradients)."""
        self.host.step_params([self.masters.masters[i] for i in indices], grad_scale)

    def take_eager_steps(self) -> int:
        """How many bucket steps ran since the last call (the reducer waited for them)."""
        count, self._eager_steps = self._eager_steps, 0
        return count

    def step(self, grad_scale: float) -> None:
        """Run the update over every master with a gradient (``grad_scale`` folded in).

        ``sub_group_hooks`` (set by the stage), if any, run around each sub-group: the first
        before its update, the second after it.
        """
        before, after = self.sub_group_hooks or (None, None)
        self.host.step(grad_scale=grad_scale, on_sub_group=after, before_sub_group=before)

    def resident(self) -> Any:
        """A context in which every master and state is in host memory (checkpoints)."""
        return self.swapper.resident() if self.swapper is not None else nullcontext()

    def close(self) -> None:
        """Stop the worker; remove the swap files (also done at exit)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self.space is not None:
            self.space.close()
