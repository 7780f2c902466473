"""The engine for a PipelineModule: DeepSpeed's ``train_batch`` / ``eval_batch`` loop.

Composed from ``slipstream.pipeline`` calls, in order: the config's ``pipeline`` and
``activation_checkpointing`` blocks are parsed; the module goes to its device and its
data-parallel replicas start from one set of weights; the optimizer and LR schedule are
resolved as for the plain engine; an executor is wired to the neighbouring stages; with
``zero_optimization.stage`` 1 or 2 the optimizer is re-homed onto fp32 master shards over the
stage's data-parallel group (slipstream.zero), at stage 0 it goes to the plain engine's
replicated gradient path over that group; and every ``train_batch`` runs the schedule, sums the
tied weights' gradients across stages, and hands the rest (data-parallel reduction, non-finite
vote, unscale, clip, optimizer step) to that gradient path, with the norm taken across stages.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from slipstream import comm
from slipstream.config import SlipstreamConfig, load_config, read_config_source
from slipstream.config.loading import ConfigSource
from slipstream.kernels import get_accelerator
from slipstream.kernels.config_schema import ConfigError, NotImplementedFeatureError
from slipstream.kernels.loss_scaler import LossScaler
from slipstream.monitor import MonitorMaster
from slipstream.pipeline import checkpointing as activation_checkpointing
from slipstream.pipeline.checkpointing import ActivationCheckpointingConfig
from slipstream.pipeline.config import PipelineConfig
from slipstream.pipeline.gradients import grad_squares_across_stages, reduce_tied_gradients
from slipstream.pipeline.module import PipelineModule
from slipstream.pipeline.runtime import (
    StepResult,
    aggregate_loss,
    build_executor,
    eval_batch,
)
from slipstream.pipeline.schedules import PipelineSchedule, build_schedule
from slipstream.runtime import zero_setup
from slipstream.runtime.lr_schedules import resolve_scheduler
from slipstream.runtime.optimizers import resolve_optimizer
from slipstream.runtime.step_flag import FlagCopy
from slipstream.runtime.tensor_parallel import check_tensor_parallel_support
from slipstream.zero import (
    DataParallelGroup,
    GradientPath,
    ReplicatedGradientPath,
    ShardedOptimizerStates,
    StepOutcome,
)

__all__ = ["PipelineEngine", "initialize_pipeline", "load_pipeline_config"]

logger = logging.getLogger(__name__)

_OWN_BLOCKS = ("pipeline", "activation_checkpointing")


def load_pipeline_config(
    source: ConfigSource, data_parallel_size: int
) -> tuple[SlipstreamConfig, PipelineConfig, ActivationCheckpointingConfig]:
    """Read a DeepSpeed config for a pipelined run.

    The ``pipeline`` and ``activation_checkpointing`` blocks are parsed by
    slipstream-pipeline's own blocks; the rest by :func:`slipstream.load_config`, whose batch
    triple is resolved for the ``data_parallel_size`` replicas (not the world size: the
    stages of one pipeline share a batch).

    >>> config, pipe, ckpt = load_pipeline_config(
    ...     {"train_batch_size": 8, "gradient_accumulation_steps": 4,
    ...      "pipeline": {"schedule": "zero_bubble"}}, data_parallel_size=1)
    >>> config.train_micro_batch_size_per_gpu, pipe.schedule
    (2, 'zero_bubble')
    """
    data, _ = read_config_source(source)
    pipeline = PipelineConfig.from_dict(data.pop("pipeline", None), "pipeline")
    checkpointing = ActivationCheckpointingConfig.from_dict(
        data.pop("activation_checkpointing", None), "activation_checkpointing"
    )
    return load_config(data, world_size=data_parallel_size), pipeline, checkpointing


class PipelineEngine:
    """Trains a :class:`PipelineModule` one whole batch at a time, as DeepSpeed's does.

    ``train_batch()`` pulls ``gradient_accumulation_steps`` micro-batches of
    ``(inputs, labels)`` from the data iterator (only the first and last stages read it),
    runs them through the configured schedule and takes one optimizer step; it returns the
    batch's mean loss on every rank. Build it with :func:`initialize_pipeline` (or
    ``slipstream.initialize`` once it dispatches pipeline modules here).

    >>> engine, _, _, _ = initialize_pipeline(model=pipeline_module, config=ds_config)  # doctest: +SKIP
    >>> for step in range(steps):  # doctest: +SKIP
    ...     loss = engine.train_batch(data_iter)

    Precision: ``bf16.enabled`` runs the stages under ``torch.autocast(bfloat16)`` with fp32
    weights and optimizer (a deviation from DeepSpeed, which casts the module); ``fp16.enabled``
    likewise runs ``torch.autocast(float16)``, with the config's loss scaler: the last stage
    scales the loss, every stage's gradients join one overflow vote (riding on the norm's sum
    of squares across the stages) before the step, which every rank then skips or takes alike
    ([Note: one overflow vote across stages]).

    ZeRO: the gradient path (``gradient_path``, slipstream.zero) is chosen once. Stage 0:
    ``ReplicatedGradientPath``, as the plain engine's; ``zero_optimization.stage`` 1 or 2
    shards each stage's fp32 optimizer state (1) and gradients (2) over that stage's
    data-parallel group (DeepSpeed refuses stage 2 with pipelines); stage 3 raises.
    """

    def __init__(
        self,
        *,
        model: PipelineModule,
        config: SlipstreamConfig,
        pipeline: PipelineConfig | None = None,
        checkpointing: ActivationCheckpointingConfig | None = None,
        optimizer: Any = None,
        model_parameters: Any = None,
        lr_scheduler: Any = None,
    ) -> None:
        if not isinstance(model, PipelineModule):
            raise TypeError(
                f"PipelineEngine needs a slipstream.pipeline.PipelineModule, got "
                f"{type(model).__name__}; use slipstream.initialize for other modules"
            )
        self.config = config
        self.pipeline_config = pipeline or PipelineConfig()
        self.module = model
        self.grid = model.mpu()
        _check_supported(config)
        if self.grid is not None and self.grid.model_parallel_size > 1:
            check_tensor_parallel_support(model, config)
        _check_module_matches(self.pipeline_config, model)

        # 1. Activation checkpointing options (process-wide, as in DeepSpeed).
        activation_checkpointing.configure(
            mpu_=self.grid, deepspeed_config=checkpointing or ActivationCheckpointingConfig()
        )

        # 2. Placement; every data-parallel replica of a stage starts from replica 0's weights.
        self.accelerator = get_accelerator()
        self._device = self.accelerator.device()
        model.to(self._device)
        self._broadcast_from_first_replica()

        # 3. Optimizer and LR schedule, resolved exactly as for the plain engine.
        params = [p for p in model.parameters() if p.requires_grad]
        resolved = resolve_optimizer(
            optimizer,
            config.optimizer,
            model_parameters if model_parameters is not None else params,
        )
        if resolved is None:
            raise ValueError(
                "the pipeline engine needs an optimizer: pass optimizer=... or add an "
                "'optimizer' block to the config"
            )
        self.optimizer: torch.optim.Optimizer = resolved
        self.lr_scheduler = resolve_scheduler(lr_scheduler, config.scheduler, self.optimizer)

        # 4. The executor (collective: creates the point-to-point groups and makes the copies
        # of tied weights equal) and the schedule.
        autocast = (
            torch.bfloat16
            if config.bf16.enabled
            else torch.float16
            if config.fp16.enabled
            else None
        )
        self.executor = build_executor(model, self._device, autocast_dtype=autocast)
        # fp16: a dynamic loss scale shared by every stage (one overflow vote over the world);
        # fp32/bf16: the optional non-finite check, with the same vote.
        self.loss_scaler = LossScaler.from_config(config.fp16) if config.fp16.enabled else None
        self._check_nonfinite = not config.fp16.enabled and (
            config.bf16.check_grad_overflow if config.bf16.enabled else config.check_grad_overflow
        )
        self._skipped_steps = 0
        # The last step, until the host has read whether it was skipped ([Note: the pipeline
        # step's skip, read late]): (step number, outcome, the flag's copy).
        self._unsettled: tuple[int, StepOutcome, FlagCopy | None] | None = None

        # 5. The gradient path (slipstream.zero), chosen once. ZeRO 1-2: re-home the optimizer
        # onto fp32 master shards over this stage's data-parallel group, after step 4, so that
        # the masters of tied weights are cut from the synchronized copies (every stage sharing
        # a weight starts from the same shard). Stage 0: the plain engine's replicated path.
        self.zero_stage = config.zero_optimization.stage
        self.zero: ShardedOptimizerStates | None = None
        self.gradient_path: GradientPath
        if self.zero_stage in (1, 2):
            self.zero = self._shard_optimizer(config)
            self.gradient_path = self.zero
        else:
            self.gradient_path = self._replicated_path(config)
        self._micro_batch = int(config.train_micro_batch_size_per_gpu)  # type: ignore[arg-type]
        self._gas = int(config.gradient_accumulation_steps)  # type: ignore[arg-type]
        self._train_batch = int(config.train_batch_size)  # type: ignore[arg-type]
        self.schedule: PipelineSchedule = build_schedule(
            self.pipeline_config.schedule, model.num_stages, self._gas, model.num_chunks
        )

        self.global_steps = 0
        self.global_samples = 0
        self.monitor = MonitorMaster.from_config(config, rank=comm.get_rank())
        self.data_iterator: Iterator[Any] | None = None
        self._last_grad_norm: torch.Tensor | None = None
        if comm.get_rank() == 0:
            logger.info(
                "Slipstream pipeline engine: %d stages × %d chunks, data-parallel size %d, "
                "schedule %s, micro-batch %d × GAS %d",
                model.num_stages,
                model.num_chunks,
                self.data_parallel_size,
                self.schedule.name,
                self._micro_batch,
                self._gas,
            )

    # ------------------------------------------------------------------ set-up helpers
    def _broadcast_from_first_replica(self) -> None:
        if self.grid is None or self.grid.data_parallel_size == 1:
            return
        group = self.grid.get_data_parallel_group()
        src = self.grid.group_ranks("data")[0]
        with torch.no_grad():
            for tensor in [*self.module.parameters(), *self.module.buffers()]:
                comm.broadcast(tensor.data, src=src, group=group)

    def _replicated_path(self, config: SlipstreamConfig) -> ReplicatedGradientPath:
        """Stage 0: the path ``SlipstreamEngine`` takes at stage 0, over this stage's
        data-parallel group (bucket size, pre-scaling and communication dtype from the same
        config keys). The weights stay fp32 under autocast, so there are no master copies.
        Its vote spans the world: each stage sees only its own gradients ([Note: one overflow
        vote across stages])."""
        replicas = self.data_parallel_size
        return ReplicatedGradientPath(
            [p for p in self.module.parameters() if p.requires_grad],
            self.optimizer,
            zero_setup.replicated_reduce_settings(config),
            group=(
                self.grid.get_data_parallel_group()
                if self.grid is not None and replicas > 1
                else None
            ),
            group_size=replicas,
            masters=False,
            vote_over_world=True,
        )

    def _shard_optimizer(self, config: SlipstreamConfig) -> ShardedOptimizerStates:
        group = DataParallelGroup(None, 1, 0)  # one replica: this rank alone
        if self.grid is not None and self.grid.data_parallel_size > 1:
            group = DataParallelGroup.of(self.grid.get_data_parallel_group())
            if group.rank != self.grid.data_parallel_id:
                # The tied-weight sums of ZeRO shards rely on it (see _train_batch_sharded).
                raise RuntimeError(
                    f"rank {comm.get_rank()} is rank {group.rank} of its data-parallel group "
                    f"but has data-parallel coordinate {self.grid.data_parallel_id}; ZeRO with "
                    "pipelines needs the topology's data axis to order the group"
                )
        if config.zero_optimization.overlap_comm:
            logger.info(
                "zero_optimization.overlap_comm is not applied with pipelines: each "
                "micro-batch's gradients are reduce-scattered after its backward instruction"
            )
        offload = config.zero_optimization.optimizer_offload()
        if offload is not None and offload.overlap_forward:
            logger.warning(
                "zero_optimization.offload_optimizer.overlap_forward has no effect with "
                "pipelines: each step finishes before the next batch's schedule starts"
            )
        # overlap off: under the zero-bubble weight pass a weight's gradient can arrive in
        # several parts, so a bucket must not launch before the instruction has finished.
        settings = dataclasses.replace(zero_setup.zero_settings(config), overlap_comm=False)
        params = [p for p in self.module.parameters() if p.requires_grad]
        # Every step passes the squares summed across the stages (_step): the reducer's own,
        # taken as the last bucket lands, would go unread.
        return ShardedOptimizerStates(
            params, self.optimizer, settings, group, caller_sums_squares=True
        )

    # ------------------------------------------------------------------ DeepSpeed accessors
    @property
    def device(self) -> torch.device:
        """The device this rank's stage lives on."""
        return self._device

    @property
    def data_parallel_size(self) -> int:
        """Replicas of each stage."""
        return self.grid.data_parallel_size if self.grid is not None else 1

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all replicas."""
        return self._train_batch

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per micro-batch."""
        return self._micro_batch

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per ``train_batch``."""
        return self._gas

    def is_first_stage(self) -> bool:
        """Whether this rank holds stage 0 (it reads the inputs)."""
        return self.module.stage_id == 0

    def is_last_stage(self) -> bool:
        """Whether this rank holds the last stage (it reads the labels, computes the loss)."""
        return self.module.stage_id == self.module.num_stages - 1

    def get_lr(self) -> list[float]:
        """The learning rate of each parameter group (the schedule has followed the last step)."""
        self._settle_step()
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The whole model's gradient norm at the last step, before clipping (None when that
        step was skipped)."""
        self._settle_step()
        return None if self._last_grad_norm is None else float(self._last_grad_norm)

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped (fp16 overflow, or an inf/nan under ``check_grad_overflow``)."""
        self._settle_step()
        return self._skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._settle_step()
        self._skipped_steps = int(value)

    # -- DeepSpeed's engine accessors (docs/deepspeed-compat.md) ---------------------------
    @property
    def local_rank(self) -> int:
        """This process's rank on its node (``LOCAL_RANK``)."""
        return comm.get_local_rank()

    @property
    def global_rank(self) -> int:
        """This process's rank in the default group."""
        return comm.get_rank()

    @property
    def world_size(self) -> int:
        """Processes in the default group (all stages and replicas)."""
        return comm.get_world_size()

    def fp16_enabled(self) -> bool:
        """Whether fp16 (autocast with a dynamic loss scale shared by the stages) is on."""
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        """Whether bf16 autocast is on."""
        return self.config.bf16.enabled

    def zero_optimization_stage(self) -> int:
        """The ZeRO stage, 0-2."""
        return self.zero_stage

    def __getattr__(self, name: str) -> Any:
        # As DeepSpeed's engine: what the engine lacks is looked up on the module.
        module = self.__dict__.get("module")
        if module is None or name.startswith("__"):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute {name!r}")
        try:
            return getattr(module, name)
        except AttributeError:
            raise AttributeError(
                f"neither the {type(self).__name__} nor its module ({type(module).__name__}) "
                f"has an attribute {name!r}"
            ) from None

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        """The iterator ``train_batch()`` reads when called without one."""
        self.data_iterator = iterator

    # ------------------------------------------------------------------ the loop
    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """Run one batch (``gradient_accumulation_steps`` micro-batches) and one optimizer
        step; return the mean loss (a 0-dim tensor, the same on every rank)."""
        iterator = data_iter if data_iter is not None else self.data_iterator
        if self.loss_scaler is not None:
            # fp16: this batch's loss scale depends on whether the last step overflowed, the
            # one host decision that needs the last step's flag before the schedule runs.
            self._settle_step()
            self.executor.loss_scale = self.loss_scaler.loss_scale
        if self.zero is not None:
            loss, _ = self._train_batch_sharded(iterator)
        else:
            loss, _ = self._train_batch_replicated(iterator)
        self.global_steps += 1
        self.global_samples += self._train_batch
        if self.monitor.enabled and comm.get_rank() == 0:
            # DeepSpeed's pipeline events, after the step (float(loss): a host sync).
            self.monitor.write_events(
                [
                    ("Train/Samples/lr", self.get_lr()[0], self.global_samples),
                    ("Train/Samples/train_loss", float(loss), self.global_samples),
                ]
            )
        if self.global_steps % self.config.steps_per_print == 0 and comm.get_rank() == 0:
            # float(loss) and the skip flag: host syncs, once per log line.
            self._settle_step()
            grad_norm = self._last_grad_norm
            logger.info(
                "step=%d loss=%.4f lr=%s grad_norm=%s",
                self.global_steps,
                float(loss),
                ",".join(f"{lr:.3e}" for lr in self.get_lr()),
                f"{float(grad_norm):.4f}" if grad_norm is not None else "n/a",
            )
        return loss

    def _train_batch_replicated(self, iterator: Iterator[Any] | None) -> StepResult:
        """``train_batch`` at ZeRO stage 0, on :class:`~slipstream.zero.ReplicatedGradientPath`.

        The schedule accumulates every micro-batch's full gradient locally; the tied weights'
        gradients are summed across the stages sharing them; then the path's all-reduce is
        armed and finished with no backward in between, which launches every bucket (the mean
        over this stage's data-parallel group; the replicas then hold equal gradients, so the
        squares need summing over the pipeline only); then :meth:`_step`.
        """
        path = self.gradient_path
        assert isinstance(path, ReplicatedGradientPath)
        module = self.module
        if not self.schedule.train:
            raise ValueError(f"schedule {self.schedule.name} is forward-only; use eval_batch")
        module.train()
        result = self.executor.run(self.schedule, iterator)
        reduce_tied_gradients(module)
        path.prepare_backward(is_boundary=True)
        path.finish_backward()
        norm = self._step([(p, p.grad) for p in path.params], self._pipe_groups())
        return StepResult(aggregate_loss(self.executor, result.losses, self._device), norm)

    def _train_batch_sharded(self, iterator: Iterator[Any] | None) -> StepResult:
        """``train_batch`` at ZeRO stage 1 or 2: the gradients end in this rank's fp32 shards.

        The order, and why it gives the stage-0 result:

        - Stage 1: the schedule accumulates every micro-batch's full gradient locally; the
          tied weights' gradients are then summed across the stages sharing them (full
          tensors, as at stage 0), and only then reduce-scattered (mean over the stage's
          data-parallel group) into the master shards. The full gradients are dropped.
        - Stage 2: each backward (or zero-bubble weight pass) instruction is followed by a
          reduce-scatter of what it produced into the shards, accumulating there, so no
          full-size gradient outlives its micro-batch. A tied weight's gradient is therefore
          reduced over the data-parallel group on each sharing stage separately, and its
          shards are summed across the tie group after the schedule. Both reductions are
          sums (the mean is a sum times 1/DP), so the order does not change the result, and
          the shards agree: a tie group joins the ranks of one data-parallel coordinate, which
          own the same range of the weight (same shape, same group size; checked at set-up).
          Summing the shards rather than full gradients also moves 1/DP of the bytes.
        - Then, both stages, :meth:`_step`: the squares of the final shards summed over the
          data-parallel group and then over the pipeline (each tied weight counted on its
          lowest stage only, as the stage-0 path does; tensor-parallel shards' squares also
          over the tensor group) carry the vote and the norm; the path's step clips every
          shard with it (so the copies of a tied weight get the same update and stay
          bit-identical), steps the optimizer on the shards and all-gathers them into the
          parameters.
        """
        zero = self.zero
        assert zero is not None
        module = self.module
        if not self.schedule.train:
            raise ValueError(f"schedule {self.schedule.name} is forward-only; use eval_batch")
        module.train()
        stage2 = self.zero_stage == 2
        zero.prepare_backward(is_boundary=False)  # stage 1: the hooks stay idle meanwhile
        after: Callable[[int, int], None] | None = self._reduce_scatter_now if stage2 else None
        result = self.executor.run(self.schedule, iterator, after_weight_gradients=after)
        if stage2:
            reduce_tied_gradients(module, grad_of=self._master_grad)
        else:
            reduce_tied_gradients(module)
            zero.finish_backward(is_boundary=True)
        groups = [zero.group.group] if zero.group.world_size > 1 else []
        norm = self._step(
            [(p, zero.masters.grad(i)) for i, p in enumerate(zero.params)],
            groups + self._pipe_groups(),
        )
        return StepResult(aggregate_loss(self.executor, result.losses, self._device), norm)

    def _step(
        self,
        grads: list[tuple[torch.Tensor, torch.Tensor | None]],
        groups: list[dist.ProcessGroup | None],
    ) -> torch.Tensor | None:
        """The gradient path's step with the squares summed across the stages; returns the
        unscaled norm (None when the step was skipped).

        [Note: one overflow vote across stages] Each stage sees only its own gradients, so a
        stage whose gradients are finite cannot know that another's overflowed. The sum of
        squares of ``grads`` (this rank's, still scaled under fp16), all-reduced over
        ``groups`` (the data-parallel group where the gradients are sharded, then the
        pipeline) and the tensor group, is non-finite on every rank when any gradient of any
        rank is: the path's step takes it as ``grad_squares``, which carries the vote as well
        as the norm (one collective per step), and every rank skips or steps alike. With a
        fused optimizer the skip is decided on the device and read later
        ([Note: the pipeline step's skip, read late]); otherwise the path reads it here. The
        vote is on the gradients; with fp32/bf16 it runs only under ``check_grad_overflow``
        (a zero ``nonfinite_check`` asks for it).
        """
        path = self.gradient_path
        squares = grad_squares_across_stages(
            self.module, grads, groups, self._device, tensor_group=self._tensor_group()
        )
        # The last step's skip, read now that this batch's schedule is queued: its LR step
        # must come before this update ([Note: the pipeline step's skip, read late]).
        self._settle_step()
        scaler = self.loss_scaler
        check = torch.zeros((), dtype=torch.float32, device=self._device)
        outcome = path.step(
            loss_scale=scaler.loss_scale if scaler is not None else None,
            max_grad_norm=self.config.gradient_clipping,
            nonfinite_check=check if self._check_nonfinite else None,
            grad_squares=squares,
            # A fused optimizer skips on the device flag: no device->host sync per step.
            defer_skip=True,
        )
        path.zero_grad()
        flag = FlagCopy.start(outcome.skipped)
        self._unsettled = (self.global_steps + 1, outcome, flag)
        if flag is None:
            self._settle_step()  # decided on the host already
        return None if outcome.overflow else outcome.grad_norm

    def _settle_step(self) -> None:
        """Count the last step as taken or skipped and follow up: the LR schedule moves on a
        taken step, the fp16 scale grows or backs off, a skip is logged.

        [Note: the pipeline step's skip, read late] With a fused optimizer the skip is
        decided on the device (slipstream.zero's [Note: the skip decided on the device]); its
        flag is read here, lazily: before the next step (after the next batch's schedule is
        queued), at the start of the next batch under fp16 (its loss scale depends on it), at
        a log line, a checkpoint, or a read of the counters, the learning rate or the norm.
        """
        unsettled = self._unsettled
        if unsettled is None:
            return
        self._unsettled = None
        step, outcome, flag = unsettled
        skipped = outcome.overflow if flag is None else flag.read()
        scaler = self.loss_scaler
        if scaler is not None:
            scaler.update(skipped)
        if skipped:
            self._skipped_steps += 1
            self._last_grad_norm = None
            if comm.get_rank() == 0:
                logger.info(
                    "step %d: non-finite gradients on some stage; skipping the update%s",
                    step,
                    f" (loss scale -> {scaler.loss_scale:g})" if scaler is not None else "",
                )
            return
        self._last_grad_norm = outcome.grad_norm
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    def _pipe_groups(self) -> list[dist.ProcessGroup | None]:
        if self.grid is not None and self.grid.pipe_parallel_size > 1:
            return [self.grid.get_pipe_parallel_group()]
        return []

    def _tensor_group(self) -> dist.ProcessGroup | None:
        if self.grid is not None and self.grid.model_parallel_size > 1:
            return self.grid.get_model_parallel_group()
        return None

    def _reduce_scatter_now(self, microbatch: int, chunk: int) -> None:
        """Stage 2, after each backward instruction: reduce-scatter its gradients into the
        shards (the data-parallel replicas of this stage run the same instructions)."""
        assert self.zero is not None
        self.zero.finish_backward()

    def _master_grad(self, weight: torch.Tensor) -> torch.Tensor:
        """The fp32 gradient shard of ``weight`` (zeros for a frozen one, so that the tie
        group's collectives still match)."""
        assert self.zero is not None
        index = self.zero.masters.index_of.get(id(weight))
        if index is None:
            return torch.zeros(1, dtype=torch.float32, device=self._device)
        return self.zero.masters.fp32_grad(index)

    def eval_batch(
        self,
        data_iter: Iterator[Any],
        return_logits: bool = False,
        compute_loss: bool = True,
        num_micro_batches: int | None = None,
    ) -> Any:
        """Forward ``num_micro_batches`` (default: GAS) micro-batches without gradients.

        Returns the mean loss (None when ``compute_loss`` is False); with ``return_logits``,
        ``(loss, logits)`` where logits are the last stage's outputs per micro-batch (None on
        other stages), as DeepSpeed does.
        """
        loss, logits = eval_batch(
            self.executor,
            data_iter,
            num_micro_batches or self._gas,
            compute_loss=compute_loss,
            return_logits=return_logits,
        )
        return (loss, logits) if return_logits else loss

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Not available: a pipeline runs whole batches (DeepSpeed raises here too)."""
        raise RuntimeError(
            "a PipelineEngine runs whole batches: call engine.train_batch(data_iter) (or "
            "engine.eval_batch(data_iter)) instead of engine(...), backward() and step()"
        )

    __call__ = forward
    backward = forward
    step = forward

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self,
        save_dir: str | Path,
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        *,
        allow_non_finite: bool | None = None,
    ) -> Path:
        """Save every stage's weights, optimizer state, schedule, counters and RNG.

        Collective over all stages and replicas; the same crash-safe, checked format as the
        plain engine's (docs/checkpoints.md). Each stage writes its own shards and the
        manifest records the layer -> stage map, so :meth:`load_checkpoint` may run with
        another number of stages, data-parallel size or ZeRO stage (0-2).
        """
        from slipstream.runtime import checkpoint

        self._settle_step()  # the counters and the schedule as of the last step
        with self.gradient_path.resident():  # NVMe offload: masters and states in memory
            return checkpoint.save(
                self, save_dir, tag, dict(client_state or {}), save_latest, allow_non_finite
            )

    def load_checkpoint(
        self,
        load_dir: str | Path,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[Path, dict[str, Any]]:
        """Restore a pipeline checkpoint of any stage count, data-parallel size and ZeRO
        stage 0-2; returns ``(path, client_state)``. Collective; verified before anything is
        copied."""
        from slipstream.runtime import checkpoint

        self._settle_step()  # the last step's follow-up first; the checkpoint then replaces it
        with self.gradient_path.resident():  # NVMe offload: masters and states in memory
            return checkpoint.load(
                self,
                load_dir,
                tag,
                load_module_strict=load_module_strict,
                load_optimizer_states=load_optimizer_states and not load_module_only,
                load_lr_scheduler_states=load_lr_scheduler_states and not load_module_only,
                load_module_only=load_module_only,
            )


def _check_supported(config: SlipstreamConfig) -> None:
    stage = config.zero_optimization.stage
    if stage > 2:
        raise NotImplementedFeatureError(
            f"zero_optimization.stage = {stage} with pipeline parallelism is not implemented "
            "(each stage would gather its parameters for every micro-batch); use stage 1 or 2 "
            "with pipelines, which shard the optimizer states (and gradients) over each "
            "stage's data-parallel group",
            "zero_optimization.stage",
        )
    if config.curriculum_learning.enabled or config.data_efficiency.enabled:
        key = "curriculum_learning" if config.curriculum_learning.enabled else "data_efficiency"
        raise NotImplementedFeatureError(
            f"{key}.enabled with pipeline parallelism is not implemented (the pipeline engine "
            "cannot pass curriculum_seqlen through its stages, as in DeepSpeed); train without "
            "a pipeline, or switch the block off",
            f"{key}.enabled",
        )


def _check_module_matches(pipeline: PipelineConfig, model: PipelineModule) -> None:
    """DeepSpeed's module keys in the ``pipeline`` block must agree with the module given."""
    problems: list[tuple[str, Any, Any, str]] = []
    if pipeline.stages != "auto" and pipeline.stages != model.num_stages:
        problems.append(("stages", pipeline.stages, model.num_stages, "num_stages"))
    if pipeline.partition != "best" and pipeline.partition != model.partition_method:
        problems.append(
            ("partition", pipeline.partition, model.partition_method, "partition_method")
        )
    if pipeline.seed_layers and not model.seed_layers:
        problems.append(("seed_layers", True, False, "seed_layers"))
    interval = pipeline.activation_checkpoint_interval
    if interval and interval != model.activation_checkpoint_interval:
        problems.append(
            (
                "activation_checkpoint_interval",
                interval,
                model.activation_checkpoint_interval,
                "activation_checkpoint_interval",
            )
        )
    if problems:
        key, given, actual, argument = problems[0]
        raise ConfigError(
            f"pipeline.{key} = {given!r} but the PipelineModule was built with "
            f"{argument}={actual!r}; the module is built before the engine, so set it there "
            f"(or remove pipeline.{key})",
            f"pipeline.{key}",
        )


