"""ZeRO-Offload and ZeRO-Infinity for the optimizer: the step on the CPU, states in RAM or on NVMe.

Optional: needs the slipstream-offload-io distribution (``pip install slipstream-zero[offload]``),
imported only when ``ZeroSettings.offload_optimizer`` is set. The stage's master shards (and
their gradients) then live in host memory (:class:`~slipstream.zero.ShardedMasterWeights` with
``device="cpu"``); :class:`OffloadedStep` runs the update there with the C++ CPU optimizers.
On the CPU the stages publish the updated fp32 masters themselves (cast on the device); with
NVMe the step also writes the model-dtype copy of each updated shard into a (pinned) staging
buffer in the same pass, from which the stage publishes it, and with ``offload_param`` into the
host shard itself.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from slipstream.zero.group import DataParallelGroup
from slipstream.zero.masters import ShardedMasterWeights
from slipstream.zero.norms import unscale_factor

if TYPE_CHECKING:
    from slipstream.offload.settings import OptimizerOffload

__all__ = [
    "BucketPart",
    "OffloadedStep",
    "SpeculationStats",
    "offloaded_flags",
    "require_offload_package",
]

logger = logging.getLogger(__name__)


# Speculation is not tried when its spare buffers would take more than this share of the
# host memory that is available when the engine is built.
SPARE_MEMORY_SHARE = 0.5


def _available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _ranks_on_this_host() -> int:
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))


class SpeculationStats:
    """Kept and discarded speculative steps, and the back-off after discards.

    Two discards in a row pause speculation for 1 step, the next time for 2, then 4, ... up to
    64 (a run whose norm stays above the clip, e.g. early in training, stops paying for
    steps it throws away); a kept step resets the back-off.
    """

    MAX_PAUSE = 64

    def __init__(self) -> None:
        self.kept = 0
        self.discarded = 0
        self.cancelled = 0  # of the discarded: called off at the end of backward
        self.paused = 0  # steps taken without speculating
        self._streak = 0
        self._pause_left = 0
        self._next_pause = 1

    def try_now(self) -> bool:
        """Whether to speculate on this step (counts a paused step)."""
        if self._pause_left > 0:
            self._pause_left -= 1
            self.paused += 1
            return False
        return True

    def record(self, kept: bool, cancelled: bool = False) -> None:
        """Count a settled speculative step and update the back-off."""
        self.cancelled += cancelled
        if kept:
            self.kept += 1
            self._streak = 0
            self._next_pause = 1
            return
        self.discarded += 1
        self._streak += 1
        if self._streak >= 2:
            self._pause_left = self._next_pause
            self._next_pause = min(2 * self._next_pause, self.MAX_PAUSE)
            self._streak = 0

    def __repr__(self) -> str:
        return (
            f"SpeculationStats(kept={self.kept}, discarded={self.discarded} "
            f"(called off early: {self.cancelled}), paused={self.paused})"
        )


_SubGroupHook = Callable[[list[torch.Tensor]], None]


class _StagingFailed:
    """What a tail job's staged upload raised, re-raised where the job is published."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


@dataclass(frozen=True, slots=True)
class BucketPart:
    """A bucket's CPU step as a job that can share one C++ call with other buckets' jobs.

    ``prepare()`` makes the bucket ready to step (waits for its copy to the host, hands it to
    the master gradients); ``step(indices)`` steps the masters at ``indices``. Jobs whose
    ``step`` is the same run as ``prepare()`` of each, then one ``step`` over all their
    indices: the same update, element by element, as one call per bucket (the C++ step treats
    every parameter on its own), with one OpenMP region and one return to Python.
    """

    prepare: Callable[[], None]
    step: Callable[[list[int]], None]
    indices: list[int]
    numel: int


_Job = tuple[Callable[[], None], Future[None], Callable[[], bool] | None, BucketPart | None]


