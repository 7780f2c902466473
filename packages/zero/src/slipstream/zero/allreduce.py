"""Bucketed gradient all-reduce overlapped with the backward pass (the replicated path, stage 0)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from slipstream import comm

__all__ = ["GradientReducer", "ReduceSettings", "register_ready_hooks"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class ReduceSettings:
    """How gradients are averaged across the data-parallel group (DeepSpeed's semantics).

    ``prescale_gradients`` divides by the world size before the all-reduce; otherwise the
    sum is divided by ``gradient_predivide_factor`` before and multiplied by
    ``predivide / world`` after, so both paths yield the mean.
    """

    bucket_numel: int
    prescale_gradients: bool = False
    gradient_predivide_factor: float = 1.0
    communication_dtype: torch.dtype | None = None


@dataclass(slots=True)
class _Bucket:
    """A group of gradients all-reduced by one collective."""

    index: int
    sources: list[torch.Tensor] = field(default_factory=list)  # tensors whose .grad is reduced
    numel: int = 0
    pending: int = 0  # hooks still to fire in the current backward
    buffer: torch.Tensor | None = None
    work: dist.Work | None = None
    launched: bool = False


class GradientReducer:
    """All-reduces gradient tensors in buckets while backward is still running.

    ``sources[i].grad`` is where the i-th gradient accumulates: the parameter itself in fp32
    training, its fp32 master copy under fp16/bf16. Gradients are looked up at launch time (not
    held), so a ``zero_grad(set_to_none=True)`` between steps is harmless; a missing gradient
    (an unused parameter) is reduced as zeros so that every rank ends with the same value. Buckets are filled in reverse
    parameter order (roughly the order backward produces gradients) and are launched strictly
    in bucket order, so every rank issues the same collectives in the same sequence even if
    hooks fire in a different order; a bucket whose parameters never received a gradient
    (unused parameters) is launched by ``finish()``.
    """

    def __init__(
        self,
        sources: Sequence[torch.Tensor],
        settings: ReduceSettings,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.settings = settings
        self.group = group
        self.world_size = comm.get_world_size(group)
        self._buckets: list[_Bucket] = []
        self._bucket_of: list[int] = []
        self._build_buckets(list(sources))
        self._next_to_launch = 0
        self.active = False

    def _build_buckets(self, sources: list[torch.Tensor]) -> None:
        self._bucket_of = [0] * len(sources)
        bucket: _Bucket | None = None
        for index in reversed(range(len(sources))):
            tensor = sources[index]
            boundary = bucket is not None and (
                bucket.numel + tensor.numel() > self.settings.bucket_numel
                or bucket.sources[0].dtype != tensor.dtype
                or bucket.sources[0].device != tensor.device
            )
            if bucket is None or boundary:
                bucket = _Bucket(index=len(self._buckets))
                self._buckets.append(bucket)
            bucket.sources.append(tensor)
            bucket.numel += tensor.numel()
            self._bucket_of[index] = bucket.index

    @property
    def num_buckets(self) -> int:
        """How many collectives one reduction issues."""
        return len(self._buckets)

    def live_bytes(self) -> int:
        """Bytes of the flat bucket buffers in flight now (zero between reductions)."""
        return sum(
            b.buffer.numel() * b.buffer.element_size()
            for b in self._buckets
            if b.buffer is not None
        )

    def start(self) -> None:
        """Arm the reducer for the backward pass that ends a gradient-accumulation cycle."""
        for bucket in self._buckets:
            bucket.pending = len(bucket.sources)
            bucket.launched = False
            bucket.work = None
        self._next_to_launch = 0
        self.active = True

    def mark_ready(self, param_index: int) -> None:
        """Called from a gradient hook once ``sources[param_index].grad`` holds its final value."""
        if not self.active:
            return
        bucket = self._buckets[self._bucket_of[param_index]]
        bucket.pending -= 1
        # Launch every bucket of the ready prefix: in-order launches keep ranks in lockstep.
        while (
            self._next_to_launch < len(self._buckets)
            and self._buckets[self._next_to_launch].pending <= 0
        ):
            self._launch(self._buckets[self._next_to_launch])
            self._next_to_launch += 1

    def finish(self) -> None:
        """Launch what is left (unused parameters), wait for all buckets, write results back."""
        if not self.active:
            return
        while self._next_to_launch < len(self._buckets):
            self._launch(self._buckets[self._next_to_launch])
            self._next_to_launch += 1
        for bucket in self._buckets:
            self._complete(bucket)
        self.active = False

    def _launch(self, bucket: _Bucket) -> None:
        settings = self.settings
        dtype = settings.communication_dtype or bucket.sources[0].dtype
        grads = [
            s.grad.reshape(-1) if s.grad is not None else torch.zeros_like(s).reshape(-1)
            for s in bucket.sources
        ]
        # One flat buffer per bucket: a single collective instead of one per tensor.
        flat = torch.cat(grads).to(dtype)
        if settings.prescale_gradients:
            flat.mul_(1.0 / self.world_size)
        elif settings.gradient_predivide_factor != 1.0:
            flat.mul_(1.0 / settings.gradient_predivide_factor)
        bucket.buffer = flat
        bucket.work = comm.all_reduce(flat, group=self.group, async_op=True)
        bucket.launched = True

    def _complete(self, bucket: _Bucket) -> None:
        assert bucket.buffer is not None
        if bucket.work is not None:
            bucket.work.wait()
        flat = bucket.buffer
        settings = self.settings
        if not settings.prescale_gradients:
            post = settings.gradient_predivide_factor / self.world_size
            if post != 1.0:
                flat.mul_(post)
        offset = 0
        for source in bucket.sources:
            n = source.numel()
            reduced = flat[offset : offset + n].view_as(source)
            if source.grad is None:
                source.grad = reduced.to(source.dtype).clone()
            else:
                source.grad.copy_(reduced)
            offset += n
        bucket.buffer = None
        bucket.work = None


def register_ready_hooks(
    params: Sequence[torch.nn.Parameter], on_grad: Callable[[int, torch.nn.Parameter], None]
) -> list[torch.utils.hooks.RemovableHandle]:
    """Call ``on_grad(index, param)`` each time autograd finishes accumulating ``param.grad``."""
    handles = []
    for index, param in enumerate(params):

        def hook(p: torch.Tensor, index: int = index) -> None:
            on_grad(index, p)  # type: ignore[arg-type]

        handles.append(param.register_post_accumulate_grad_hook(hook))
    return handles
