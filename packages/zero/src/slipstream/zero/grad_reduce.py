"""Bucketed reduce-scatter of full gradients into the fp32 gradients of the master shards."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum, auto
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from slipstream.zero.group import DataParallelGroup
from slipstream.zero.layout import ShardSpec
from slipstream.zero.masters import ShardedMasterWeights
from slipstream.zero.norms import LandedSquares, squares_of_norms, tensor_norms

__all__ = ["BucketState", "EagerBucketStep", "GradientReduceScatter", "plan_buckets"]

# Up to this many ranks a gradient enters its bucket one contiguous row per rank ([Note: row
# copies] in GradientReduceScatter._copy_in).
_ROW_COPY_MAX_WORLD = 4


class BucketState(Enum):
    """Where one reduce-scatter bucket is in a reduction (one backward pass).

    FILLING: gradients are copied into its send buffer as they arrive. LAUNCHED: its
    reduce-scatter is issued (the send buffer and the output are alive). LANDED: a bucket
    whose masters are on the device has been waited for, post-scaled and handed to the
    master gradients, and its send buffer freed (its output lives on only as those
    gradients). Back to FILLING in :meth:`GradientReduceScatter.finish`. Buckets of masters
    in host memory (optimizer offload) stay LAUNCHED until ``finish``: their copy to the host
    runs on a side stream.
    """

    FILLING = auto()
    LAUNCHED = auto()
    LANDED = auto()


def plan_buckets(
    specs: Sequence[ShardSpec],
    bucket_numel: int,
    apart: Sequence[bool] | None = None,
    tail_numel: int = 0,
) -> list[list[int]]:
    """Group parameter indices into buckets of at most ``bucket_numel`` (padded) elements.

    Filled in reverse parameter order, roughly the order in which backward produces the
    gradients; a parameter larger than the bucket gets a bucket of its own. A bucket never
    holds two parameters whose ``apart`` flags differ (partial offload: masters on the host
    and on the device). ``tail_numel`` > 0 splits the last bucket (launched when backward
    ends, so its reduction is not overlapped) into buckets of at most that many elements.
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index in reversed(range(len(specs))):
        numel = specs[index].padded_numel
        split = apart is not None and bool(current) and apart[current[-1]] != apart[index]
        if current and (split or size + numel > bucket_numel):
            buckets.append(current)
            current, size = [], 0
        current.append(index)
        size += numel
    if current:
        buckets.append(current)
    if tail_numel > 0 and buckets and len(buckets[-1]) > 1:
        last = buckets.pop()
        current, size = [], 0
        for index in last:
            numel = specs[index].padded_numel
            if current and size + numel > tail_numel:
                buckets.append(current)
                current, size = [], 0
            current.append(index)
            size += numel
        buckets.append(current)
    return buckets


def _nothing() -> None:
    """A bucket reduced without a GPU is in the master grads already: nothing to prepare."""


@dataclass(slots=True)
class _Bucket:
    """Parameters whose gradients travel in one reduce-scatter."""

    indices: list[int]
    offsets: list[int]  # offset of each parameter's shard inside the bucket's shard
    shard_numel: int
    pending: int = 0
    state: BucketState = BucketState.FILLING
    buffer: torch.Tensor | None = None  # [world, shard_numel]: rank r's pieces in row r
    output: torch.Tensor | None = None
    work: dist.Work | None = None
    filled: set[int] = field(default_factory=set)
    # Optimizer offload: pinned host copies of the reduced shard (the first reduction after
    # zero_grad lands in ``host`` and becomes the master grads, later ones in ``scratch`` and
    # are added), the copy's event, and the result's sum of squares (on the device).
    host: torch.Tensor | None = None
    host_low: torch.Tensor | None = None  # ``host`` in bf16 (see land_low_precision)
    scratch: torch.Tensor | None = None
    target: torch.Tensor | None = None
    copied: Any = None
    squares: torch.Tensor | None = None
    first: bool = True  # this reduction is the first since zero_grad (lands in ``host``)
    job: Any = None  # the eager CPU step of this bucket (a Future), see on_final_bucket
    to_host: bool = False  # its masters are in host memory (optimizer offload)
    scaled: bool = False  # reduced, post-scaled (and its squares taken) on the device


