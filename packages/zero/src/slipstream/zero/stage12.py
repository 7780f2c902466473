"""ZeRO stages 1 and 2 over a plain module: sharded optimizer states (1) and gradients (2)."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from slipstream.zero.grad_reduce import EagerBucketStep, GradientReduceScatter
from slipstream.zero.gradient_path import GradientPathMixin
from slipstream.zero.group import DataParallelGroup
from slipstream.zero.layout import ShardSpec
from slipstream.zero.masters import ShardedMasterWeights
from slipstream.zero.norms import clip_coefficient, norm_of_squares
from slipstream.zero.optimizer import PhasedPublish, ZeroOptimizer
from slipstream.zero.param_gather import (
    PendingPublish,
    gather_bucket,
    gather_packed,
    pack_bucket,
    plan_gather_buckets,
    start_gather,
)
from slipstream.zero.peer_publish import PeerPublish, peer_publish_unavailable
from slipstream.zero.settings import ZeroSettings

__all__ = ["ShardedOptimizerStates"]

logger = logging.getLogger(__name__)


def _steps_each_parameter_alone(optimizer: torch.optim.Optimizer) -> bool:
    """Whether stepping ``optimizer`` over a part of its parameters at a time gives the one
    update: torch's Adam/AdamW/SGD and slipstream's FusedAdam keep every count per parameter.
    Others may count steps per group or per call (apex's and DeepSpeed's FusedAdam keep
    ``group["step"]``): those step whole."""
    from slipstream.kernels.optim import FusedAdam

    return type(optimizer) in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, FusedAdam)


class ShardedOptimizerStates(GradientPathMixin):
    """ZeRO stage 1 or 2 for ``params`` (the module keeps full, replicated parameters).

    Stage 1: gradients accumulate locally over the gradient-accumulation micro-steps (in
    fp32 when the module is fp16/bf16, as stage 0 does); at the boundary they are
    reduce-scattered, bucket by bucket, into the fp32 gradient of this rank's master shard,
    and the full-size gradients are dropped.

    Stage 2: every backward reduce-scatters each gradient into the owned shard as soon as
    it is ready (overlapped with the rest of backward when ``overlap_comm``), accumulating
    there across micro-steps; no full-size gradient outlives its bucket.

    Both: the optimizer updates only the master shards; the updated shards are all-gathered
    back into the parameters (cast to the module's dtype) after each step.

    Several instances may share one optimizer, each over its own parameters and group
    (``strict_optimizer=False`` leaves the other instances' parameters in the optimizer);
    ``gradient_divisor`` averages the reduce-scatter over that many ranks instead of the
    group's size (expert parameters: their expert-data-parallel group sums, the whole
    data-parallel world divides). The caller then steps them together (one norm, one
    optimizer step, every instance's ``_publish``), as slipstream's engine does for MoE.
    ``caller_sums_squares``: every step gets the caller's ``grad_squares`` (a pipeline sums
    them across its stages), so the reducer does not take its own as the last bucket lands.

    >>> zero = ShardedOptimizerStates(list(model.parameters()), optimizer, ZeroSettings(stage=2))
    >>> loss.backward(); zero.finish_backward(is_boundary=True)
    >>> zero.optimizer.step(); zero.optimizer.zero_grad()
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        optimizer: torch.optim.Optimizer,
        settings: ZeroSettings,
        group: DataParallelGroup | None = None,
        *,
        gradient_divisor: int | None = None,
        strict_optimizer: bool = True,
        caller_sums_squares: bool = False,
    ) -> None:
        if settings.stage not in (1, 2):
            raise ValueError(
                f"ShardedOptimizerStates implements stages 1 and 2, got stage {settings.stage}; "
                "use slipstream.zero.shard_parameters for stage 3"
            )
        self.settings = settings
        self.group = group or DataParallelGroup.of()
        self.params = [p for p in params if p.requires_grad]
        rank, world = self.group.rank, self.group.world_size
        self.specs = [ShardSpec(p.shape, world) for p in self.params]
        shards = [spec.shard_of(p, rank) for p, spec in zip(self.params, self.specs)]
        offload = settings.offload_optimizer
        offloaded = None
        if offload is not None:
            from slipstream.zero.offload import offloaded_flags

            offloaded = offloaded_flags([s.shard_numel for s in self.specs], offload.ratio)
        self.masters = ShardedMasterWeights(
            self.params,
            self.specs,
            shards,
            device=torch.device("cpu") if offload is not None else None,
            pin=offload is not None and offload.pin_memory,
            own_storage=offload is not None and offload.device == "nvme",
            offloaded=offloaded,
        )
        del shards
        self.masters.swap_into(optimizer, strict=strict_optimizer)
        device = self.params[0].device if self.params else torch.device("cpu")
        # NVMe offload: the CPU step writes each updated shard in the model's dtype into a
        # host staging buffer (pinned with pin_memory), which the all-gather then uploads.
        self._staging: list[torch.Tensor] | None = None
        self._upload_stream: torch.cuda.Stream | None = None  # overlap_forward: _stage_upload's
        step = None
        pipelined = None
        if offload is not None:
            if not strict_optimizer:
                raise NotImplementedError(
                    "optimizer offload with an optimizer shared between several ZeRO "
                    "instances (expert-parallel MoE) is not supported yet; use ep_size=1 or "
                    "no offload_optimizer"
                )
            from slipstream.zero.offload import OffloadedStep

            # CPU offload publishes the fp32 masters themselves: the all-gather uploads them
            # and casts to the model's dtype on the device. Writing a model-dtype copy on the
            # CPU instead costs the memory-bound CPU step 2 more bytes per element, plus the
            # read-for-ownership of the copy's lines, against the 2 more bytes per element
            # that the upload reads (docs/offload.md, "What the all-gather uploads"). NVMe
            # swaps the masters out after the step, before the all-gather, so it stages
            # copies. A master kept on the device (partial offload) publishes itself.
            # upload_model_dtype: the CPU step writes the copies too (2 more bytes per element
            # for bf16) and the upload moves half the bytes: the copy engines, which share the
            # host memory with the CPU step, then hold the next forward up less
            # (overlap_forward; docs/offload.md).
            copies: dict[int, torch.Tensor] = {}
            staged = offload.device == "nvme" or (
                offload.upload_model_dtype and any(p.dtype.itemsize < 4 for p in self.params)
            )
            if staged:
                self._staging = [
                    self.masters.host_empty(m.shape, p.dtype) if out else m
                    for m, p, out in zip(self.masters.masters, self.params, self.masters.offloaded)
                ]
                copies = {
                    id(m): c
                    for m, c, out in zip(
                        self.masters.masters, self._staging, self.masters.offloaded
                    )
                    if out
                }
            step = OffloadedStep(
                optimizer,
                self.masters,
                offload,
                self.group,
                copies,
                speculate=offload.speculative_step,
                device=device,  # gpu_share: where that share of the CPU step's elements steps
            )
            if offload.device == "cpu" and not step.eager:
                pipelined = self._step_and_publish
        self._offload_step = step
        self._gather_plan = plan_gather_buckets(
            self.specs, settings.allgather_bucket_numel, self.masters.offloaded
        )
        # publish_transport "copy_engine": the parameters move into a symmetric-memory buffer
        # and each publish pulls the other ranks' shards with peer copies (peer_publish.py);
        # anywhere that cannot (CPU, gloo, several hosts, offload) keeps the all-gathers.
        # "auto" (the default): the copy engines where they work, for an instance that
        # publishes on its own (not one of several over a shared optimizer, not offload).
        self._peer: PeerPublish | None = None
        self.publish_fallback = ""  # why "copy_engine"/"auto" fell back ("" when it did not)
        transport = settings.publish_transport
        if transport == "auto" and (offload is not None or not strict_optimizer):
            transport = "collective"
            self.publish_fallback = (
                "optimizer offload publishes from host memory (offload_optimizer)"
                if offload is not None
                else "several ZeRO instances share one optimizer (expert parallelism)"
            )
        if transport in ("copy_engine", "auto"):
            why = peer_publish_unavailable(self.params, self.group, offload=offload is not None)
            if why:
                self.publish_fallback = why
                if self.group.rank == 0:
                    # Asked for by name: say why not at info; "auto" only at debug.
                    logger.log(
                        logging.INFO if transport == "copy_engine" else logging.DEBUG,
                        'publish_transport "%s" publishes with all-gathers: %s',
                        transport,
                        why,
                    )
            else:
                self._peer = PeerPublish(self.params, self.specs, self.group)
                if self.group.rank == 0:
                    logger.info(
                        "publish_transport copy_engine: parameters in a %.2f GiB symmetric "
                        "buffer per rank; updated shards are pulled with peer copies",
                        self._peer.buffer_bytes / 2**30,
                    )
        self.optimizer = ZeroOptimizer(
            optimizer,
            self.masters,
            self.group,
            self._publish,
            device,
            offload=step,
            step_and_publish=pipelined,
            publish_all=self.publish,
            complete=self.complete_step,
        )
        if (
            self._peer is not None
            and step is None
            and strict_optimizer
            and _steps_each_parameter_alone(optimizer)
        ):
            # The step goes phase by phase, and each phase's pulls run while the next one
            # steps: the publish that follows the step shrinks to the last phase's pulls.
            peer = self._peer
            self.optimizer.phased = PhasedPublish(
                phases=[list(phase) for phase in peer.phases],
                begin=peer.begin,
                publish=lambda phase: peer.start_phase(phase, self._publish_sources),
                end=self._end_phased_publish,
            )

        # Stage 1 under fp16/bf16: fp32 full-size accumulators, so GAS sums in fp32.
        self._accumulate_fp32 = settings.stage == 1 and any(
            p.dtype != torch.float32 for p in self.params
        )
        self._fp32_grads: list[torch.Tensor | None] = [None] * len(self.params)
        bucket_numel = settings.reduce_bucket_numel
        during_backward = step is not None and (step.eager or step.speculative)
        if during_backward:
            # A bucket's CPU step starts only once the whole bucket has landed: smaller buckets
            # start the CPU sooner in backward and leave less after it.
            assert offload is not None
            capped = min(bucket_numel, offload.overlap_bucket_numel)
            if capped < bucket_numel and self.group.rank == 0:
                logger.info(
                    "CPU step during backward: reduce buckets of %s elements "
                    "(offload_optimizer.overlap_bucket_size; reduce_bucket_size is %s)",
                    f"{capped:,}",
                    f"{bucket_numel:,}",
                )
            bucket_numel = capped
        eager = None
        if step is not None and during_backward:
            # overlap_step (exact) or a speculative step (under clipping): each bucket's
            # masters step on the CPU worker as it lands, and are published (upload +
            # all-gather) as soon as finish() sees that step done, while the worker steps the
            # buckets after it. A discarded speculative step is stepped and published again.
            # gpu_share: the streamed share of each bucket reads the bucket's gradients where
            # they were reduced and keeps its new values on the device for the publish, so
            # those elements need no host read of the gradient and no upload (8 of the 32
            # host bytes per element of the CPU step; docs/offload.md).
            streams = step.streams and self._staging is None
            if streams:
                dtypes = {p.dtype for p in self.params}
                keep_dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
                step.keep_for_publish(keep_dtype)
                if self.group.rank == 0:
                    share = step.host.gpu_share
                    shard = sum(s.shard_numel for s in self.specs)
                    logger.info(
                        "offload_optimizer.gpu_share %g: the streamed share of each bucket "
                        "reads its reduced gradient on the device (each bucket's reduction "
                        "held until its step) and is published from there (up to %.2f GiB of "
                        "new values held on the device until each bucket's publish)",
                        share,
                        shard * share * keep_dtype.itemsize / 2**30,
                    )
            elif step.streams and self._staging is not None and self.group.rank == 0:
                logger.warning(
                    "offload_optimizer.gpu_share has no effect with upload_model_dtype: the "
                    "CPU step writes every element's model-dtype copy"
                )
            eager = EagerBucketStep(
                submit=step.submit,
                step_indices=step.eager_indices if step.eager else step.speculate_indices,
                on_stepped=self._publish_stepped,
                before_stepped=self._check_speculation if step.speculative else None,
                lend_grads=step.lend_grads if streams else None,
            )
        reduce_group = self.group
        self.reduce_ctas_fallback = ""  # why reduce_scatter_max_ctas fell back ("" if not)
        if settings.reduce_scatter_max_ctas > 0:
            reduce_group, why = self.group.with_max_ctas(settings.reduce_scatter_max_ctas)
            self.reduce_ctas_fallback = why
            if why and self.group.rank == 0:
                logger.info("reduce_scatter_max_ctas has no effect: %s", why)
        self.reducer = GradientReduceScatter(
            self.masters,
            self.group,
            bucket_numel,
            grad_of=self._grad_of,
            release=self._release,
            overlap=settings.overlap_comm,
            communication_dtype=settings.communication_dtype,
            gradient_predivide_factor=settings.gradient_predivide_factor,
            prescale=settings.prescale_gradients,
            divisor=gradient_divisor,
            tail_numel=settings.tail_numel(offloaded=offload is not None),
            reduce_group=reduce_group,
            average_in_collective=settings.average_in_reduce_scatter,
            eager=eager,
            # Offload: a bf16 reduction stays bf16 on its way to the CPU step (one reduction
            # per step; accumulated ones are summed in fp32 as before).
            land_low_precision=step is not None and step.reads_low_precision_grads,
        )
        if self.reducer.average_fallback and self.group.rank == 0:
            logger.info(
                "average_in_reduce_scatter has no effect: %s", self.reducer.average_fallback
            )
        if step is not None and self.group.rank == 0:
            self._say_gradient_dtype()
        # The step's sum of squares taken as the last reduction lands (grad_reduce.py,
        # [Note: squares while the last bucket travels]): masters on the device, and this
        # instance's own optimizer step (ZeroOptimizer.step) that reads it.
        # Not when the caller passes its own ``grad_squares`` to every step (a pipeline's,
        # summed across the stages): the step would never read them.
        self._squares_at_landing = step is None and strict_optimizer and not caller_sums_squares
        # The buckets that stepped during backward were published in finish().
        self._eager_published = False
        self._reducing = settings.stage == 2
        # overlap_forward (see overlap_forward()): a zero_grad held back until the step that
        # still runs on the CPU is done.
        self._zero_pending = False
        self._forward_hooks: list[Any] = []
        # publish_during_forward: the all-gathers of the last step still in flight, in order.
        self._in_flight: list[PendingPublish] | None = None
        self._hooks = [
            p.register_post_accumulate_grad_hook(lambda p, i=i: self._on_grad(i))  # type: ignore[misc]
            for i, p in enumerate(self.params)
        ]

    def _say_gradient_dtype(self) -> None:
        """Offload: log the dtype gradients travel to the host in (and how to halve it)."""
        dtype = self.reducer.dtype
        if dtype == torch.bfloat16 and self.reducer.land_low_precision:
            logger.info("optimizer offload: gradients are reduced and sent to the host in bf16")
        elif dtype == torch.float32 and any(p.dtype == torch.bfloat16 for p in self.params):
            logger.info(
                "optimizer offload: gradients are reduced and sent to the host in fp32 (the "
                'default); "communication_data_type": "bf16" (DeepSpeed\'s default under bf16) '
                "halves those bytes, which the CPU step is bound by"
            )

    # ------------------------------------------------------------------ gradient path
    def _grad_of(self, index: int) -> torch.Tensor | None:
        accumulated = self._fp32_grads[index]
        return accumulated if accumulated is not None else self.params[index].grad

    def _release(self, index: int) -> None:
        self.params[index].grad = None
        self._fp32_grads[index] = None

    def _on_grad(self, index: int) -> None:
        # Stage 1 in fp16/bf16 accumulates in fp32 across micro-steps; a gradient reduced in
        # the backward that produced it (the boundary, with nothing accumulated before: every
        # step at gradient_accumulation_steps 1) goes straight from the parameter's .grad
        # into the fp32 bucket, whose copy casts it exactly as .to(float32) did, without a
        # full-size fp32 copy of every gradient (2x the model in bytes, per step).
        if self._accumulate_fp32 and not (self._reducing and self._fp32_grads[index] is None):
            param = self.params[index]
            grad = param.grad
            if grad is not None:
                acc = self._fp32_grads[index]
                if acc is None:
                    self._fp32_grads[index] = grad.to(torch.float32)
                else:
                    acc.add_(grad)
                param.grad = None
        if self._reducing:
            self.reducer.mark_ready(index)

    # ------------------------------------------------------------------ overlap_forward
    def overlap_forward(self, module: torch.nn.Module) -> bool:
        """CPU offload: let the optimizer step end during the next forward of ``module``.

        ``optimizer.step()`` then returns once the step is decided (global norm, clip, kept
        speculation) while the CPU still steps the last buckets of backward, newest first;
        a forward pre-hook on each submodule of ``module`` that owns parameters publishes their
        buckets (in a fixed order, the same on every rank) as the forward reaches them. So the
        first layers compute while the CPU steps the later ones. Between ``step()`` and that
        forward the parameters of buckets still stepping are the old ones: ``state_dict()``,
        checkpoints, the next backward, ``zero_grad()`` followed by ``step()``, and
        :meth:`complete_step` wait for the step first; a direct read of a parameter does not.
        Returns whether it is on (it needs the CPU step during backward: stages 1-2 with
        overlap_step or a speculative step, and the C++ CPU optimizer); says why not if not.
        """
        step = self._offload_step
        why = "optimizer offload to the CPU is off" if step is None else ""
        if step is not None and not why:
            why = step.enable_overlap_forward()
        if why:
            if self.group.rank == 0:
                logger.warning("offload_optimizer.overlap_forward has no effect: %s", why)
            return False
        assert step is not None
        self.reducer.defer_job = self._defer
        offload = self.settings.offload_optimizer
        early = offload is not None and offload.early_upload
        on_gpu = bool(self.params) and self.params[0].device.type == "cuda"
        if early and on_gpu:
            step.stage_upload = self._stage_upload
        position = {id(p): i for i, p in enumerate(self.params)}
        for sub in module.modules():
            owned = frozenset(
                position[id(p)] for p in sub.parameters(recurse=False) if id(p) in position
            )
            if owned:
                self._forward_hooks.append(
                    sub.register_forward_pre_hook(partial(self._before_forward, owned))
                )
        self._forward_hooks.append(
            module.register_state_dict_pre_hook(lambda *_: self.complete_step())
        )
        if self.group.rank == 0:
            logger.info(
                "offload_optimizer.overlap_forward: engine.step() returns while the CPU still "
                "steps the last buckets; each is published as the next forward reaches its "
                "parameters (read parameters in between through a forward, state_dict() or "
                "engine.wait_for_step())"
            )
        return True

    def _defer(self, indices: list[int], job: Any) -> None:
        assert self._offload_step is not None
        self._offload_step.defer(indices, job)
        self._offload_step.newest_first(True)  # backward is over: the first layers' next
        self._eager_published = True  # step() publishes only what stepped on the device

    def _before_forward(self, owned: frozenset[int], module: torch.nn.Module, args: Any) -> None:
        step = self._offload_step
        assert step is not None
        if not step.tail:
            return
        # Publish in the tail's order (the same on every rank) up to the last bucket this
        # module needs: every rank issues the same all-gathers in the same order.
        while step.tail and not owned.isdisjoint(step.tail_indices):
            step.publish_next(self._publish_stepped)
        if not step.tail:
            self.complete_step()

    def complete_step(self) -> None:
        """overlap_forward: wait for the buckets still stepping on the CPU, publish them, commit
        a kept speculative step and drop the gradients a ``zero_grad`` held back (nothing to
        do otherwise)."""
        self.finish_publish()
        step = self._offload_step
        if step is None or not (step.tail or step.tail_kept):
            return
        step.finish_tail(self._publish_stepped)
        if self._zero_pending:
            self._zero_pending = False
            self.masters.zero_grad()

    def prepare_backward(self, is_boundary: bool, loss_scale: float | None = None) -> None:
        """Say whether the next backward ends an accumulation cycle (stage 1 reduces only
        then), and the fp16 loss scale its gradients carry (a speculative step unscales)."""
        self.complete_step()  # overlap_forward: the last step's buckets, before this one lands
        if self._offload_step is not None:
            self._offload_step.newest_first(False)
            self._offload_step.expect_loss_scale(loss_scale)
        self._reducing = self.settings.stage == 2 or is_boundary
        # An eager offload step runs on the last reduction (a speculative one when wanted).
        self.reducer.boundary = is_boundary
        step = self._offload_step
        if is_boundary and step is not None and step.speculative:
            self.reducer.final = step.speculate_now()
        else:
            self.reducer.final = is_boundary

    def finish_backward(self, is_boundary: bool = True) -> None:
        """Complete the gradient reduction after ``loss.backward()`` (waits for the buckets)."""
        self.complete_step()  # a backward without prepare_backward (overlap_forward)
        if self.settings.stage == 2 or is_boundary:
            self.reducer.take_squares = is_boundary and self._squares_at_landing
            self.reducer.finish()
        self._reducing = self.settings.stage == 2

    def publish(self) -> None:
        """All-gather the master shards into the full parameters (after a load; the masters
        resident). NVMe: the staged model-dtype copies, which the step writes, are refreshed
        from the masters first."""
        self.complete_step()
        self._eager_published = False
        if self._staging is not None:
            with torch.no_grad():
                for staged, master in zip(self._staging, self.masters.masters):
                    if staged is not master:
                        staged.copy_(master)
        self._publish_all()

    def _step_and_publish(self, grad_scale: float) -> None:
        """CPU offload: step the masters one all-gather bucket at a time and launch that
        bucket's upload and all-gather at once (asynchronous on the device), so the transfers
        of one bucket overlap the CPU step of the next instead of following the whole step."""
        assert self._offload_step is not None
        self._eager_published = False  # whatever a discarded speculative step published
        shards = self._publish_sources
        for indices in self._gather_plan:
            self._offload_step.step_indices(indices, grad_scale)
            gather_bucket(shards, self.params, self.specs, self.group, indices)

    @property
    def _publish_sources(self) -> Sequence[torch.Tensor]:
        """What the all-gathers send: the model-dtype staging copies (NVMe), or the masters."""
        return self._staging if self._staging is not None else self.masters.masters

    def _publish(self) -> None:
        # ZeroOptimizer's publish after a step: with overlap_step, finish() has done it for
        # the offloaded masters; those kept on the device (partial offload) stepped just now.
        if self._eager_published:
            self._eager_published = False
            shards = self._publish_sources
            for indices in self._gather_plan:
                if not self.masters.offloaded[indices[0]]:  # a bucket kept on the device
                    gather_bucket(shards, self.params, self.specs, self.group, indices)
            return
        self._publish_all()

    def _end_phased_publish(self) -> None:
        """After a phased step: the publish is complete; land it now unless the next
        forward does (publish_during_forward)."""
        assert self._peer is not None
        self._eager_published = False
        self._peer.end()
        if self._in_flight is None:
            self._peer.land_all()

    @property
    def publish_transport(self) -> str:
        """How updated shards reach the other ranks: "copy_engine" or "collective"."""
        return "copy_engine" if self._peer is not None else "collective"

    def memory_report(self) -> dict[str, int]:
        """:meth:`GradientPathMixin.memory_report`, plus ``publish_buffer_<device>``: with the
        copy-engine publish the parameters live in a symmetric-memory buffer, which the
        caching allocator does not count (``torch.cuda.max_memory_allocated`` leaves it out:
        add this to it for the device's use)."""
        report = super().memory_report()
        if self._peer is not None:
            report[f"publish_buffer_{self._peer.device.type}"] = self._peer.buffer_bytes
        return report

    def _publish_all(self) -> None:
        shards = self._publish_sources
        if self._peer is not None:
            self._peer.start(shards)
            if self._in_flight is None:  # not overlapped with the forward: land it now
                self._peer.land_all()
            return
        if self._in_flight is not None:
            self.finish_publish()  # a publish nobody's forward needed yet
            for indices in self._gather_plan:
                send = pack_bucket(shards, self.params, indices)
                self._in_flight.append(
                    start_gather(send, self.params, self.specs, self.group, indices)
                )
            return
        for indices in self._gather_plan:
            gather_bucket(shards, self.params, self.specs, self.group, indices)

    # ------------------------------------------------------------------ publish in forward
    def publish_during_forward(self, module: torch.nn.Module) -> bool:
        """Let the all-gathers of updated shards overlap the next forward of ``module``.

        After a step every all-gather bucket is launched asynchronously and ``step()``
        returns; a forward pre-hook on each submodule of ``module`` that owns parameters
        lands the buckets (in order, the same on every rank) up to the last one it needs, so
        the first layers compute while the later buckets are still in flight (a submodule
        lands the parameters of its whole subtree; the root module, only its own: a root
        ``forward`` that reads a child's parameter without calling the child would see the
        old value). Until then those parameters hold the old values: ``state_dict()``, :meth:`complete_step`, the
        next backward and the next step land everything first; a direct read does not.
        Costs the gathered buffers of every bucket still in flight (up to the model's size
        in its dtype). Not with optimizer offload (which has ``overlap_forward``). Returns
        whether it is on.
        """
        if self._offload_step is not None:
            if self.group.rank == 0:
                logger.warning(
                    "publish_during_forward has no effect with optimizer offload (use "
                    "offload_optimizer.overlap_forward)"
                )
            return False
        self._in_flight = []
        position = {id(p): i for i, p in enumerate(self.params)}
        for sub in module.modules():
            # A module lands its whole subtree (a gate reading its child's weight without
            # calling the child is covered); the root only its own parameters, or nothing
            # would overlap.
            owned = frozenset(
                position[id(p)]
                for p in sub.parameters(recurse=sub is not module)
                if id(p) in position
            )
            if owned:
                self._forward_hooks.append(
                    sub.register_forward_pre_hook(partial(self._land_before_forward, owned))
                )
        self._forward_hooks.append(
            module.register_state_dict_pre_hook(lambda *_: self.finish_publish())
        )
        return True

    def _land_before_forward(
        self, owned: frozenset[int], module: torch.nn.Module, args: Any
    ) -> None:
        peer = self._peer
        if peer is not None:
            if peer.in_flight:
                peer.land(max(owned))
            return
        pending = self._in_flight
        if not pending:
            return
        last = max(
            (k for k, bucket in enumerate(pending) if not owned.isdisjoint(bucket.indices)),
            default=-1,
        )
        for _ in range(last + 1):
            pending.pop(0).finish()

    def finish_publish(self) -> None:
        """Land every all-gather still in flight (publish_during_forward)."""
        if self._peer is not None:
            self._peer.land_all()
        pending = self._in_flight
        while pending:
            pending.pop(0).finish()

    def _check_speculation(self, squares: list[torch.Tensor]) -> None:
        """End of backward: call the speculative step off if the global norm already says
        the step will clip (the last step's threshold assumed) or, under fp16, skip (an
        overflow), so that a discarded speculation costs only what ran during backward.
        Settling the step decides for sure."""
        step = self._offload_step
        assert step is not None
        limit = step.clip_hint
        if limit is not None and not 0 < limit < math.inf:
            limit = None  # no clipping
        if limit is None and step.loss_scale is None:
            return
        total = torch.stack([s.float() for s in squares]).sum()
        self.group.sum_(total)
        self.masters.global_squares = total  # the step's norm: not reduced a second time
        norm = norm_of_squares(total, step.loss_scale)
        if not bool(torch.isfinite(norm)):
            step.cancel_speculation()
        elif limit is not None and float(clip_coefficient(norm, limit)) < 1.0:
            step.cancel_speculation()

    def _publish_stepped(self, indices: list[int], staged: Any = None) -> None:
        step = self._offload_step
        if step is not None and step.cancelled:
            return  # called off: the step after backward publishes everything
        if staged is not None:  # overlap_forward: uploaded by _stage_upload
            send, uploaded = staged
            if uploaded is not None:
                stream = torch.cuda.current_stream(send.device)
                stream.wait_event(uploaded)
                send.record_stream(stream)
        else:
            send = pack_bucket(self._stepped_sources(indices), self.params, indices)
        gather_packed(send, self.params, self.specs, self.group, indices)
        self._eager_published = True

    def _stepped_sources(self, indices: list[int]) -> Sequence[Any]:
        """What a bucket stepped during backward publishes: per parameter a tensor, or the
        pieces that make it up (gpu_share: the host part and the part kept on the device)."""
        shards: Sequence[Any] = self._publish_sources
        step = self._offload_step
        if self._staging is None and step is not None and step.speculative:
            # CPU offload: the speculative step's new masters are in spare buffers.
            shards = list(shards)
            for i in indices:
                shards[i] = step.speculative_value(i)
        if self._staging is None and step is not None and step.streams:
            shards = list(shards)
            for i in indices:
                kept = step.take_kept(i)
                if kept is not None:
                    split, values = kept
                    shards[i] = (shards[i].view(-1)[:split], values)
        return shards

    def _stage_upload(self, indices: list[int]) -> tuple[torch.Tensor, Any]:
        """overlap_forward: a tail bucket's send buffer, packed (uploaded and cast) as soon
        as its CPU step is done, on the worker thread; on a GPU on a stream of its own, with
        the event its all-gather waits for. The compute stream is then busy with the forward,
        and an upload queued there would wait for the forward to reach the bucket."""
        device = self.params[indices[0]].device
        if device.type != "cuda":
            return pack_bucket(self._stepped_sources(indices), self.params, indices), None
        if self._upload_stream is None:
            self._upload_stream = torch.cuda.Stream(device)
        with torch.cuda.device(device), torch.cuda.stream(self._upload_stream):
            send = pack_bucket(self._stepped_sources(indices), self.params, indices)
            uploaded = torch.cuda.Event()
            uploaded.record(self._upload_stream)
        return send, uploaded

    def zero_grad(self) -> None:
        """Drop master gradients and any local full-size gradients."""
        step = self._offload_step
        if step is not None and step.tail_kept:
            # overlap_forward: the kept step's last buckets still read their gradients; they
            # are dropped when it is done (complete_step).
            self._zero_pending = True
            for i in range(len(self.params)):
                self._release(i)
            return
        self.optimizer.abandon_speculation()  # a step computed from the dropped gradients
        self.masters.zero_grad()
        for i in range(len(self.params)):
            self._release(i)

    def remove_hooks(self) -> None:
        """Detach from the parameters (the module keeps working as a plain module)."""
        self.complete_step()
        for handle in self._hooks + self._forward_hooks:
            handle.remove()
        self._hooks.clear()
        self._forward_hooks.clear()