def initialize_pipeline(
    model: PipelineModule,
    config: ConfigSource,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Dataset | None = None,
    lr_scheduler: Any = None,
    collate_fn: Any = None,
) -> tuple[PipelineEngine, torch.optim.Optimizer, DataLoader | None, Any]:
    """``slipstream.initialize`` for a :class:`PipelineModule`: ``(engine, optimizer, loader,
    scheduler)``. torch.distributed must be initialised (the module needed it already).

    With ``training_data``, the loader gives each data-parallel replica its own samples and
    the engine's default data iterator repeats it endlessly.
    """
    if not (dist.is_available() and dist.is_initialized()) and model.mpu() is not None:
        raise RuntimeError("torch.distributed must be initialised before the pipeline engine")
    grid = model.mpu()
    dp = grid.data_parallel_size if grid is not None else 1
    parsed, pipeline, checkpointing = load_pipeline_config(config, dp)
    engine = PipelineEngine(
        model=model,
        config=parsed,
        pipeline=pipeline,
        checkpointing=checkpointing,
        optimizer=optimizer,
        model_parameters=model_parameters,
        lr_scheduler=lr_scheduler,
    )
    loader = None
    if training_data is not None:
        loader = _build_dataloader(training_data, parsed, collate_fn, grid)
        engine.set_dataiterator(_repeat(loader))
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _build_dataloader(
    dataset: Dataset, config: SlipstreamConfig, collate_fn: Any, grid: Any
) -> DataLoader:
    """Micro-batches for this rank's data-parallel replica (the stages of one pipeline read
    the same samples: the first for inputs, the last for labels)."""
    replicas = grid.data_parallel_size if grid is not None else 1
    replica = grid.data_parallel_id if grid is not None else 0
    sampler: DistributedSampler = DistributedSampler(
        dataset, num_replicas=replicas, rank=replica, shuffle=True, drop_last=True
    )
    return DataLoader(
        dataset,
        batch_size=config.train_micro_batch_size_per_gpu,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=True,  # every micro-batch of a batch must have the same shape
    )


def _repeat(loader: DataLoader) -> Iterator[Any]:
    """Cycle through ``loader`` forever, advancing the sampler's epoch each pass."""
    epoch = 0
    while True:
        sampler = getattr(loader, "sampler", None)
        set_epoch = getattr(sampler, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(epoch)
        yield from loader
        epoch += 1