@dataclass(frozen=True, slots=True)
class EagerBucketStep:
    """Optimizer offload with a CPU step during backward: what the reducer calls per bucket
    of the last reduction before a step (``final``), given at construction.

    ``submit(run, ready, part)`` queues ``run`` (hand the landed bucket to the master grads,
    then step those masters) on the CPU step's worker and returns its Future; ``ready``
    (with a GPU; None without) says whether the bucket's copy to the host is done; ``part``
    is ``run`` in pieces (:class:`slipstream.zero.offload.BucketPart`), so that the worker
    can step several landed buckets in one call. ``step_indices`` steps
    a bucket's masters (the exact or the speculative step). ``on_stepped(indices)`` is
    called in :meth:`GradientReduceScatter.finish`, in bucket order, as each bucket's step
    completes (the stage publishes those parameters while later buckets still step).
    ``before_stepped(squares)``, if given, is called in ``finish`` once every bucket's sum of
    squares exists and before it waits for the steps (a speculative step may be called off
    there); only for a first reduction since zero_grad.
    ``lend_grads(indices, offsets, reduced)``, if given, is called on the worker before a
    bucket steps, when its landed gradients are the whole master grads (a first reduction):
    ``reduced`` is the bucket's reduced output on the device, equal to what landed on the
    host, which the step may read instead (gpu_share); ``lend_grads(indices, offsets, None)``
    after the step takes them back (the device buffer is freed once no one holds it).
    """

    submit: Callable[..., Any]
    step_indices: Callable[[list[int]], None]
    on_stepped: Callable[[list[int]], None]
    before_stepped: Callable[[list[torch.Tensor]], None] | None = None
    lend_grads: Callable[[list[int], list[int], torch.Tensor | None], None] | None = None