class StepWorker:
    """The thread that runs the CPU step's jobs (a landed bucket's hand-over and step), one at
    a time: oldest first, or newest *landed* first while ``lifo`` is set.

    Newest first serves ``overlap_forward`` once backward has ended: backward lands the last
    layers' buckets first and the next forward needs the first layers' first, which are the
    newest then. But "backward has ended" is the host's view: the GPU is often still running
    it, and the newest bucket is the last to reach the host. A job submitted with ``ready``
    (its bucket's copy to the host is done) is taken newest first only once ready; while no
    queued job is ready, the oldest is taken, the one that lands first, so the worker never
    waits for one bucket while another has arrived.

    ``merge_numel`` > 0 (``offload_optimizer.merge_bucket_size``): a job submitted with a
    :class:`BucketPart` takes with it the jobs that would be taken next, in the same order,
    while they have landed, share its ``step`` and keep the elements within ``merge_numel``:
    when the worker is behind the gradients, consecutive buckets step in one C++ call.
    """

    def __init__(
        self, lifo: bool = False, switch_interval_s: float = 0.0, merge_numel: int = 0
    ) -> None:
        self.lifo = lifo
        self.merge_numel = merge_numel
        # offload_optimizer.gil_switch_interval_us: Python's switch interval while the thread
        # runs (0: left alone), and the one it replaced (restored at shutdown).
        self.switch_interval_s = switch_interval_s
        self._previous_switch: float | None = None
        self._jobs: deque[_Job] = deque()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.busy_s = 0.0  # seconds spent running jobs (benchmarks read it)
        self.calls = 0  # how many times the worker ran jobs (merged ones count once)
        # Stop the thread before the interpreter (and the OpenMP runtime) shuts down.
        atexit.register(_shutdown_if_alive, weakref.ref(self))

    def submit(
        self,
        run: Callable[[], None],
        ready: Callable[[], bool] | None = None,
        part: BucketPart | None = None,
    ) -> Future[None]:
        """Queue ``run``; its Future re-raises what it raised. ``ready`` (optional) says
        whether ``run`` can start without waiting (see the class docstring); ``part``
        (optional) is ``run`` in pieces, so that it can share a call with other jobs."""
        future: Future[None] = Future()
        with self._wake:
            if self._closed:
                raise RuntimeError("the CPU optimizer step's worker was shut down")
            self._jobs.append((run, future, ready, part))
            if self._thread is None:
                if self.switch_interval_s > 0:
                    self._previous_switch = sys.getswitchinterval()
                    sys.setswitchinterval(self.switch_interval_s)
                self._thread = threading.Thread(
                    target=self._loop, name="slipstream-cpu-step", daemon=True
                )
                self._thread.start()
            self._wake.notify()
        return future

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._jobs and not self._closed:
                    self._wake.wait()
                if not self._jobs:
                    return  # shut down, nothing left
                batch = self._take()
            live = [job for job in batch if job[1].set_running_or_notify_cancel()]
            if not live:
                continue
            began = time.perf_counter()
            try:
                self._execute(live)
            finally:
                self.busy_s += time.perf_counter() - began
                self.calls += 1

    @staticmethod
    def _execute(batch: list[_Job]) -> None:
        """Run one job, or merged ones (each one's ``prepare``, then one ``step``); what it
        raised goes to every Future of the batch."""
        try:
            if len(batch) == 1:
                batch[0][0]()
            else:
                parts = [job[3] for job in batch]
                for part in parts:
                    assert part is not None
                    part.prepare()
                first = parts[0]
                assert first is not None
                first.step([i for part in parts if part is not None for i in part.indices])
        except BaseException as exc:  # handed to whoever waits on the Futures
            for job in batch:
                job[1].set_exception(exc)
        else:
            for job in batch:
                job[1].set_result(None)

    def _position(self, landed_only: bool) -> int | None:
        """Where the next job is in the queue (the lock is held): see the class docstring.
        ``landed_only``: only a job that is ready (a merge never waits)."""
        if self.lifo or landed_only:
            order = range(len(self._jobs) - 1, -1, -1) if self.lifo else range(len(self._jobs))
            for position in order:
                ready = self._jobs[position][2]
                if ready is None or ready():
                    return position
                if not self.lifo:
                    return None  # oldest first: the next one has not landed
            if landed_only:
                return None
        return 0

    def _take(self) -> list[_Job]:
        """The next job, and the jobs merged with it (the lock is held)."""
        position = self._position(landed_only=False)
        assert position is not None
        job = self._jobs[position]
        del self._jobs[position]
        batch = [job]
        part = job[3]
        if part is None or self.merge_numel <= 0:
            return batch
        total = part.numel
        while self._jobs:
            position = self._position(landed_only=True)
            if position is None:
                break
            other = self._jobs[position][3]
            if other is None or other.step != part.step or total + other.numel > self.merge_numel:
                break
            batch.append(self._jobs[position])
            del self._jobs[position]
            total += other.numel
        return batch

    def is_worker_thread(self) -> bool:
        """Whether the calling thread is this worker's."""
        return self._thread is not None and threading.current_thread() is self._thread

    def shutdown(self) -> None:
        """Run what is queued, then stop the thread."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
        previous, self._previous_switch = self._previous_switch, None
        # Put Python's interval back unless someone else changed it since.
        if previous is not None and abs(sys.getswitchinterval() - self.switch_interval_s) < 1e-6:
            sys.setswitchinterval(previous)


def _shutdown_if_alive(worker: weakref.ref[StepWorker]) -> None:
    alive = worker()
    if alive is not None:
        alive.shutdown()


def offloaded_flags(numels: Sequence[int], ratio: float) -> list[bool]:
    """Partial offload (``offload_optimizer.ratio``): per parameter, whether its master and
    optimizer states go to the host.

    The longest run of leading parameters (in parameter order) whose elements fit in
    ``1 - ratio`` of the total stays on the device: in backward their gradients arrive last,
    so stepping them on the GPU removes the tail of the CPU step that nothing overlaps.
    Every rank gets the same flags (shard sizes are the same on every rank).
    """
    if ratio >= 1.0:
        return [True] * len(numels)
    keep = (1.0 - ratio) * sum(numels)
    flags: list[bool] = []
    kept = 0
    for numel in numels:
        stays = (not flags or not flags[-1]) and kept + numel <= keep
        kept += numel if stays else 0
        flags.append(not stays)
    return flags


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
            (host staging buffers, or the shard itself when it lives on the host too); empty
            when the stage publishes the masters themselves.
        names: parameter names by ``id(master)`` (NVMe swap file names).
        speculate: step during backward speculatively (``speculative_step``) where possible.
        device: the model's device, which steps ``offload.gpu_share`` of the CPU step's
            elements (streamed; None: the CPU steps them all).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        masters: ShardedMasterWeights,
        offload: OptimizerOffload,
        group: DataParallelGroup,
        copies: dict[int, torch.Tensor],
        names: dict[int, str] | None = None,
        *,
        speculate: bool = False,
        device: torch.device | None = None,
    ) -> None:
        package = require_offload_package("offload_optimizer")
        self.masters = masters
        self.offload = offload
        self._pool: StepWorker | None = None
        self._eager_steps = 0
        # overlap_forward (see enable_overlap_forward): the CPU step jobs of the last backward
        # that engine.step() did not wait for, in forward order (the first layers' buckets
        # first), each published when the next forward reaches its parameters; whether the
        # step they belong to was settled (kept), and whether a kept speculative step still
        # has to be committed once they are done.
        self.overlap_forward = False
        self.tail: deque[tuple[list[int], Future[None]]] = deque()
        self.tail_indices: set[int] = set()  # every parameter index in the tail
        self.tail_kept = False
        self._commit_pending: float | None = None  # the factor the kept step assumed
        self.tail_wait_s = 0.0  # seconds forwards (and barriers) waited for the tail
        # The C++ step's own clock (HostOptimizer.kernel_s[0]) for the calls made off the
        # worker thread: a step after backward (no speculation, a discarded or paused one).
        # Benchmarks compare kernel_s with worker_busy_s, which counts the worker alone.
        self.kernel_off_worker_s = 0.0
        # Set by the ZeRO instance on a GPU: ``stage_upload(indices)`` starts a tail bucket's
        # upload (off the compute stream) and returns what its publish then takes. It runs on
        # the worker as soon as the bucket's job is done, so the upload does not wait for
        # the forward to reach the bucket and then queue behind the forward's kernels.
        # _staged: each done job's staged upload (None if there is none); _claimed: jobs
        # published or drained before their upload was staged (staging skips those).
        self.stage_upload: Callable[[list[int]], Any] | None = None
        self._staged: dict[Future[None], Any] = {}
        self._claimed: set[Future[None]] = set()
        self._staged_lock = threading.Lock()
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
        # Partial offload: masters kept on the device step there, with the optimizer's own
        # step, after backward (step_device).
        self._step_subset = package.step_subset
        self.device_masters = [m for m, out in zip(masters.masters, masters.offloaded) if not out]
        self.host = package.HostOptimizer(
            optimizer,
            offload,
            copies=copies,
            swapper=self.swapper,
            announce=group.rank == 0,
            allocate=lambda shape: masters.host_empty(shape, torch.float32),
            grad_of=masters.grad_of,
            params=[m for m, out in zip(masters.masters, masters.offloaded) if out],
            device=device,
        )
        if self.device_masters and group.rank == 0:
            kept = sum(m.numel() for m in self.device_masters)
            total = sum(m.numel() for m in masters.masters)
            logger.info(
                "partial optimizer offload (ratio %g): the first %d of %d parameters (%.1f%% "
                "of this rank's %d elements) keep their fp32 masters and optimizer states on "
                "the %s (about %.2f GiB there with Adam) and step there after backward",
                offload.ratio,
                len(self.device_masters),
                len(masters.masters),
                100.0 * kept / max(total, 1),
                total,
                self.device_masters[0].device.type.upper(),
                16 * kept / 2**30,
            )
        self.speculative = speculate and self._speculation_possible(group)
        self.speculation = SpeculationStats()
        # The clip threshold of the last step (the next is assumed to use the same), and
        # whether the global norm already ruled the current speculative step out.
        self.clip_hint: float | None = None
        self.cancelled = False
        # fp16: the loss scale of the coming backward; the speculative step then assumes the
        # factor 1 / loss_scale (unscaled, nothing clipped, no overflow).
        self.loss_scale: float | None = None
        if self.speculative:
            self.host.reserve_spares()  # here, not on the worker during backward
        if self.swapper is not None:
            # Adam/AdamW keep 2 states per parameter, Lion and Adagrad 1; another optimizer
            # (its own step on the host) is assumed to keep 2, like Adam.
            states = {"adam": 2, "lion": 1, "adagrad": 1}.get(self.host.kernel or "", 2)
            self.swapper.check_room(states, ranks_sharing=_ranks_on_this_host())
            self.swapper.evict_all()
            if group.rank == 0:
                logger.info(
                    "optimizer offload to NVMe: swap files in %s (%d sub-group(s), aio backend %s)",
                    self.space.path,
                    len(self.host.sub_groups),
                    engine.backend_name,
                )

    def _speculation_possible(self, group: DataParallelGroup) -> bool:
        """Whether a speculative step can run here; says why not (rank 0) when it cannot."""
        why = ""
        if not self.host.can_speculate:
            why = f"it needs the C++ Adam/AdamW on the CPU ({self.host.description})"
        else:
            need = self.host.spare_bytes() * _ranks_on_this_host()
            available = _available_host_bytes()
            if available is not None and need > SPARE_MEMORY_SHARE * available:
                why = (
                    f"its spare buffers need {need / 2**30:.1f} GiB of host memory for the "
                    f"ranks on this host and {available / 2**30:.1f} GiB is available"
                )
        if group.rank == 0:
            if why:
                logger.warning(
                    "gradient clipping or fp16 loss scaling with CPU offload: the optimizer "
                    "steps after backward, not during it, because %s",
                    why,
                )
            else:
                logger.info(
                    "gradient clipping or fp16 loss scaling with CPU offload: each bucket "
                    "steps during backward, speculatively (kept when nothing is clipped and "
                    "nothing overflowed, else stepped again, or skipped, after backward); "
                    "spare buffers: %.2f GiB of host memory per rank "
                    "(offload_optimizer.speculative_step=false turns this off)",
                    self.host.spare_bytes() / 2**30,
                )
        return not why

    @property
    def reads_low_precision_grads(self) -> bool:
        """Whether the step can read gradients that landed in bf16 (the C++ steps widen them
        as they load; the fallback optimizer needs fp32 ``.grad`` tensors)."""
        return self.host.kernel is not None

    # ------------------------------------------------------------------ eager (overlapped) steps
    @property
    def eager(self) -> bool:
        """Whether buckets are stepped during backward, exactly (``overlap_step``)."""
        return self.offload.overlap_step

    def speculate_now(self) -> bool:
        """Whether the coming final backward should step its buckets speculatively (called
        once per optimizer step, before that backward): after repeated discards, speculation
        pauses for a growing number of steps (the norm is then likely above the clip)."""
        return self.speculative and self.speculation.try_now()

    def expect_loss_scale(self, loss_scale: float | None) -> None:
        """fp16: the loss scale the coming backward's gradients carry (None: no scaling)."""
        self.loss_scale = loss_scale

    @property
    def speculation_scale(self) -> float:
        """The factor a speculative step assumes: the unscale of an fp16 loss scale (1.0
        without one) times a clip coefficient of 1, computed as the step computes it."""
        return unscale_factor(self.loss_scale)

    def speculate_indices(self, indices: list[int]) -> None:
        """Step the masters at ``indices`` out of place, as if the clip coefficient were 1
        and nothing overflowed (nothing, once the speculative step has been called off)."""
        if not self.cancelled:
            chosen = [self.masters.masters[i] for i in indices if self.masters.offloaded[i]]
            if self.streams:
                self.host.speculate_params(chosen, self.speculation_scale, keep=True)
            else:
                self.host.speculate_params(chosen, self.speculation_scale)

    # ------------------------------------------------------------------ gpu_share in training
    @property
    def streams(self) -> bool:
        """Whether ``gpu_share`` is in effect: a share of each bucket's elements steps on the
        device, reading the bucket's lent device gradients (:meth:`lend_grads`) and keeping
        its new values there for the publish (:meth:`take_kept`)."""
        return self.host.gpu_share > 0

    def keep_for_publish(self, dtype: torch.dtype) -> None:
        """Keep the streamed share's new values on the device, cast to ``dtype`` (the model's),
        for the publish of buckets stepped during backward."""
        self.host.keep_dtype = dtype

    def lend_grads(
        self, indices: list[int], offsets: list[int], reduced: torch.Tensor | None
    ) -> None:
        """A bucket's reduced gradients on the device (equal to the host ones), for the
        streamed share of its step to read there; None takes them back."""
        lent = self.host.device_grads
        for index, offset in zip(indices, offsets):
            if not self.masters.offloaded[index]:
                continue
            master = self.masters.masters[index]
            if reduced is None:
                lent.pop(id(master), None)
            else:
                n = self.masters.specs[index].shard_numel
                lent[id(master)] = reduced[offset : offset + n]

    def take_kept(self, index: int) -> tuple[int, torch.Tensor] | None:
        """Master ``index``'s new values kept on the device by its step during backward (the
        first element they start at, and the values in the model's dtype), handed over once."""
        if not self.masters.offloaded[index]:
            return None
        return self.host.take_kept(self.masters.masters[index])

    def eager_indices(self, indices: list[int]) -> None:
        """``overlap_step``: step the offloaded masters at ``indices`` now, during backward
        (the streamed share's values kept for the publish)."""
        if not self.streams:
            self.step_indices(indices)
            return
        chosen = [self.masters.masters[i] for i in indices if self.masters.offloaded[i]]
        self.host.step_params(chosen, 1.0, keep=True)

    def cancel_speculation(self) -> None:
        """Call off the current speculative step (the norm needs clipping): buckets not yet
        stepped are skipped, and settling it discards it."""
        self.cancelled = True

    def speculative_value(self, index: int) -> torch.Tensor:
        """Master ``index`` as the pending speculative step left it (itself if none)."""
        master = self.masters.masters[index]
        value = self.host.speculative_value(master)
        return value if value is not None else master

    def settle_speculation(self, grad_scale: float | None) -> bool:
        """Keep the speculative step if it is exactly the step for ``grad_scale`` (the
        unscale and clip factor: :attr:`speculation_scale` when nothing was clipped); else
        discard it (None: an fp16 overflow, no step at all). Returns whether it was kept."""
        cancelled, self.cancelled = self.cancelled, False
        assumed = self.speculation_scale
        if self.tail and grad_scale == assumed and not cancelled:
            # overlap_forward: kept now, committed once the jobs still running are done.
            self.keep_tail()
            self._commit_pending = assumed
            self.speculation.record(True)
            return True
        self.drain()  # jobs still running: done before their updates are discarded or kept
        kept = grad_scale == assumed and not cancelled and self.host.commit_speculation(assumed)
        if not kept and self.host.discard_speculation() and self.host.copies:
            # The model-dtype copies hold the discarded values: the masters' again, for a
            # skipped step's republish (a step taken now rewrites them anyway).
            self.host.refresh_copies()
        self.speculation.record(kept, cancelled)
        return kept

    def discard_speculation(self) -> bool:
        """Forget a pending speculative step; when there was one, rewrite the model-dtype
        copies from the masters (the caller republishes them). Returns whether there was."""
        self.cancelled = False
        if not self.host.discard_speculation():
            return False
        self.host.refresh_copies()
        return True

    def submit(
        self,
        run: Callable[[], None],
        ready: Callable[[], bool] | None = None,
        part: BucketPart | None = None,
    ) -> Future[None]:
        """Queue ``run`` (a bucket's hand-over and step) on the CPU step's worker; ``ready``:
        whether the bucket has landed on the host; ``part``: ``run`` in pieces, so that it can
        share a C++ call with the buckets queued after it (:class:`StepWorker`)."""
        if self._pool is None:
            self._pool = StepWorker(
                switch_interval_s=self.offload.gil_switch_interval_us * 1e-6,
                merge_numel=self.offload.merge_bucket_numel,
            )
        self._eager_steps += 1
        return self._pool.submit(run, ready, part)

    @property
    def worker_calls(self) -> int:
        """How many times the worker ran jobs (buckets stepped in one call count once)."""
        return self._pool.calls if self._pool is not None else 0

    # ------------------------------------------------------------------ overlap_forward
    def enable_overlap_forward(self) -> str:
        """Let ``engine.step()`` return while the last buckets still step (``overlap_forward``);
        the worker then takes the newest bucket first. Returns why it cannot ("" if it can):
        it needs steps during backward and the C++ step, whose hyper-parameters can be frozen
        while a scheduler moves on."""
        if not (self.eager or self.speculative):
            return "the optimizer steps after backward here (no step during backward to overlap)"
        if self.host.kernel is None:
            return f"it needs the C++ CPU step ({self.host.description})"
        self.overlap_forward = True
        return ""

    def newest_first(self, on: bool) -> None:
        """overlap_forward: step the queued buckets newest first (after backward) or oldest
        first (during it)."""
        if self._pool is not None:
            self._pool.lifo = on and self.overlap_forward

    def defer(self, indices: list[int], job: Future[None]) -> None:
        """Leave bucket ``indices``' job running past the end of backward (called in bucket
        order, the reverse of forward order)."""
        self.tail.appendleft((indices, job))
        self.tail_indices.update(indices)
        if self.stage_upload is not None:
            job.add_done_callback(partial(self._stage, indices))

    def _stage(self, indices: list[int], job: Future[None]) -> None:
        # Runs once per deferred job, on the worker thread as the job ends (or at once on the
        # caller's if it had ended). A job that failed stages nothing: its publish re-raises.
        with self._staged_lock:
            if job in self._claimed:
                self._claimed.discard(job)
                return
            staged: Any = None
            if not job.cancelled() and job.exception() is None and self.stage_upload is not None:
                try:
                    staged = self.stage_upload(indices)
                except BaseException as exc:  # handed to the publish, which re-raises it
                    staged = _StagingFailed(exc)
            self._staged[job] = staged

    def _claim(self, job: Future[None]) -> Any:
        """The staged upload of a done tail job (None: none, or not staged yet, and then
        never: publishing goes the ordinary way)."""
        with self._staged_lock:
            if job in self._staged:
                staged = self._staged.pop(job)
                if isinstance(staged, _StagingFailed):
                    raise staged.error
                return staged
            self._claimed.add(job)
            return None

    def keep_tail(self) -> None:
        """The step is settled and the jobs still running are part of it: freeze the
        hyper-parameters they read (the scheduler moves on before they finish)."""
        if self.tail and not self.tail_kept:
            self.host.freeze_hyperparameters()
            self.tail_kept = True

    def publish_next(self, publish: Callable[[list[int], Any], None]) -> None:
        """Wait for the first job left (in forward order) and publish its parameters
        (``publish(indices, staged)``, with its staged upload if there is one)."""
        indices, job = self.tail[0]
        began = time.perf_counter()
        job.result()  # re-raises what the worker hit
        self.tail_wait_s += time.perf_counter() - began
        self.tail.popleft()
        self.tail_indices.difference_update(indices)
        publish(indices, self._claim(job))

    def finish_tail(self, publish: Callable[[list[int], Any], None]) -> None:
        """Publish every bucket still running, then commit a kept speculative step."""
        try:
            while self.tail:
                self.publish_next(publish)
            if self._commit_pending is not None:
                scale, self._commit_pending = self._commit_pending, None
                if not self.host.commit_speculation(scale):
                    raise RuntimeError(
                        "internal error: a speculative CPU step kept at engine.step() could "
                        "not be committed after its last bucket; please report this"
                    )
        finally:
            if self.tail_kept:
                self.host.thaw_hyperparameters()
                self.tail_kept = False

    def drain(self) -> None:
        """Wait for the jobs still running without publishing them (the caller republishes
        or discards); nothing stays deferred."""
        while self.tail:
            indices, job = self.tail.popleft()
            self.tail_indices.difference_update(indices)
            try:
                job.result()
            finally:
                self._claim(job)  # its staged upload, if any, is dropped

    def step_indices(self, indices: list[int], grad_scale: float = 1.0) -> None:
        """Step the offloaded masters at ``indices`` now (``grad_scale`` folded into the
        gradients); those kept on the device step in :meth:`step_device`."""
        chosen = [self.masters.masters[i] for i in indices if self.masters.offloaded[i]]
        before = None if self._on_worker() else self.host.kernel_s[0]
        self.host.step_params(chosen, grad_scale)
        if before is not None:
            self.kernel_off_worker_s += self.host.kernel_s[0] - before

    def _on_worker(self) -> bool:
        """Whether the calling thread is the CPU step's worker."""
        pool = self._pool
        return pool is not None and pool.is_worker_thread()

    def step_device(self, grad_scale: float) -> None:
        """Partial offload: step the masters kept on the device that have a gradient, with
        the optimizer's own step, ``grad_scale`` (unscale x clip) multiplied into their
        gradients first. Every step path runs this before it publishes."""
        grads = {m: m.grad for m in self.device_masters if m.grad is not None}
        if not grads:
            return
        if grad_scale != 1.0:
            torch._foreach_mul_(list(grads.values()), grad_scale)
        self._step_subset(self.host.optimizer, list(grads))

    @property
    def kernel_s(self) -> tuple[float, float, float, float]:
        """The C++ step's own clock, summed over its calls (benchmarks): seconds inside its
        parallel regions, the sums of the latest and of the mean thread's end in each, and the
        sum of the latest thread's start (:attr:`HostOptimizer.kernel_s`)."""
        return self.host.kernel_s

    @property
    def worker_busy_s(self) -> float:
        """Seconds the CPU step's worker has spent running bucket steps (benchmarks). Steps
        taken after backward on the caller's thread are not in it: :attr:`kernel_s` counts
        every C++ call, :attr:`kernel_off_worker_s` those made off the worker."""
        return self._pool.busy_s if self._pool is not None else 0.0

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
        clock = None if self._on_worker() else self.host.kernel_s[0]
        self.host.step(grad_scale=grad_scale, on_sub_group=after, before_sub_group=before)
        if clock is not None:
            self.kernel_off_worker_s += self.host.kernel_s[0] - clock

    def resident(self) -> Any:
        """A context in which every master and state is in host memory (checkpoints)."""
        return self.swapper.resident() if self.swapper is not None else nullcontext()

    def close(self) -> None:
        """Stop the worker; remove the swap files (also done at exit)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        self.tail.clear()
        self.tail_indices.clear()
        self.host.discard_speculation()  # nothing to republish: the engine is going away
        if self.space is not None:
            self.space.close()
