"""ZeroOptimizer: one optimizer step over sharded masters (unscale, overflow vote, clip, update)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from slipstream.zero.group import DataParallelGroup
from slipstream.zero.masters import ShardedMasterWeights
from slipstream.zero.norms import (
    clip_coefficient,
    clip_grads_,
    global_grad_norm,
    local_squares,
    norm_of_squares,
    overflow_on_any_rank,
    unscale_factor,
)

if TYPE_CHECKING:
    from slipstream.zero.offload import OffloadedStep

__all__ = [
    "PhasedPublish",
    "StepOutcome",
    "ZeroOptimizer",
    "step_unless_nonfinite",
    "supports_device_skip",
    "take_sharded_step",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """What one step did: skipped for an inf or nan (known on the host), and the grad norm.

    ``skipped``: when the skip was decided on the device (``defer_skip``), a 0-d float
    flag there (1.0: the update was not applied; weights and optimizer state are unchanged),
    and ``overflow`` is False; the caller reads it when it needs the answer (see
    [Note: the skip decided on the device]). None: ``overflow`` is the answer.
    """

    overflow: bool
    grad_norm: torch.Tensor | None
    skipped: torch.Tensor | None = None


def supports_device_skip(optimizer: Any) -> bool:
    """Whether ``optimizer.step()`` can skip itself on a device flag (``found_inf``).

    torch's fused optimizers (Adam, AdamW, SGD, Adagrad with ``fused=True``) read
    ``found_inf`` in their kernels, as ``torch.amp.GradScaler`` uses them: on a non-finite
    step nothing is written, and their step counters are put back.
    """
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def step_unless_nonfinite(
    optimizer: Any, found_inf: torch.Tensor | None, grad_scale: torch.Tensor | None = None
) -> None:
    """``optimizer.step()``, a no-op on the device when ``found_inf`` (0-d float) is 1.

    ``grad_scale`` (0-d fp32 on the device): the optimizer divides every gradient by it in
    its kernel and stores the result back as the gradient, as under ``torch.amp.GradScaler``
    (the contract of ``_step_supports_amp_scaling``); None: the gradients as they are.
    ``found_inf`` None: no skip flag.

    [Note: the skip decided on the device] The non-finite vote leaves a flag on the
    device; reading it before stepping would stall the host until the device has finished
    the backward pass (a device->host sync every step). A fused optimizer takes the flag
    into its kernels instead, so the host goes on queueing the next forward. What depends
    on the answer on the host (the LR schedule, the fp16 loss scale, the count of skipped
    steps) reads the flag later, when the device is long past it (the engine: before the
    next backward, or at a log line).
    """
    if not supports_device_skip(optimizer):
        raise TypeError(
            f"{type(optimizer).__name__} cannot skip its step on a device flag; check "
            "supports_device_skip(optimizer) and read the flag on the host instead"
        )
    optimizer.found_inf = found_inf.to(torch.float32) if found_inf is not None else None
    optimizer.grad_scale = grad_scale
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf
        del optimizer.grad_scale


def take_sharded_step(
    optimizer: torch.optim.Optimizer,
    grads: list[torch.Tensor],
    group: DataParallelGroup,
    device: torch.device,
    *,
    loss_scale: float | None = None,
    max_grad_norm: float = 0.0,
    grad_norm: torch.Tensor | None = None,
    nonfinite_check: torch.Tensor | None = None,
    defer_skip: bool = False,
    grad_squares: torch.Tensor | None = None,
    local_total: torch.Tensor | None = None,
    phased: PhasedPublish | None = None,
    masters: Sequence[torch.Tensor] = (),
) -> StepOutcome:
    """The update every on-device gradient path takes: vote, unscale, norm, clip, step.

    ``grads`` are this rank's gradient shards; over ``group`` they hold every gradient element
    once (a single data-parallel group, or several groups whose shards tile the world: dense
    shards over the data-parallel ranks plus expert shards over their expert-data-parallel
    and expert-parallel ranks). The caller publishes the updated shards when the step was
    taken.

    [Note: one collective per step] The non-finite vote (fp16 overflow, or ``nonfinite_check``
    under fp32/bf16) rides on the norm's all-reduce: an inf or nan in any rank's gradient
    makes the summed squares non-finite, and ``nonfinite_check * 0`` adds a non-finite loss
    to them without changing a finite sum (under fp16 too: a tensor-parallel caller passes
    the tensor group's own vote there). One scalar all-reduce and one host read decide
    the skip on every rank (before: a MAX all-reduce with its host read, then the norm's
    all-reduce). Under fp16 the squares are of the scaled gradients and the norm is divided
    by the scale, which is exact for the power-of-two scales of the dynamic scaler.

    ``defer_skip`` with an optimizer that :func:`supports_device_skip`: the vote is not read
    on the host; the optimizer skips on the device flag, returned as ``StepOutcome.skipped``
    ([Note: the skip decided on the device]). Otherwise the host reads it here.

    ``grad_squares``: the sum of squares of the (scaled) gradients that the caller has
    already all-reduced over every rank holding a piece of the model, e.g. a pipeline's,
    summed over the data-parallel group and then over the stages, which ``group`` does not
    reach. It replaces this function's own sum and all-reduce, carries the vote (an inf or
    nan on any of those ranks makes it non-finite everywhere; a ``nonfinite_check`` must be
    folded into it before its all-reduce, and then only asks for the vote) and gives the
    norm. The step then takes no collective.

    ``local_total``: this rank's sum of squares of ``grads``, already taken (equal to
    :func:`~slipstream.zero.norms.local_squares` of them; the stage-1/2 reducer takes it while
    the last reduce-scatter travels): used in its place, not changed.

    ``phased`` (with ``masters``, the optimizer's parameters indexed as its phases are): the
    optimizer steps one publish phase's masters at a time and publishes each as soon as it
    is stepped (:class:`PhasedPublish`), so the publish of one phase overlaps the step of the
    next. The update is the same (an elementwise optimizer, one step per parameter).
    """
    vote = loss_scale is not None or nonfinite_check is not None
    on_device = vote and defer_skip and supports_device_skip(optimizer)
    total: torch.Tensor | None = None
    found_inf: torch.Tensor | None = None
    if grad_squares is not None:
        total = grad_squares.detach().float().to(device)
    elif grad_norm is None or vote:
        total = local_total.clone() if local_total is not None else local_squares(grads, device)
        if nonfinite_check is not None:
            total = total + nonfinite_check.detach().float().to(device) * 0.0
        group.sum_(total)
    if vote:
        assert total is not None
        if on_device:
            found_inf = (~torch.isfinite(total)).to(torch.float32)
        elif not bool(torch.isfinite(total)):  # the step's one host sync
            return StepOutcome(overflow=True, grad_norm=None)
    unscale_grads_(grads, loss_scale)
    if grad_norm is not None:
        norm = grad_norm
    else:
        assert total is not None
        norm = norm_of_squares(total, loss_scale)
    clip_and_step(optimizer, grads, norm, max_grad_norm, found_inf, phased=phased, masters=masters)
    return StepOutcome(overflow=False, grad_norm=norm, skipped=found_inf)


def unscale_grads_(grads: list[torch.Tensor], loss_scale: float | None) -> None:
    """Undo an fp16 loss scale on the gradients in place (nothing without one)."""
    if loss_scale is not None and loss_scale != 1.0 and grads:
        torch._foreach_mul_(grads, 1.0 / loss_scale)


def clip_and_step(
    optimizer: torch.optim.Optimizer,
    grads: list[torch.Tensor],
    norm: torch.Tensor | None,
    max_grad_norm: float,
    found_inf: torch.Tensor | None,
    *,
    phased: PhasedPublish | None = None,
    masters: Sequence[torch.Tensor] = (),
) -> None:
    """The tail every on-device gradient path shares (:func:`take_sharded_step`, the
    replicated stage-0 path): clip the unscaled ``grads`` to ``max_grad_norm`` by the global
    ``norm`` (None: no clipping), then step, skipping on the device flag ``found_inf`` when
    given (only for an optimizer that :func:`supports_device_skip`), phase by phase with
    ``phased`` (see :func:`take_sharded_step`)."""
    clipping = bool(grads) and norm is not None and max_grad_norm > 0
    clipping = clipping and not math.isinf(max_grad_norm)
    grad_scale = None
    if clipping and supports_device_skip(optimizer):
        # [Note: clipping inside the fused step] A fused optimizer divides the gradients by
        # ``grad_scale`` as it reads them (GradScaler's unscale) and stores them back: the
        # clip factor goes in as its inverse, and the pass that scaled every gradient shard
        # before the step (a read and a write of each, ~1.3 ms per step at 1.3B on 2 ranks)
        # is gone. The gradients end as clipped as before (to within fp32 rounding: g / (1/c)
        # for g * c).
        assert norm is not None
        grad_scale = (1.0 / clip_coefficient(norm, max_grad_norm)).to(torch.float32)
    elif clipping:
        assert norm is not None
        clip_grads_(grads, norm, max_grad_norm)

    def update() -> None:
        if found_inf is not None or grad_scale is not None:
            step_unless_nonfinite(optimizer, found_inf, grad_scale)
        else:
            optimizer.step()

    if phased is None:
        update()
    else:
        phased.begin()
        for phase, indices in enumerate(phased.phases):
            with _stepping_only(optimizer, {id(masters[i]) for i in indices}):
                update()
            phased.publish(phase)
        phased.end()


@contextmanager
def _stepping_only(optimizer: torch.optim.Optimizer, members: set[int]) -> Iterator[None]:
    """Within: every parameter group of ``optimizer`` holds only the parameters whose ids
    are in ``members`` (the others are left out of its step), in their order."""
    saved = [group["params"] for group in optimizer.param_groups]
    try:
        for group, params in zip(optimizer.param_groups, saved):
            group["params"] = [p for p in params if id(p) in members]
        yield
    finally:
        for group, params in zip(optimizer.param_groups, saved):
            group["params"] = params


@dataclass(frozen=True, slots=True)
class PhasedPublish:
    """A publish that goes phase by phase behind a step taken phase by phase
    (:func:`take_sharded_step`): ``begin()``, then for each phase (master indices, in
    order) the step of its masters and ``publish(phase)``, then ``end()``. Only when the
    step is taken: a skip decided on the host publishes nothing."""

    phases: list[list[int]]
    begin: Callable[[], None]
    publish: Callable[[int], None]
    end: Callable[[], None]


class ZeroOptimizer:
    """Runs a torch optimizer on master shards and publishes the result to the model.

    The gradient path (stage 1/2 reduce-scatter, stage 3 per-module hooks) fills
    ``masters[i].grad`` with the averaged gradient shard; :meth:`step` then

    1. votes on fp16 overflow across ranks (no rank sees every gradient),
    2. unscales by the loss scale, takes the global norm (one scalar all-reduce) and clips,
    3. steps the wrapped optimizer (its states exist for the shards only),
    4. calls ``publish()``: stages 1-2 all-gather the shards into the full parameters,
       stage 3 refreshes the 16-bit parameter shards.

    With optimizer offload (``offload``), the masters and their gradients are in host memory:
    the norm and the overflow vote still take one scalar collective on the device, and step
    3 runs on the CPU with the loss scale and the clip coefficient folded into the kernel's
    read of each gradient (no separate pass over them).

    It duck-types the parts of ``torch.optim.Optimizer`` that schedulers and loops use
    (``param_groups``, ``state``, ``zero_grad``) by forwarding to the wrapped optimizer.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        masters: ShardedMasterWeights,
        group: DataParallelGroup,
        publish: Callable[[], None],
        device: torch.device,
        offload: OffloadedStep | None = None,
        step_and_publish: Callable[[float], None] | None = None,
        publish_all: Callable[[], None] | None = None,
        complete: Callable[[], None] | None = None,
    ) -> None:
        self.optimizer = optimizer
        # Offload: the stage's own pipelined step + publish (given ``grad_scale``), if it has one.
        self._step_and_publish = step_and_publish
        self.masters = masters
        self.group = group
        self._publish = publish
        # Publishes every parameter whatever was published during backward (``publish``
        # may skip what a step during backward already did).
        self._publish_all = publish_all or publish
        self.device = device
        self.offload = offload
        # Offload with overlap_forward: finishes a step whose last buckets still run on the
        # CPU (publishes them, commits); a no-op otherwise.
        self._complete = complete or (lambda: None)
        # Stages 1-2 with the copy-engine publish: the step goes phase by phase and each
        # phase is published as soon as it is stepped (set by the stage; None: one step,
        # then ``publish``).
        self.phased: PhasedPublish | None = None

    @property
    def param_groups(self) -> list[dict]:
        """The wrapped optimizer's parameter groups (holding the master shards)."""
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        """The wrapped optimizer's per-shard state."""
        return self.optimizer.state  # type: ignore[return-value]

    def step(
        self,
        loss_scale: float | None = None,
        max_grad_norm: float = 0.0,
        grad_norm: torch.Tensor | None = None,
        nonfinite_check: torch.Tensor | None = None,
        defer_skip: bool = False,
        grad_squares: torch.Tensor | None = None,
    ) -> StepOutcome:
        """Take one update from the reduced gradient shards; skip it on an fp16 overflow.

        ``grad_norm``: the global norm of the (unscaled) gradients when the caller has computed
        it, e.g. a pipeline's norm, which also spans the other stages this group does not
        reach. None: computed here from the shards over the data-parallel group.

        ``nonfinite_check``: without a loss scale (fp32, bf16), a device scalar (e.g. the sum
        of this rank's losses since the last step) that asks for the same vote fp16 takes:
        when it or any rank's gradient holds an inf or nan, every rank skips the step
        (``StepOutcome.overflow`` is then True). With a loss scale it joins fp16's overflow
        vote (a tensor-parallel caller's vote over ranks this group does not reach). None: no
        check.

        ``defer_skip``: decide the skip on the device where the optimizer can
        (:func:`take_sharded_step`; not with offload, whose CPU step needs the answer).

        ``grad_squares``: the caller's all-reduced sum of squares of the gradients, spanning
        ranks this group does not reach (a pipeline's stages); it carries the vote and gives
        the norm (:func:`take_sharded_step`), with offload too.
        """
        if self.offload is not None and self.offload.tail_kept:
            self._complete()  # the last step still ran (two steps without a forward between)
        grads = self.masters.grads()
        if self.offload is None:
            landed = self.masters.landed_squares
            self.masters.landed_squares = None
            local_total = (
                landed.total
                if landed is not None and grad_squares is None and landed.covers(grads)
                else None
            )
            outcome = take_sharded_step(
                self.optimizer,
                grads,
                self.group,
                self.device,
                loss_scale=loss_scale,
                max_grad_norm=max_grad_norm,
                grad_norm=grad_norm,
                nonfinite_check=nonfinite_check,
                defer_skip=defer_skip,
                grad_squares=grad_squares,
                local_total=local_total,
                phased=self.phased,
                masters=self.masters.masters,
            )
            if not outcome.overflow and self.phased is None:
                # After a skip decided on the device the masters are unchanged: publishing
                # them again rewrites the same values. (A phased step published already.)
                self._publish()
            return outcome
        if grad_squares is not None:
            # The caller's squares span every rank (and carry its vote): no collective here.
            given_squares = grad_squares.detach().float()
            if (loss_scale is not None or nonfinite_check is not None) and not bool(
                torch.isfinite(given_squares)
            ):
                return self._overflow()
            given = (
                grad_norm if grad_norm is not None else norm_of_squares(given_squares, loss_scale)
            )
            return self._offloaded_step(grads, loss_scale, max_grad_norm, given)
        squares = self.masters.device_squares
        votes = loss_scale is not None or nonfinite_check is not None
        if squares is None and votes and self.masters.vote_squares is not None:
            # Gradient accumulation at stage 2: no device sum of squares of the accumulated
            # grads, but every reduction's, added up, is non-finite whenever they are
            # (masters.py): the vote rides on it, with no pass over the host gradients (one
            # costs about as much as a CPU step). The norm, if clipping asks for it, still
            # reads them.
            voted = self.masters.vote_squares.detach().clone()
            if nonfinite_check is not None:
                voted = voted + nonfinite_check.detach().float().to(voted.device) * 0.0
            self.group.sum_(voted)
            if not bool(torch.isfinite(voted)):
                return self._overflow()
            return self._offloaded_step(grads, loss_scale, max_grad_norm, grad_norm)
        if (
            squares is None
            and loss_scale is None
            and nonfinite_check is not None
            and overflow_on_any_rank([*grads, nonfinite_check.detach()], self.group, self.device)
        ):
            # No sum of squares from the device (a gradient that reached the masters some
            # other way): the vote reads the host gradients.
            return self._overflow()
        if self.offload is not None and squares is not None:
            # Offload: the reducer took the sum of squares on the device; an inf or nan in
            # any gradient makes it non-finite (one scalar, no pass over the host grads).
            total = self.masters.global_squares
            if total is None:
                total = squares.detach().clone()
                if nonfinite_check is not None:  # fp16: joins the overflow vote
                    total = total + nonfinite_check.detach().float().to(total.device) * 0.0
                self.group.sum_(total)
            elif nonfinite_check is not None:
                # The total was reduced at the end of backward already: this rank's check
                # joins the vote through a scalar sum of its own (nan on any rank: nan on all).
                flag = nonfinite_check.detach().float().to(total.device) * 0.0
                self.group.sum_(flag)
                total = total + flag
            # fp16's overflow, or (bf16/fp32 with nonfinite_check) an inf or nan loss or
            # gradient on any rank: an inf or nan gradient makes its sum of squares non-finite.
            vote = loss_scale is not None or nonfinite_check is not None
            if vote and not bool(torch.isfinite(total)):
                return self._overflow()
            norm = norm_of_squares(total, loss_scale)
            given = grad_norm if grad_norm is not None else norm
            return self._offloaded_step(grads, loss_scale, max_grad_norm, given)
        checks = [nonfinite_check.detach()] if nonfinite_check is not None else []
        if loss_scale is not None and overflow_on_any_rank(
            [*grads, *checks], self.group, self.device
        ):
            return self._overflow()
        return self._offloaded_step(grads, loss_scale, max_grad_norm, grad_norm)

    def _overflow(self) -> StepOutcome:
        """An fp16 overflow skips the step: a speculative step taken during backward is
        discarded, and the weights it published are published again from the masters."""
        offload = self.offload
        if offload is not None and offload.eager and offload.take_eager_steps() > 0:
            raise RuntimeError(
                "an inf or nan gradient was already applied to the masters: "
                "offload_optimizer.overlap_step steps each bucket during backward, before the "
                "step can be skipped. The weights are no longer finite; resume from the last "
                "checkpoint, and set offload_optimizer.overlap_step to false to have such "
                "steps skipped"
            )
        if offload is not None and offload.speculative and offload.take_eager_steps() > 0:
            offload.settle_speculation(None)
            self._publish_all()
        return StepOutcome(overflow=True, grad_norm=None)

    def _offloaded_step(
        self,
        grads: list[torch.Tensor],
        loss_scale: float | None,
        max_grad_norm: float,
        grad_norm: torch.Tensor | None,
    ) -> StepOutcome:
        assert self.offload is not None
        if self.offload.speculative:
            return self._settle_speculative_step(grads, loss_scale, max_grad_norm, grad_norm)
        if self.offload.eager:
            # Every bucket was stepped during backward, as it reached the host.
            if loss_scale is not None or (max_grad_norm > 0 and not math.isinf(max_grad_norm)):
                raise RuntimeError(
                    "offload overlap_step stepped during backward, but this step asks for "
                    "gradient clipping or loss scaling, which need the global norm first; "
                    "build the settings with overlap_step=False"
                )
            if self.offload.take_eager_steps() == 0 and grads:
                self.offload.step(grad_scale=1.0)  # no bucket was marked final: step now
            self.offload.keep_tail()  # overlap_forward: the last buckets finish in forward
            self.offload.step_device(1.0)
            self._publish()
            norm = (
                grad_norm
                if grad_norm is not None
                else global_grad_norm(grads, self.group, self.device)
            )
            return StepOutcome(overflow=False, grad_norm=norm)
        norm, scale = self._norm_and_scale(grads, loss_scale, max_grad_norm, grad_norm)
        self.offload.step_device(scale)
        return self._step_after_backward(norm, scale)

    def _norm_and_scale(
        self,
        grads: list[torch.Tensor],
        loss_scale: float | None,
        max_grad_norm: float,
        grad_norm: torch.Tensor | None,
    ) -> tuple[torch.Tensor, float]:
        """The global norm and the factor the step applies to the gradients (unscale x clip)."""
        unscale = unscale_factor(loss_scale)
        if grad_norm is not None:
            norm = grad_norm
        else:
            norm = global_grad_norm(grads, self.group, self.device)
            if unscale != 1.0:
                norm = norm * unscale
        scale = unscale
        if grads and max_grad_norm > 0 and not math.isinf(max_grad_norm):
            scale *= float(clip_coefficient(norm, max_grad_norm))
        return norm, scale

    def _settle_speculative_step(
        self,
        grads: list[torch.Tensor],
        loss_scale: float | None,
        max_grad_norm: float,
        grad_norm: torch.Tensor | None,
    ) -> StepOutcome:
        """The buckets were (or were not) stepped speculatively during backward, as if the
        factor were 1: keep that step when it is exactly the one to take, else step again."""
        assert self.offload is not None
        speculated = self.offload.take_eager_steps() > 0
        self.offload.clip_hint = max_grad_norm  # what the next backward checks early
        norm, scale = self._norm_and_scale(grads, loss_scale, max_grad_norm, grad_norm)
        self.offload.step_device(scale)  # partial offload: before anything publishes
        if speculated:
            if self.offload.settle_speculation(scale):
                self._publish()  # done bucket by bucket in finish(): nothing left
                return StepOutcome(overflow=False, grad_norm=norm)
            stats = self.offload.speculation
            if stats.discarded == 1 and self.group.rank == 0:
                logger.info(
                    "speculative CPU step discarded (grad norm %.4g, clip factor %.4g): "
                    "stepped again after backward; this costs time only while the norm "
                    "exceeds gradient_clipping (%s)",
                    float(norm),
                    scale,
                    stats,
                )
        return self._step_after_backward(norm, scale)

    def _step_after_backward(self, norm: torch.Tensor, scale: float) -> StepOutcome:
        assert self.offload is not None
        if self._step_and_publish is not None:
            self._step_and_publish(scale)
        else:
            self.offload.step(grad_scale=scale)
            self._publish()
        return StepOutcome(overflow=False, grad_norm=norm)

    def resident(self) -> Any:
        """A context in which every master and optimizer state is in host memory.

        Only NVMe offload swaps them out; checkpoint code reads and writes them inside it.
        A step still finishing on the CPU (overlap_forward) is finished first.
        """
        self._complete()
        return self.offload.resident() if self.offload is not None else nullcontext()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the master gradients (always set to None)."""
        self.abandon_speculation()  # finishes a step still running first
        self.masters.zero_grad()

    def abandon_speculation(self) -> None:
        """Offload: drop a speculative step that backward took and no step settled (its
        gradients are being dropped): the model gets the unchanged masters back."""
        self._complete()
        if self.offload is not None and self.offload.discard_speculation():
            self._publish_all()