class GradientReduceScatter:
    """Reduce-scatters gradients bucket by bucket into ``masters[i].grad`` (accumulating).

    A gradient is copied into its bucket's send buffer as soon as it is ready
    (:meth:`mark_ready`), and its full-size ``.grad`` is released through ``release(i)``;
    the buffer is laid out rank-major (``[world, bucket_shard]``: each parameter's rank-``r``
    piece in row ``r``) so that one ``reduce_scatter_tensor`` hands every rank exactly the
    pieces it owns. Buckets launch strictly in order (every rank issues the same collectives
    in the same sequence whatever order the hooks fire in): with ``overlap`` as soon as a
    bucket and all before it are complete, otherwise all in :meth:`finish`. ``finish`` also
    reduces zeros for parameters that received no gradient (unused in this backward), so
    every rank's collectives match, then waits and adds the results into the masters.

    [Note: bucket lifetime] A bucket of masters on the device lands as soon as a later
    bucket is launched (:meth:`_land_earlier`): its collective is waited for (the compute
    stream waits for it, the host does not), its result post-scaled and handed to the
    master grads, and its ``[world, shard]`` send buffer freed. So at most two buckets'
    send buffers exist at a time (the one in flight and the one filling) instead of every
    bucket's until the end of backward: that was a full-size fp32 copy of all gradients
    at the end of each backward (27 GB per rank at 7B). The first reduction since zero_grad
    of a bucket whose output is already fp32 hands over *views* of the output as the
    master grads, so the output is not copied either. The send buffer is filled straight
    from each gradient (no full-size padded temporary).

    Averaging follows DeepSpeed: divide by ``gradient_predivide_factor`` before and by
    ``world / factor`` after (or by ``world`` before with ``prescale``). ``divisor`` replaces
    ``world`` there when the mean is over more ranks than the group reduces over: expert
    parameters are summed over their expert-data-parallel group but averaged over the whole
    data-parallel world (every rank's loss counts once).
    """

    def __init__(
        self,
        masters: ShardedMasterWeights,
        group: DataParallelGroup,
        bucket_numel: int,
        *,
        grad_of: Callable[[int], torch.Tensor | None],
        release: Callable[[int], None],
        overlap: bool = True,
        communication_dtype: torch.dtype | None = None,
        gradient_predivide_factor: float = 1.0,
        prescale: bool = False,
        divisor: int | None = None,
        tail_numel: int = 0,
        reduce_group: DataParallelGroup | None = None,
        average_in_collective: bool = False,
        eager: EagerBucketStep | None = None,
        land_low_precision: bool = False,
    ) -> None:
        if divisor is not None and divisor < 1:
            raise ValueError(f"divisor must be a positive rank count, got {divisor}")
        self.masters = masters
        self.divisor = divisor if divisor is not None else group.world_size
        self.group = group
        # The same ranks on another communicator (reduce_scatter_max_ctas), or ``group``.
        self.reduce_group = reduce_group or group
        self.grad_of = grad_of
        self.release = release
        self.overlap = overlap
        self.dtype = communication_dtype or torch.float32
        self.predivide = gradient_predivide_factor
        self.prescale = prescale
        # average_in_collective: the reduce-scatter averages (NCCL's AVG scales by a power of
        # two, exactly as the pass after would), so no post-scale pass over each bucket.
        self.average_fallback = ""  # why it was asked for and not taken ("" otherwise)
        self._average = False
        if average_in_collective:
            self.average_fallback = self._why_not_average(
                group if reduce_group is None else reduce_group
            )
            self._average = not self.average_fallback
        self._buckets: list[_Bucket] = []
        self._bucket_of: dict[int, int] = {}
        # Optimizer offload with a GPU: each bucket's result is post-scaled, its sum of
        # squares taken and copied to pinned host memory on a side stream as soon as its
        # reduce-scatter finishes, overlapping the rest of backward. Partial offload: only
        # the buckets of offloaded masters; the others are added into their masters on the
        # device, and their squares join the step's norm.
        self._to_host = masters.on_host
        plan = plan_buckets(masters.specs, bucket_numel, masters.offloaded, tail_numel)
        for indices in plan:
            offsets, total = [], 0
            for i in indices:
                offsets.append(total)
                total += masters.specs[i].shard_numel
            self._bucket_of.update({i: len(self._buckets) for i in indices})
            to_host = self._to_host and masters.offloaded[indices[0]]
            self._buckets.append(
                _Bucket(indices, offsets, total, pending=len(indices), to_host=to_host)
            )
        self._next = 0
        self._side: Any = None
        # Offload with an eager step (EagerBucketStep): its callbacks, fixed at construction.
        self.on_final_bucket: Callable[..., Any] | None = eager.submit if eager else None
        self.step_indices: Callable[[list[int]], None] | None = (
            eager.step_indices if eager else None
        )
        self.on_bucket_stepped: Callable[[list[int]], None] | None = (
            eager.on_stepped if eager else None
        )
        self.before_stepped: Callable[[list[torch.Tensor]], None] | None = (
            eager.before_stepped if eager else None
        )
        self.lend_grads = eager.lend_grads if eager else None
        # ``defer_job(indices, job)`` (overlap_forward, switched on by the stage's
        # overlap_forward()): finish() leaves each eager bucket's step running and hands it
        # over (in bucket order) instead of waiting for it and calling on_bucket_stepped; the
        # stage publishes it when the next forward needs it.
        self.defer_job: Callable[[list[int], Any], None] | None = None
        self.final = True
        # Offload with a bf16 reduction (when the stage's CPU step reads bf16 gradients): a
        # reduction that is the first since zero_grad and the last before the step
        # (``boundary``, set before each backward) lands on the host in bf16, as it was
        # reduced, and stays so (ShardedMasterWeights.landed); any other lands in fp32.
        self.land_low_precision = land_low_precision
        self.boundary = True
        # Whether the next finish() takes the step's sum of squares as the buckets land (set
        # by the stage before it; reset by finish).
        self.take_squares = False

    def _why_not_average(self, group: DataParallelGroup) -> str:
        world = group.world_size
        if world == 1:
            return "a group of one rank does not reduce"
        if type(group) is not DataParallelGroup:
            return "a ZeRO++/MiCS group reduces its own way"
        if world & (world - 1):
            return f"the group has {world} ranks, not a power of two (1/{world} is inexact)"
        if self.prescale or self.predivide != 1.0:
            return "prescale_gradients / gradient_predivide_factor scale the gradients already"
        if self.divisor != world:
            return "the mean is over more ranks than the group reduces (expert parameters)"
        backend = torch.distributed.get_backend(group.group)
        if backend != "nccl":
            return f"the process group's backend is {backend!r}, not 'nccl'"
        return ""

    @property
    def num_buckets(self) -> int:
        """Reduce-scatters per reduction."""
        return len(self._buckets)

    @property
    def bucket_nbytes(self) -> list[int]:
        """Bytes of each bucket's send buffer (``world x bucket shard`` elements)."""
        size = torch.empty((), dtype=self.dtype).element_size()
        return [self.group.world_size * b.shard_numel * size for b in self._buckets]

    def live_bytes(self) -> int:
        """Bytes the reduction holds now beyond the master grads: send buffers being filled or
        in flight, and outputs not yet handed over (at most two buckets' worth on the device:
        [Note: bucket lifetime])."""
        total = 0
        for bucket in self._buckets:
            if bucket.buffer is not None:
                total += bucket.buffer.numel() * bucket.buffer.element_size()
            if bucket.output is not None:
                total += bucket.output.numel() * bucket.output.element_size()
        return total

    def mark_ready(self, index: int) -> None:
        """Take parameter ``index``'s finished gradient into its bucket (from a grad hook)."""
        bucket = self._buckets[self._bucket_of[index]]
        first = index not in bucket.filled
        self._copy_in(bucket, index)
        if first:
            bucket.pending -= 1
        if self.overlap:
            self._launch_ready_prefix()

    def _ensure_buffer(self, bucket: _Bucket) -> torch.Tensor:
        if bucket.buffer is None:
            # Where the gradients are (masters may be on the host with optimizer offload).
            device = self.masters.params[bucket.indices[0]].device
            # Not zeroed: each gradient is copied over its pieces, and what no gradient
            # covers (padding, parameters without a gradient) is zeroed when the bucket
            # launches (_zero_uncovered). A memset of every send buffer cost about 1.7 ms per
            # step at 1.3B on 2 H200s, for padding that a model with even shapes never has.
            bucket.buffer = torch.empty(
                self.group.world_size, bucket.shard_numel, dtype=self.dtype, device=device
            )
        return bucket.buffer

    def _zero_uncovered(self, bucket: _Bucket, buffer: torch.Tensor) -> None:
        """Zero what no gradient was copied over: the whole column block of a parameter
        without a gradient, the padding past the end of one with (parameters without a
        gradient are reduced as zeros; padding reduces to zero)."""
        world = buffer.shape[0]
        for index, offset in zip(bucket.indices, bucket.offsets):
            spec = self.masters.specs[index]
            n = spec.shard_numel
            block = buffer[:, offset : offset + n]
            if index not in bucket.filled:
                block.zero_()
                continue
            rows, rest = divmod(spec.numel, n)
            if rows >= world:
                continue  # no padding
            if rest:
                block[rows, rest:].zero_()
                rows += 1
            if rows < world:
                block[rows:].zero_()

    def _copy_in(self, bucket: _Bucket, index: int) -> None:
        grad = self.grad_of(index)
        if grad is None:
            return
        if bucket.state is not BucketState.FILLING:
            raise RuntimeError(
                "a gradient arrived for a bucket whose reduce-scatter is already under way "
                "(a second backward pass over the same parameters before the gradients were "
                "reduced); call finish_backward() after each backward pass"
            )
        buffer = self._ensure_buffer(bucket)
        spec = self.masters.specs[index]
        position = bucket.indices.index(index)
        offset = bucket.offsets[position]
        n = spec.shard_numel
        target = buffer[:, offset : offset + n]
        flat = grad.detach().reshape(-1)
        accumulate = index in bucket.filled  # retain_graph: a second backward pass
        # Rank r's piece of the flat gradient goes to row r; the padding stays zero (the
        # buffer starts zeroed). Whole rows in one copy, the ragged last piece in another.
        # [Note: row copies] A copy into the [rows, n] column block is strided (TensorIterator
        # cannot vectorize it): at 1.3B on 2 H200s these bf16->fp32 copies took 5.4 ms per
        # step where the bytes allow under 2. On few ranks each row is copied on its own
        # (contiguous on both sides); on many, one strided copy keeps the launches down.
        rows = spec.numel // n
        if rows and spec.world_size <= _ROW_COPY_MAX_WORLD:
            pieces = [(target[r], flat[r * n : (r + 1) * n]) for r in range(rows)]
        else:
            pieces = [(target[:rows], flat[: rows * n].view(rows, n))] if rows else []
        if rows < spec.world_size and spec.numel > rows * n:
            pieces.append((target[rows, : spec.numel - rows * n], flat[rows * n :]))
        if accumulate:
            for into, piece in pieces:
                into.add_(piece)
        elif pieces:
            # [Note: cast copies] One multi-tensor copy for the pieces: on CUDA a copy that
            # casts (bf16 gradient -> fp32 bucket) through copy_ runs TensorIterator's
            # unrolled, non-vectorized casting kernel: at 1.3B on 2 H200s these copies took
            # 5.7 ms per step (1.4 TB/s; torch vectorizes the bf16->fp32 copy on ROCm only).
            # _foreach_copy_ casts in its multi-tensor kernel with vectorized loads and
            # stores. The values are the same (bf16 -> fp32 is exact).
            torch._foreach_copy_([into for into, _ in pieces], [piece for _, piece in pieces])
        bucket.filled.add(index)
        self.release(index)  # the full-size gradient is no longer needed

    def _launch_ready_prefix(self) -> None:
        while self._next < len(self._buckets) and self._buckets[self._next].pending <= 0:
            self._launch(self._buckets[self._next])
            self._next += 1
            self._land_earlier()

    def _land_earlier(self) -> None:
        """Land every launched bucket of device masters but the latest one (see [Note:
        bucket lifetime]): at most one reduce-scatter's buffers stay in flight."""
        for bucket in self._buckets[: self._next - 1]:
            if bucket.state is BucketState.LAUNCHED and not bucket.to_host:
                self._land(bucket)

    def _land(self, bucket: _Bucket) -> None:
        """Wait for a device bucket's reduction, hand it to the master grads, free its buffer."""
        output = self._reduced(bucket)
        first = not any(self.masters.has_grad(i) for i in bucket.indices)
        for index, offset in zip(bucket.indices, bucket.offsets):
            n = self.masters.specs[index].shard_numel
            piece = output[offset : offset + n]
            master = self.masters.masters[index]
            if (
                first
                and piece.dtype == master.dtype
                and piece.device == master.device
                and master.dim() == 1
            ):
                master.grad = piece  # a view: the output *is* the master grads
            else:
                self.masters.add_grad_(index, piece)
        bucket.buffer = bucket.output = None
        bucket.state = BucketState.LANDED

    def _launch(self, bucket: _Bucket) -> None:
        bucket.state = BucketState.LAUNCHED
        buffer = self._ensure_buffer(bucket)
        self._zero_uncovered(bucket, buffer)
        if self.prescale:
            buffer.mul_(1.0 / self.divisor)
        elif self.predivide != 1.0:
            buffer.mul_(1.0 / self.predivide)
        bucket.output = torch.empty(bucket.shard_numel, dtype=self.dtype, device=buffer.device)
        bucket.work = self.reduce_group.reduce_scatter_into(
            bucket.output, buffer.reshape(-1), async_op=True, average=self._average
        )
        if bucket.to_host and buffer.device.type == "cuda":
            self._copy_to_host_async(bucket)

    def _post_scale(self) -> float:
        return 1.0 if self.prescale or self._average else self.predivide / self.divisor

    def _host_target(self, bucket: _Bucket) -> torch.Tensor:
        """The pinned buffer this reduction lands in (see _Bucket)."""
        first = not self.masters.has_grad(bucket.indices[0])
        bucket.first = first
        output = bucket.output
        dtype = torch.float32
        name = "host" if first else "scratch"
        if (
            first
            and self.land_low_precision
            and self.boundary
            and output is not None
            and output.dtype == torch.bfloat16
        ):
            dtype, name = torch.bfloat16, "host_low"
        target = getattr(bucket, name)
        if target is None:
            # Pinned whenever the bucket comes from a GPU (whatever pin_memory says); from the
            # masters' arena when that is pinned.
            from_gpu = output is not None and output.device.type == "cuda"
            if from_gpu and self.masters.host.pin:
                target = self.masters.host_empty((bucket.shard_numel,), dtype)
            else:
                target = torch.empty(bucket.shard_numel, dtype=dtype, pin_memory=from_gpu)
            setattr(bucket, name, target)
        return target

    @staticmethod
    def _owned(bucket: _Bucket, target: torch.Tensor) -> bool:
        """Whether ``target`` is reserved for the master grads (not the accumulation scratch)."""
        return target is bucket.host or target is bucket.host_low

    def _copy_to_host_async(self, bucket: _Bucket) -> None:
        output, work = bucket.output, bucket.work
        assert output is not None
        if self._side is None:
            self._side = torch.cuda.Stream(device=output.device)
        side = self._side
        target = self._host_target(bucket)
        # The side stream waits for what the compute stream queued before this point (the
        # bucket's fill and, in a group of one, the reduction itself: a plain copy into
        # ``output`` with no collective behind it), then for the collective, if any.
        side.wait_stream(torch.cuda.current_stream(output.device))
        with torch.cuda.stream(side):
            if work is not None:
                work.wait()  # the side stream waits for the collective, not the host
            post = self._post_scale()
            if post != 1.0:
                output.mul_(post)
            bucket.squares = output.float().pow(2).sum()
            target.copy_(output, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        bucket.target, bucket.copied, bucket.work = target, event, None
        if self.on_final_bucket is not None and self.final:
            indices, offsets = list(bucket.indices), list(bucket.offsets)
            owned = self._owned(bucket, target)
            # A first reduction's device output equals what lands (gpu_share reads it there);
            # held by this job until its step is done.
            lend = self.lend_grads if owned and bucket.first else None
            reduced = [output] if lend is not None else []

            def prepare() -> None:
                # synchronize() gives the GIL up and takes it back, which costs up to Python's
                # switch interval while another thread runs Python; a landed bucket needs
                # neither (query() keeps the GIL).
                if not event.query():
                    event.synchronize()
                self._hand_over_slices(indices, offsets, target, owned)

            def run() -> None:
                prepare()
                self._step_lending(indices, offsets, reduced, lend)

            # A bucket whose device gradients are lent steps in a call of its own (merged
            # steps would need every merged bucket's lent and taken back around one call).
            part = None if lend is not None else self._part(prepare, indices, bucket.shard_numel)
            bucket.job = self.on_final_bucket(run, event.query, part)

    def _part(self, prepare: Callable[[], None], indices: list[int], numel: int) -> Any:
        """The job in pieces (the stage's worker may step it in one call with others)."""
        from slipstream.zero.offload import BucketPart

        return BucketPart(prepare, self._step_now, list(indices), numel)

    def _step_lending(
        self,
        indices: list[int],
        offsets: list[int],
        reduced: list[torch.Tensor],
        lend: Callable[[list[int], list[int], torch.Tensor | None], None] | None,
    ) -> None:
        """Step a bucket, its device output (``reduced``: [output] or []) lent for the step
        and let go after it (the list is emptied: the job no longer holds the buffer)."""
        if lend is None or not reduced:
            self._step_now(indices)
            return
        lend(indices, offsets, reduced.pop())
        try:
            self._step_now(indices)
        finally:
            lend(indices, offsets, None)

    def _step_now(self, indices: list[int]) -> None:
        assert self.step_indices is not None, "an eager offload step needs step_indices"
        self.step_indices(indices)

    def finish(self) -> None:
        """Reduce what is left, wait for every bucket, add the results into the master grads.

        With :attr:`take_squares` (set by the stage for the last reduction before a step,
        masters on the device) also take the master grads' sum of squares for the step's
        norm (``masters.landed_squares``, see [Note: squares while the last bucket travels])."""
        take_squares, self.take_squares = self.take_squares, False
        self.masters.landed_squares = None  # whatever it covered is being added to now
        for bucket in self._buckets[self._next :]:
            for index in bucket.indices:
                if index not in bucket.filled:
                    self._copy_in(bucket, index)  # a gradient that came without a hook
        while self._next < len(self._buckets):
            self._launch(self._buckets[self._next])
            self._next += 1
            self._land_earlier()
        # [Note: squares while the last bucket travels] Backward is over and the last
        # reduce-scatter is in flight: the compute stream would idle until it lands, then the
        # step would read every gradient shard once for the norm. The norms of the buckets
        # that have landed are queued now, into that idle time; the last bucket's after it
        # lands. The per-tensor norms and their sum are local_squares' own, so the step's
        # norm is the same bit for bit (ZeroOptimizer.step takes it only while the grads are
        # the same tensors, unchanged: LandedSquares.covers).
        norms: dict[int, torch.Tensor] | None = None
        if take_squares and not self._to_host:
            norms = {}
            for bucket in self._buckets:
                if bucket.state is BucketState.LANDED:
                    self._take_norms(bucket, norms)
        squares: list[torch.Tensor] = []
        first_reduction = True
        if self._to_host:
            for bucket in self._buckets:
                if not bucket.to_host and bucket.state is not BucketState.LANDED:
                    self._reduced(bucket)  # partial offload: squares for the norm now
        if self.before_stepped is not None and any(b.job is not None for b in self._buckets):
            # Every bucket is on its way to the host (with a GPU): its squares are queued on
            # the side stream, which the current stream waits for.
            if all(b.squares is not None and b.first for b in self._buckets):
                torch.cuda.current_stream(self._side.device).wait_stream(self._side)
                self.before_stepped([b.squares for b in self._buckets])  # type: ignore[misc]
        if self.defer_job is not None and self._side is not None:
            # The eager steps are left running, but the buckets' device tensors are released
            # below: later work on the current stream must not reuse them before the side
            # stream has read them (post-scale, squares, copy to the host).
            torch.cuda.current_stream(self._side.device).wait_stream(self._side)
        # Eager steps of buckets reduced here (no GPU): indices, offsets, lent output, lend.
        deferred: list[tuple[list[int], list[int], list[torch.Tensor], Any]] = []
        for bucket in self._buckets:
            if bucket.job is not None:  # offload, eager: handed over and stepping already
                self._stepped(list(bucket.indices), bucket.job)
                assert bucket.squares is not None
                squares.append(bucket.squares)
                first_reduction &= bucket.first
            elif bucket.copied is not None:  # offload: already on its way to the host
                bucket.copied.synchronize()
                assert bucket.target is not None and bucket.squares is not None
                squares.append(bucket.squares)
                first_reduction &= bucket.first
                self._hand_over(bucket, bucket.target)
            elif bucket.state is BucketState.LANDED or not bucket.to_host:
                if bucket.state is not BucketState.LANDED:
                    self._land(bucket)
                    if norms is not None:
                        self._take_norms(bucket, norms)
                if self._to_host:  # partial offload: a bucket of masters on the device
                    assert bucket.squares is not None
                    squares.append(bucket.squares)
                    first_reduction &= bucket.first
            else:  # offload without a GPU: reduced, copied to the host here
                output = self._reduced(bucket)
                squares.append(output.float().pow(2).sum())
                target = self._host_target(bucket)
                first_reduction &= bucket.first
                target.copy_(output)
                self._hand_over(bucket, target)
                if self.on_final_bucket is not None and self.final:
                    lend = self.lend_grads if self._owned(bucket, target) and bucket.first else None
                    deferred.append(
                        (list(bucket.indices), list(bucket.offsets), [output] if lend else [], lend)
                    )
            bucket.buffer = bucket.output = bucket.work = None
            bucket.target = bucket.copied = bucket.squares = bucket.job = None
            bucket.scaled = False
            bucket.state = BucketState.FILLING
            bucket.pending = len(bucket.indices)
            bucket.filled.clear()
        self._next = 0
        if deferred:
            # Reduced here, so stepped here: after every bucket has landed, so that a
            # speculative step can be called off before any of it runs.
            if self.before_stepped is not None and first_reduction:
                self.before_stepped(squares)
            assert self.on_final_bucket is not None
            jobs = [
                self.on_final_bucket(
                    partial(self._step_lending, indices, offsets, reduced, lend),
                    None,
                    None
                    if lend is not None
                    else self._part(
                        _nothing, indices, sum(self.masters.specs[i].shard_numel for i in indices)
                    ),
                )
                for indices, offsets, reduced, lend in deferred
            ]  # all queued before the first is waited for: the worker may merge them
            for (indices, *_), job in zip(deferred, jobs):
                self._stepped(indices, job)
        if norms is not None:
            self._record_squares(norms)
        if self._to_host:
            # The device-side sum of squares is the master grads' only while they hold a
            # single reduction (no accumulation on the host since zero_grad).
            total = torch.stack(squares).sum() if squares else None
            self.masters.device_squares = total if first_reduction else None
            # Every reduction's squares, added up for the non-finite vote (masters.py).
            earlier = self.masters.vote_squares
            if total is not None and first_reduction:
                self.masters.vote_squares = total
            elif total is not None and earlier is not None:
                self.masters.vote_squares = earlier + total
            else:
                self.masters.vote_squares = None

    def _take_norms(self, bucket: _Bucket, norms: dict[int, torch.Tensor]) -> None:
        """Queue the norms of a landed bucket's master grads (one multi-tensor pass)."""
        grads = [self.masters.grad(i) for i in bucket.indices]
        if any(g is None for g in grads):
            return  # cannot happen after a landing; the step then takes its own sum
        norms.update(zip(bucket.indices, tensor_norms(grads)))  # type: ignore[arg-type]

    def _record_squares(self, norms: dict[int, torch.Tensor]) -> None:
        """Add the norms up in master order, as local_squares does for ``masters.grads()``."""
        order = [i for i in range(len(self.masters)) if self.masters.has_grad(i)]
        if not order or any(i not in norms for i in order):
            return
        grads = self.masters.grads()
        device = grads[0].device
        total = torch.zeros((), dtype=torch.float32, device=device) + squares_of_norms(
            [norms[i] for i in order], device
        )
        self.masters.landed_squares = LandedSquares.of(total, grads)

    def _stepped(self, indices: list[int], job: Any) -> None:
        """A bucket's eager step: left running (``defer_job``) or waited for and published."""
        if self.defer_job is not None:
            self.defer_job(indices, job)
            return
        job.result()  # re-raises what the worker hit
        if self.on_bucket_stepped is not None:
            self.on_bucket_stepped(indices)

    def _reduced(self, bucket: _Bucket) -> torch.Tensor:
        """A bucket reduced on the device: its collective waited for (by the current stream),
        its result post-scaled, once. Partial offload: for a bucket of masters on the device,
        also whether this is the first reduction since zero_grad and its sum of squares."""
        output = bucket.output
        assert output is not None
        if bucket.scaled:
            return output
        if bucket.work is not None:
            bucket.work.wait()
            bucket.work = None
        post = self._post_scale()
        if post != 1.0:
            output.mul_(post)
        if self._to_host and not bucket.to_host:
            bucket.first = not self.masters.has_grad(bucket.indices[0])
            bucket.squares = output.float().pow(2).sum()
        bucket.scaled = True
        return output

    def _hand_over(self, bucket: _Bucket, target: torch.Tensor) -> None:
        """Make a landed host copy the master grads (views) or add it into them."""
        self._hand_over_slices(bucket.indices, bucket.offsets, target, self._owned(bucket, target))

    def _hand_over_slices(
        self, indices: list[int], offsets: list[int], target: torch.Tensor, owned: bool
    ) -> None:
        for index, offset in zip(indices, offsets):
            n = self.masters.specs[index].shard_numel
            self.masters.take_host_grad_(index, target[offset : offset + n], owned=owned)
