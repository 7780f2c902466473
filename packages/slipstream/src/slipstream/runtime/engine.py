"""The training engine behind `slipstream.initialize`: DeepSpeed's loop over a plain module."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.compression import CompressionScheduler, CompressionState, init_compression
from slipstream.config import SlipstreamConfig
from slipstream.data import DataEfficiency, ProgressiveLayerDrop, RandomLayerTokenDrop
from slipstream.kernels import get_accelerator
from slipstream.kernels.config_schema import ConfigError
from slipstream.kernels.loss_scaler import LossScaler
from slipstream.monitor import MonitorMaster
from slipstream.offload import OffloadIOError
from slipstream.runtime import checkpoint as checkpointing
from slipstream.runtime import zero_setup
from slipstream.runtime.agreement import check_ranks_agree, parameter_signature
from slipstream.runtime.lr_schedules import resolve_scheduler
from slipstream.runtime.moe_gradients import declare_stage3_reads, expert_layout
from slipstream.runtime.optimizers import resolve_optimizer
from slipstream.runtime.step_flag import FlagCopy as _FlagCopy
from slipstream.runtime.tensor_parallel import (
    agree_nonfinite_across_tensor_group,
    check_tensor_parallel_support,
    is_tensor_parallel,
    reduce_sequence_parallel_grads_,
    save_tensor_parallel_16bit_model,
    tensor_parallel_grad_norm,
    zero_tensor_parallel_grad_norm,
)
from slipstream.runtime.throughput import ProgressReport, ThroughputMeter, count_tokens, peak_tflops
from slipstream.runtime.timers import WallClockTimers
from slipstream.zero import (
    DataParallelGroup,
    ExpertGroup,
    GradientPath,
    ReduceSettings,
    ReplicatedGradientPath,
    ShardedOptimizerStates,
    StepOutcome,
    ZeroSettings,
)

logger = logging.getLogger(__name__)


class SlipstreamEngine(torch.nn.Module):
    """Wraps a model, its optimizer and schedule, and runs DeepSpeed's training loop.

    >>> engine, optimizer, _, _ = slipstream.initialize(model=model, config=config)
    >>> for batch in loader:
    ...     loss = engine(batch)
    ...     engine.backward(loss)
    ...     engine.step()

    The engine composes, in order: placement and precision of the module (cast to fp16/bf16
    with fp32 master weights), the optimizer and LR schedule (by name from the config or the
    client's), one gradient path of slipstream.zero picked once for the layout,
    ``engine.gradient_path`` (slipstream.zero.GradientPath): a bucketed all-reduce of
    replicated gradients (stage 0, ReplicatedGradientPath) or ZeRO's sharding
    (``zero_optimization.stage`` 1-3: the optimizer on fp32 master shards, gradients
    reduce-scattered; at stage 3 the parameters sharded first), and the loss scaler for fp16.
    Expert-parallel MoE parameters (slipstream.moe, ``ep_size > 1``) are reduced (and at
    stage 3 sharded) over their expert-data-parallel groups, by the same path.
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        config: SlipstreamConfig,
        optimizer: Any = None,
        model_parameters: Any = None,
        lr_scheduler: Any = None,
        mpu: Any = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.accelerator = get_accelerator()
        self.dp_group = mpu.get_data_parallel_group() if mpu is not None else None
        # Tensor parallelism (an mpu with a tensor axis, e.g. AutoTP's grid): sharded
        # parameters keep their own gradients; only the norm and the overflow vote span TP.
        self._tp_group = (
            mpu.get_model_parallel_group() if hasattr(mpu, "get_model_parallel_group") else None
        )
        self._tp_size = comm.get_world_size(self._tp_group) if self._tp_group is not None else 1
        if self._tp_size > 1:
            check_tensor_parallel_support(model, config)
        self.dp_world_size = comm.get_world_size(self.dp_group)
        self.global_rank = comm.get_rank()
        # load_config() has resolved the batch triple; keep it as plain ints for the hot path.
        self._micro_batch, self._gas, self._train_batch = _resolved_batch_triple(config)
        # Before any other collective: ranks with different configs or models fail here, with
        # the same error naming the difference on every rank (runtime/agreement.py).
        check_ranks_agree(config.to_dict(), parameter_signature(model), self.accelerator.device())

        # 1. Placement and precision. DeepSpeed keeps the whole module in fp16/bf16 and the
        # optimizer on fp32 masters; the same here.
        self.compute_dtype = (
            torch.float16
            if config.fp16.enabled
            else torch.bfloat16
            if config.bf16.enabled
            else None
        )
        self.module = model
        self.zero_stage = config.zero_optimization.stage
        # Read from the config once: the reduce settings are used on every boundary.
        self._zero_settings = zero_setup.zero_settings(config) if self.zero_stage else None
        # The gradient path (slipstream.zero.GradientPath), picked once below for every
        # stage. ``zero`` is its older name at stages 1-3 (None at stage 0), read by the
        # checkpoint code to pick the sharded layout.
        self.zero: Any = None
        self._zero_comm_group: DataParallelGroup | None = None
        self._stage3: Any = None
        self._destroyed = False
        # Set when an optimizer step failed half-way through its swap I/O (see _check_alive).
        self._failed_step: str | None = None
        # Expert-parallel MoE parameters (slipstream.moe, ep_size > 1) reduce over their own
        # expert-data-parallel groups (see runtime/moe_gradients.py).
        self._experts = expert_layout(
            [(n, p) for n, p in model.named_parameters() if p.requires_grad],
            self.dp_group,
            self.dp_world_size,
        )
        if self.zero_stage == 3:
            # Stage 3 places and casts each parameter as it shards it (the whole module never
            # sits on the device at once), broadcasting rank 0's values first.
            self._device = self.accelerator.device()
            declare_stage3_reads(model)
            self._stage3 = zero_setup.shard_module_for_stage3(
                model,
                self._zero_settings_for_stage(),
                self._zero_group(),
                self._device,
                self.compute_dtype,
                # Expert parameters shard over their expert-data-parallel groups.
                param_groups={
                    pid: DataParallelGroup.of(self._experts.dp_groups[name])
                    for pid, name in self._experts.group_of.items()
                },
            )
        else:
            _refuse_partitioned(model, self.zero_stage)
            self._device = self._place_module(model)
            self._broadcast_module_from_rank0()

        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._param_names = [n for n, _ in named]
        self._params = [p for _, p in named]

        # 2. Optimizer and schedule.
        if model_parameters is None:
            model_parameters = self._params
        self.optimizer = resolve_optimizer(optimizer, config.optimizer, model_parameters)

        # 3. The gradient path, one per layout: it re-homes the optimizer onto fp32 masters
        # (whole at stage 0, this rank's shards at stages 1-3) and reduces the gradients
        # during backward (all-reduce at stage 0, reduce-scatter at stages 1-3).
        self.gradient_path: GradientPath = self._build_gradient_path()
        # Stage 0's fp32 master copies (None in fp32 or at stages 1-3), for the checkpoint.
        self.masters = (
            self.gradient_path.masters
            if isinstance(self.gradient_path, ReplicatedGradientPath)
            else None
        )
        if self.zero_stage > 0:
            self.zero = self.gradient_path
            offload = config.zero_optimization.optimizer_offload()
            if offload is not None and offload.overlap_forward:
                assert isinstance(self.gradient_path, ShardedOptimizerStates)  # config: stage 1-2
                self.gradient_path.overlap_forward(self.module)
            elif config.zero_optimization.publish_during_forward:
                if isinstance(self.gradient_path, ShardedOptimizerStates):
                    self.gradient_path.publish_during_forward(self.module)
                elif self.global_rank == 0:
                    logger.warning(
                        "zero_optimization.publish_during_forward has no effect here: it "
                        "applies to ZeRO stages 1-2 without expert parallelism"
                    )
        self.lr_scheduler = resolve_scheduler(lr_scheduler, config.scheduler, self.optimizer)
        # Curricula, the difficulty sampler and random-LTD (slipstream.data); None when off.
        self.data_efficiency = DataEfficiency.from_configs(
            config.curriculum_learning,
            config.data_efficiency,
            global_batch_size=self._train_batch,
            micro_batch_size=self._micro_batch,
        )
        self._setup_data_efficiency()
        # Compression-aware training (slipstream.compression): None when no technique is on.
        self.compression_scheduler = _compression_scheduler(self.module, config)
        # progressive_layer_drop: theta(t) handed to the model's forward (slipstream.data).
        self.progressive_layer_drop = ProgressiveLayerDrop.from_config(
            config.progressive_layer_drop
        )

        # 4. fp16 loss scaling; fp32/bf16 skip non-finite steps instead (docs/reliability.md).
        self.loss_scaler = LossScaler.from_config(config.fp16) if config.fp16.enabled else None
        self._check_nonfinite = not config.fp16.enabled and (
            config.bf16.check_grad_overflow if config.bf16.enabled else config.check_grad_overflow
        )
        # A step whose skip was decided on the device, not read yet (see _settle_step).
        self._unsettled: _UnsettledStep | None = None

        # Ulysses (DeepSpeed's names); initialize() sets the group. The SP ranks of one
        # replica share its samples: the engine's gradient group spans DP × SP, but only
        # dp_world_size / SP replicas count towards samples (batch, samples/s).
        self.sequence_parallel_size = config.sequence_parallel_size
        self._replicas = max(self.dp_world_size // self.sequence_parallel_size, 1)
        self.seq_parallel_group: Any = None
        # Loop state, named as in DeepSpeed.
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self._skipped_steps = 0
        self._nonfinite_skipped_steps = 0  # fp32/bf16 steps skipped for an inf or nan
        self._cycle_loss: torch.Tensor | None = None  # losses since the last optimizer step
        self._boundary_override: bool | None = None
        self._inside_no_sync = False
        self._last_grad_norm: torch.Tensor | None = None
        self._loss_sum: torch.Tensor | None = None
        self._loss_count = 0
        self.last_report: ProgressReport | None = None  # the numbers of the latest log line

        self.timers = WallClockTimers(config.wall_clock_breakdown, self.accelerator.synchronize)
        # The tensorboard/wandb/csv_monitor/comet blocks; users may write_events too.
        self.monitor = MonitorMaster.from_config(config, rank=self.global_rank)
        self._monitor_loss: torch.Tensor | None = None
        n_params = sum(p.numel() for p in self._params)
        device_name = (
            self.accelerator.device_name(self._device.index or 0)
            if self._device.type != "cpu"
            else None
        )
        # 6·N per token: forward and backward matmuls over every trainable weight. Attention's
        # sequence-dependent FLOPs are left out; set_flops_per_token() takes an exact figure.
        self.throughput = ThroughputMeter(
            dp_world_size=self.dp_world_size,
            sequence_parallel_size=self.sequence_parallel_size,
            flops_per_token=6.0 * n_params,
            peak=peak_tflops(device_name, self.compute_dtype or torch.float32),
        )
        if self.global_rank == 0:
            logger.info(
                "Slipstream engine: %s trainable parameters, %s, data-parallel size %d, "
                "micro-batch %d × GAS %d × DP %d = batch %d, %d gradient bucket(s)",
                f"{n_params:,}",
                self._precision_name(),
                self.dp_world_size,
                config.train_micro_batch_size_per_gpu,
                config.gradient_accumulation_steps,
                self._replicas,
                config.train_batch_size,
                getattr(self.gradient_path, "num_buckets", 0),
            )

    # ------------------------------------------------------------------ set-up helpers
    def _place_module(self, model: torch.nn.Module) -> torch.device:
        device = self.accelerator.device()
        model.to(device)
        if self.compute_dtype is not None:
            model.to(self.compute_dtype)
        return device

    def _broadcast_module_from_rank0(self) -> None:
        # Every rank starts from rank 0's weights, as DeepSpeed and DDP do.
        if self.dp_world_size == 1:
            return
        src = dist.get_global_rank(self.dp_group, 0) if self.dp_group is not None else 0
        with torch.no_grad():
            for tensor in [*self.module.parameters(), *self.module.buffers()]:
                name = self._experts.group_of.get(id(tensor))
                if name is not None:
                    # An expert-parallel rank holds its own experts: they are equal only
                    # within its expert-data-parallel group, so they come from its rank 0.
                    group = self._experts.dp_groups[name]
                    assert group is not None  # None only at ep_size 1, which counts as dense
                    comm.broadcast(tensor.data, src=dist.get_global_rank(group, 0), group=group)
                else:
                    comm.broadcast(tensor.data, src=src, group=self.dp_group)

    def _zero_group(self) -> DataParallelGroup:
        # Built once (MiCS creates process groups): ZeRO++/MiCS swap stage 3's collectives.
        if self._zero_comm_group is None:
            self._zero_comm_group = zero_setup.zero_group(self.config, self.dp_group)
        return self._zero_comm_group

    def _build_gradient_path(self) -> GradientPath:
        """The layout's gradient path (slipstream.zero), built once."""
        experts = self._experts
        if self.zero_stage == 0:
            return ReplicatedGradientPath(
                self._params,
                self.optimizer,
                self._reduce_settings(),
                group=self.dp_group,
                masters=self.compute_dtype is not None,
                experts=[
                    ExpertGroup(tuple(indices), experts.dp_groups[name], experts.ep_groups[name])
                    for name, indices in experts.expert.items()
                ],
                vote_over_world=self._tp_size > 1,
            )
        if self.optimizer is None:
            raise ValueError(
                f"zero_optimization.stage = {self.zero_stage} shards the optimizer's state, "
                "but there is no optimizer: pass initialize(optimizer=...) or add an "
                "'optimizer' block to the config"
            )
        return zero_setup.build_gradient_path(
            self._zero_settings_for_stage(),
            self._zero_group(),
            self._params,
            self.optimizer,
            self._stage3,
            expert_parts={
                name: (indices, DataParallelGroup.of(experts.dp_groups[name]))
                for name, indices in experts.expert.items()
            },
        )

    def _zero_settings_for_stage(self) -> ZeroSettings:
        assert self._zero_settings is not None  # built whenever zero_stage > 0
        return self._zero_settings

    def _reduce_settings(self) -> ReduceSettings:
        """Stage 0's all-reduce: DDP's bucket size unless the config names one."""
        return zero_setup.replicated_reduce_settings(self.config)

    def _precision_name(self) -> str:
        name = self._dtype_name()
        return name if self.zero_stage == 0 else f"{name}, ZeRO stage {self.zero_stage}"

    def _dtype_name(self) -> str:
        if self.config.fp16.enabled:
            kind = (
                "dynamic" if self.loss_scaler is not None and self.loss_scaler.dynamic else "static"
            )
            return f"fp16 ({kind} loss scale) with fp32 master weights"
        if self.config.bf16.enabled:
            return "bf16 with fp32 master weights"
        return "fp32"

    # ------------------------------------------------------------------ DeepSpeed accessors
    @property
    def device(self) -> torch.device:
        """The device the module lives on."""
        return self._device

    def train_batch_size(self) -> int:
        """Global batch: micro-batch × gradient accumulation × data-parallel size."""
        return self._train_batch

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per forward on one rank."""
        return self._micro_batch

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self._gas

    def get_lr(self) -> list[float]:
        """The current learning rate of each parameter group."""
        self._settle_step()
        if self.optimizer is None:
            return []
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The gradient norm of the last optimizer step, before clipping (None before any step)."""
        self._settle_step()
        if self._last_grad_norm is None:
            return None
        return float(self._last_grad_norm)  # host sync: only when the caller asks

    def global_grad_norm_tensor(self) -> torch.Tensor | None:
        """:meth:`get_global_grad_norm` as a 0-d device tensor, without a host read.

        While the last step's skip is still on the device (:attr:`step_pending`), the tensor
        picks on the device that step's norm if it was taken, else the previous step's (nan
        when there was none, where :meth:`get_global_grad_norm` says None): reading it later
        gives what :meth:`get_global_grad_norm` gives then.
        """
        unsettled = self._unsettled
        if unsettled is None or unsettled.flag is None or unsettled.outcome.grad_norm is None:
            self._settle_step()  # known on the host already: no wait
            return self._last_grad_norm
        taken = unsettled.outcome.grad_norm.detach().float()
        previous = self._last_grad_norm
        kept = (
            previous.detach().float().to(taken.device)
            if previous is not None
            else torch.full_like(taken, float("nan"))
        )
        return torch.where(unsettled.flag.device_flag.to(taken.device) > 0, kept, taken)

    @property
    def step_pending(self) -> bool:
        """Whether the last step's skip was decided on the device and is not read yet (reading
        :attr:`skipped_steps`, :meth:`get_lr` or the norm then waits for the device)."""
        unsettled = self._unsettled
        return unsettled is not None and unsettled.flag is not None

    def set_flops_per_token(self, flops: float) -> None:
        """Replace the 6·N estimate used for MFU (e.g. to count attention exactly)."""
        self.throughput.flops_per_token = float(flops)

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-step ends an accumulation cycle (the next step() updates)."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self._gas == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Override the boundary (for loops that drive accumulation themselves)."""
        self._boundary_override = bool(is_boundary)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip the gradient all-reduce of backward passes inside the block.

        Gradients keep accumulating locally and are reduced by the first backward outside the
        block that ends an accumulation cycle. ``step()`` may not be called inside.
        """
        previous = self._inside_no_sync
        self._inside_no_sync = True
        try:
            yield
        finally:
            self._inside_no_sync = previous

    def destroy(self) -> None:
        """Release what the engine holds besides the model, as DeepSpeed's ``destroy()``: the
        CPU optimizer step's worker and the swap files of NVMe offload (optimizer states and
        parameter shards). Idempotent. The engine cannot train or checkpoint afterwards; the
        swap files are otherwise removed at exit (and on SIGTERM).
        """
        if self._destroyed:
            return
        self._destroyed = True
        self.monitor.close()
        self.gradient_path.close()
        if self._stage3 is not None:
            self._stage3.close()

    def wait_for_step(self) -> None:
        """Finish the last optimizer step where it still runs in the background.

        Only ``offload_optimizer.overlap_forward`` leaves work behind ``step()``: the CPU still
        steps the last gradient buckets, and the next forward publishes each as it reaches
        its parameters. Call this before reading parameters directly in between (an EMA of
        the weights, say); forwards, ``state_dict()``, checkpoints and the next backward wait
        by themselves. A no-op otherwise.
        """
        if isinstance(self.gradient_path, ShardedOptimizerStates):
            self.gradient_path.complete_step()

    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError(
                "this engine was destroyed (engine.destroy()): its offload worker and swap files "
                "are gone; build a new one with slipstream.initialize"
            )
        if self._failed_step is not None:
            raise RuntimeError(
                f"this engine cannot train or checkpoint any more: {self._failed_step}. Part "
                "of that step may have reached the weights and optimizer state (the swapped "
                "sub-groups are stepped one after another), so going on, or saving, would "
                "keep a half-applied step. Fix the cause, build a new engine with "
                "slipstream.initialize and load the last checkpoint"
            )

    # ------------------------------------------------------------------ the loop
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module (casting float inputs to fp16 when `fp16.auto_cast` is set)."""
        self._check_alive()
        if self.config.fp16.enabled and self.config.fp16.auto_cast:
            args, kwargs = _cast_floats((args, kwargs), torch.float16)
        if self.module.training and self.data_efficiency is not None:
            # Advances the curriculum/random-LTD schedules; applies the seqlen curriculum.
            args, kwargs = self.data_efficiency.before_forward(
                self.module, args, kwargs, self.global_steps
            )
        if self.progressive_layer_drop is not None:
            kwargs = {**kwargs, **self.progressive_layer_drop.get_state()}  # as DeepSpeed does
        if self.module.training:
            self.throughput.add(self._micro_samples(args, kwargs), count_tokens(args, kwargs))
        with self.timers.region("forward"):
            return self.module(*args, **kwargs)

    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
    ) -> torch.Tensor:
        """Backpropagate ``loss`` / GAS; all-reduce gradients when this ends an accumulation cycle.

        Returns the loss divided by the gradient-accumulation steps, as DeepSpeed does.
        """
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(
                f"engine.backward() takes the scalar loss tensor, got {type(loss).__name__}"
                + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
                + "; reduce it to a scalar (e.g. loss.mean()) first"
            )
        if self._failed_step is not None:
            self._check_alive()
        self._record_loss(loss)
        scaled = loss / self._gas if scale_wrt_gas else loss
        if self.monitor.enabled:
            self._monitor_train_loss(scaled)
        unsettled = self._unsettled
        if unsettled is not None and (
            self.loss_scaler is not None or unsettled.flag is None or unsettled.flag.ready()
        ):
            # The last step's skip flag (decided on the device) is read here, long after the
            # device computed it: the fp16 scale of this backward depends on it. Without a
            # loss scale nothing before the next step does, so a flag still on its way is
            # left for the next step() (the host need not wait for the device to finish the
            # last step before it queues this backward: it may run a step ahead).
            self._settle_step()
        to_backprop = scaled * self.loss_scaler.loss_scale if self.loss_scaler else scaled
        self._path_backward(to_backprop, retain_graph)
        return scaled.detach()

    def _path_backward(self, to_backprop: torch.Tensor, retain_graph: bool) -> None:
        if self._inside_no_sync and self.zero_stage >= 2:
            raise RuntimeError(
                f"engine.no_sync() cannot be used at ZeRO stage {self.zero_stage}: gradients are "
                "reduce-scattered into their owners' shards on every backward (only the owner "
                "keeps them), so there is no local gradient to accumulate. Use stage 0 or 1, "
                "or accumulate with gradient_accumulation_steps."
            )
        boundary = self.is_gradient_accumulation_boundary() and not self._inside_no_sync
        scaler = self.loss_scaler
        self.gradient_path.prepare_backward(
            boundary, scaler.loss_scale if scaler is not None else None
        )
        with self.timers.region("backward"):
            to_backprop.backward(retain_graph=retain_graph)
            self.gradient_path.finish_backward(boundary)

    def _record_loss(self, loss: torch.Tensor) -> None:
        value = loss.detach().float().reshape(())
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._loss_count += 1
        # An inf or nan in any micro-batch's loss makes the sum non-finite too.
        self._cycle_loss = value if self._cycle_loss is None else self._cycle_loss + value

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """Advance one micro-step; at an accumulation boundary, update the weights."""
        self._check_alive()
        if self._inside_no_sync:
            raise RuntimeError(
                "engine.step() was called inside engine.no_sync(): gradients have not been "
                "reduced across ranks yet. Leave the no_sync() block before stepping."
            )
        if self.is_gradient_accumulation_boundary():
            if self.optimizer is None:
                raise RuntimeError(
                    "engine.step() has no optimizer to run: pass initialize(optimizer=...) or "
                    "add an 'optimizer' block to the config"
                )
            if self.progressive_layer_drop is not None:
                # DeepSpeed's order: theta(global_steps) before the counter moves.
                self.progressive_layer_drop.update_state(self.global_steps)
            # Dynamic batching (slipstream.data): this step's global batch size, not the config's.
            samples = self._step_samples()
            with self.timers.region("step"):
                try:
                    self._take_optimizer_step(lr_kwargs)
                except OffloadIOError as error:  # e.g. DiskFullError while swapping states out
                    self._failed_step = (
                        f"its optimizer step {self.global_steps + 1} failed with "
                        f"{type(error).__name__}: {error}"
                    )
                    raise
            self._cycle_loss = None
            self.global_steps += 1
            self.global_samples += samples
            if self.data_efficiency is not None:
                self.data_efficiency.after_step()
            if self.compression_scheduler is not None:
                self.compression_scheduler.step()  # bits, masks and ratios of the next step
            if self.monitor.enabled:
                self._monitor_step()
            if self.global_steps % self.config.steps_per_print == 0:
                self._log_progress()
        self.micro_steps += 1
        self._boundary_override = None

    def _take_optimizer_step(self, lr_kwargs: dict[str, Any] | None) -> None:
        """The gradient path's step; what depends on whether it was skipped (counters, LR
        schedule, fp16 scale) follows in :meth:`_settle_step`, at once when the host knows,
        later when the skip was decided on the device."""
        if self._unsettled is not None:
            self._settle_step()  # two steps without a backward in between
        scaler = self.loss_scaler
        loss_scale = scaler.loss_scale if scaler is not None else None
        nonfinite = self._nonfinite_check_value() if self._check_nonfinite else None
        grad_norm = None
        if self._tp_size > 1:
            nonfinite, grad_norm = self._tensor_parallel_norm(nonfinite, loss_scale)
        with self._dynamic_batch_lr():
            outcome = self.gradient_path.step(
                loss_scale=loss_scale,
                max_grad_norm=self.config.gradient_clipping,
                grad_norm=grad_norm,
                nonfinite_check=nonfinite,
                # A fused optimizer skips on the device flag: no device->host sync per step.
                defer_skip=True,
            )
        self.zero_grad()
        self._unsettled = _UnsettledStep(
            self.global_steps + 1, outcome, lr_kwargs, _FlagCopy.start(outcome.skipped)
        )
        if outcome.skipped is None:
            self._settle_step()  # decided on the host already

    def _tensor_parallel_norm(
        self, nonfinite: torch.Tensor | None, loss_scale: float | None
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Tensor parallelism: sum the sequence-parallel replicas' gradients over the tensor
        group, and take the global norm (unscaled) over it; the path's own norm would span
        its data group only."""
        path = self.gradient_path
        if isinstance(path, ReplicatedGradientPath):
            grads = [s.grad for s in path.sources]
            reduce_sequence_parallel_grads_(self._params, grads, self._tp_group)
            pairs = [(p, g) for p, g in zip(self._params, grads) if g is not None]
            norm = tensor_parallel_grad_norm(
                [g for p, g in pairs if is_tensor_parallel(p)],
                [g for p, g in pairs if not is_tensor_parallel(p)],
                self._tp_group,
                self._device,
            )
            # The path votes over the world (vote_over_world): no tensor-group vote here.
            return nonfinite, norm / loss_scale if loss_scale not in (None, 1.0) else norm
        # AutoTP runs at stages 1-2: the gradients sit in the path's master shards.
        masters = path.masters  # type: ignore[attr-defined]
        grads = [masters.grad(i) for i in range(len(masters))]
        if nonfinite is None and loss_scale is not None:
            # fp16: the overflow vote must span the tensor group too (the ZeRO step folds
            # this scalar into its data-group vote; no extra host read).
            nonfinite = torch.zeros((), dtype=torch.float32, device=self._device)
        if nonfinite is not None:
            nonfinite = agree_nonfinite_across_tensor_group(nonfinite, grads, self._tp_group)
        reduce_sequence_parallel_grads_(masters.params, grads, self._tp_group)
        norm = zero_tensor_parallel_grad_norm(
            masters, self._zero_group(), self._tp_group, self._device, loss_scale
        )
        return nonfinite, norm

    def _settle_step(self) -> None:
        """Count the last step as taken or skipped, and follow up: the LR schedule moves on
        a taken step, the fp16 scale grows or backs off, a skip is logged.

        A skip decided on the device ([Note: the skip decided on the device] in
        slipstream.zero) is read here, lazily: before the next backward (fp16; otherwise only
        once its copy has landed), the next step, a
        log line, a checkpoint, or a read of the counters or the learning rate.
        """
        unsettled = self._unsettled
        if unsettled is None:
            return
        self._unsettled = None
        outcome = unsettled.outcome
        skipped = outcome.overflow if unsettled.flag is None else unsettled.flag.read()
        scaler = self.loss_scaler
        if skipped and scaler is None:
            self._skip_nonfinite_step(unsettled.step)
        elif skipped:
            assert scaler is not None
            old_scale = scaler.loss_scale
            scaler.update(True)
            self._skipped_steps += 1
            if self.global_rank == 0:
                logger.info(
                    "fp16 overflow at step %d (on some rank): skipping the update; loss scale "
                    "%g -> %g",
                    unsettled.step,
                    old_scale,
                    scaler.loss_scale,
                )
        else:
            self._last_grad_norm = outcome.grad_norm
            if scaler is not None:
                scaler.update(False)
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**(unsettled.lr_kwargs or {}))

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped (fp16 overflow, or an inf/nan under fp32/bf16)."""
        self._settle_step()
        return self._skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._settle_step()
        self._skipped_steps = int(value)

    @property
    def nonfinite_skipped_steps(self) -> int:
        """fp32/bf16 steps skipped for an inf or nan."""
        self._settle_step()
        return self._nonfinite_skipped_steps

    @nonfinite_skipped_steps.setter
    def nonfinite_skipped_steps(self, value: int) -> None:
        self._settle_step()
        self._nonfinite_skipped_steps = int(value)

    def _nonfinite_check_value(self) -> torch.Tensor:
        """This rank's losses since the last step (zero if none were recorded), on the device."""
        if self._cycle_loss is None:
            return torch.zeros((), dtype=torch.float32, device=self._device)
        return self._cycle_loss

    def _skip_nonfinite_step(self, step: int) -> None:
        """fp32/bf16: the step is skipped on every rank (they voted); say so, with the count."""
        self._skipped_steps += 1
        self._nonfinite_skipped_steps += 1
        if self.global_rank == 0:
            logger.warning(
                "non-finite loss or gradient at step %d (on some rank): skipping the update "
                "(weights, optimizer state and learning-rate schedule unchanged); %d step(s) "
                "skipped for inf/nan so far",
                step,
                self._nonfinite_skipped_steps,
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop all gradients (model and master); they are always set to None."""
        for param in self._params:
            param.grad = None
        # The path drops its masters' gradients (with overlap_forward, once the step that
        # still reads them is done).
        self.gradient_path.zero_grad()

    def _log_progress(self) -> None:
        self._settle_step()  # the skip flag read lazily, once per log line
        loss = None
        if self._loss_sum is not None:
            mean = self._loss_sum / max(self._loss_count, 1)
            if self.dp_world_size > 1:
                # One scalar all-reduce every steps_per_print steps, so the logged loss is the
                # mean over all ranks' micro-batches.
                comm.all_reduce(mean, group=self.dp_group)
                mean = mean / self.dp_world_size
            loss = float(mean)  # host sync, once per log line
        samples_per_s, tokens_per_s, mfu = self.throughput.rates()
        report = ProgressReport(
            step=self.global_steps,
            loss=loss,
            lr=self.get_lr(),
            loss_scale=self.loss_scaler.loss_scale if self.loss_scaler else None,
            grad_norm=self.get_global_grad_norm(),
            samples_per_s=samples_per_s,
            tokens_per_s=tokens_per_s,
            mfu=mfu,
            skipped_steps=self.skipped_steps,
        )
        self.last_report = report
        self._loss_sum, self._loss_count = None, 0
        if self.global_rank == 0:
            logger.info(report.format())
            if self.timers.enabled:
                logger.info(
                    "time per %d steps: %s", self.config.steps_per_print, self.timers.report()
                )

    def _monitor_train_loss(self, scaled: torch.Tensor) -> None:
        """DeepSpeed's ``Train/Samples/train_loss``: the sum of loss / GAS over the accumulation
        window (rank 0's own micro-batches), written by the window's last backward against
        the samples trained before this step."""
        if self.global_rank != 0:
            return
        value = scaled.detach().float()
        total = value if self._monitor_loss is None else self._monitor_loss + value
        self._monitor_loss = total
        if self.is_gradient_accumulation_boundary():
            self._monitor_loss = None
            # float(): a host sync per step, paid only while a monitor is enabled.
            events = [("Train/Samples/train_loss", float(total), self.global_samples)]
            self.monitor.write_events(events)

    def _monitor_step(self) -> None:
        """DeepSpeed's events after an optimizer step: the first group's learning rate, the
        fp16 loss scale, and with ``wall_clock_breakdown`` the step's forward, backward and
        step milliseconds."""
        self._settle_step()  # on every rank: the counters and scale stay equal
        if self.global_rank != 0:
            return
        samples = self.global_samples
        events = [("Train/Samples/lr", self.get_lr()[0], samples)]
        if self.loss_scaler is not None:
            events.append(("Train/Samples/loss_scale", self.loss_scaler.loss_scale, samples))
        for name, ms in self.timers.take_step_ms().items():
            events.append((f"Train/Samples/elapsed_time_ms_{name}", ms, samples))
        self.monitor.write_events(events)

    # ------------------------------------------------------------------ data efficiency
    def _setup_data_efficiency(self) -> None:
        runtime = self.data_efficiency
        if runtime is None:
            return
        offload = self.config.zero_optimization.optimizer_offload()
        if runtime.config.dynamic_batching_enabled and offload is not None:
            overlapped = [
                key
                for key in ("overlap_forward", "overlap_step", "speculative_step")
                if getattr(offload, key)
            ]
            if overlapped:
                raise NotImplementedError(
                    "data_efficiency.data_sampling.dynamic_batching with zero_optimization."
                    f"offload_optimizer.{'/'.join(overlapped)} on: those step the offloaded "
                    "optimizer during backward or after engine.step() returns, outside the "
                    "per-batch LR scaling; set them to false in offload_optimizer, or turn "
                    "dynamic batching off"
                )
        token_lr = runtime.layer_token_schedule(self.optimizer, self.lr_scheduler)
        if token_lr is not None:
            self.lr_scheduler = token_lr
        if runtime.random_ltd is not None and any(
            isinstance(m, RandomLayerTokenDrop) for m in self.module.modules()
        ):
            runtime.attach_random_ltd(self.module)

    def _step_samples(self) -> int:
        """Samples in the global batch being stepped: dynamic batching's, else the config's."""
        runtime = self.data_efficiency
        samples = runtime.dynamic_batch_samples() if runtime is not None else None
        return self._train_batch if samples is None else samples

    def _micro_samples(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        """Samples in this micro-batch (their count varies under dynamic batching)."""
        runtime = self.data_efficiency
        if runtime is None or runtime.dynamic_sampler is None:
            return self._micro_batch
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor) and value.dim() >= 1:
                return int(value.shape[0])
        return self._micro_batch

    @contextmanager
    def _dynamic_batch_lr(self) -> Iterator[None]:
        """Dynamic batching: the optimizer steps at the LR scaled for this global batch's size
        (lr_scaling_method); the unscaled LRs are back before the LR schedule steps."""
        runtime = self.data_efficiency
        factor = runtime.dynamic_lr_factor() if runtime is not None else None
        if factor is None or self.optimizer is None or factor == 1.0:
            yield
            return
        groups = self.optimizer.param_groups
        unscaled = [group["lr"] for group in groups]
        for group, lr in zip(groups, unscaled):
            group["lr"] = lr * factor
        try:
            yield
        finally:
            for group, lr in zip(groups, unscaled):
                group["lr"] = lr

    def _data_efficiency_runtime(self) -> DataEfficiency:
        if self.data_efficiency is None:
            self.data_efficiency = DataEfficiency(
                self.config.curriculum_learning,
                self.config.data_efficiency,
                global_batch_size=self._train_batch,
                micro_batch_size=self._micro_batch,
            )
        return self.data_efficiency

    def set_curriculum_learning_params(self, **params: Any) -> None:
        """Configure the legacy curriculum in code (curriculum_type, min/max_difficulty,
        schedule_type, schedule_config), as DeepSpeed's curriculum guide writes it."""
        self._data_efficiency_runtime().set_curriculum_learning_params(**params)

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict: dict[str, Any]) -> None:
        """Difficulty functions (``step -> difficulty``) for ``custom`` schedules, by metric."""
        self._data_efficiency_runtime().set_custom_curriculum_learning_schedule(schedule_func_dict)

    def set_data_post_process_func(self, post_process_func: Any) -> None:
        """``fn(batch, sampler_progress) -> batch`` for every batch of the curriculum loader."""
        self._data_efficiency_runtime().set_data_post_process_func(post_process_func)

    def random_ltd_initialize(self) -> None:
        """Attach the random-LTD scheduler to the module's RandomLayerTokenDrop wrappers
        (slipstream.data.convert_to_random_ltd(engine, LayerClass) calls it)."""
        self._data_efficiency_runtime().attach_random_ltd(self.module)

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
        """Save model, optimizer, schedule, loss scale, counters and RNG under ``save_dir/tag``.

        Collective, crash-safe and checked (docs/reliability.md): weights or optimizer state
        holding NaN/inf raise NonFiniteCheckpointError unless ``allow_non_finite`` (default:
        the config's ``checkpoint.allow_non_finite``); any rank's failure raises the same
        error on every rank.
        """
        self._check_alive()
        client_state = dict(client_state or {})
        if self.compression_scheduler is not None:
            client_state[COMPRESSION_STATE_KEY] = self.compression_scheduler.state_dict()
        with self._optimizer_resident():
            return checkpointing.save(
                self, save_dir, tag, client_state, save_latest, allow_non_finite
            )

    def _optimizer_resident(self) -> Any:
        """NVMe offload: masters and optimizer states in host memory for a checkpoint."""
        self._settle_step()  # the counters, scale and schedule a checkpoint stores
        return self.gradient_path.resident()

    def load_checkpoint(
        self,
        load_dir: str | Path,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[Path, dict[str, Any]]:
        """Restore a checkpoint; returns ``(path, client_state)``. Raises if it is missing or bad."""
        self._check_alive()
        with self._optimizer_resident():
            path, client_state = checkpointing.load(
                self,
                load_dir,
                tag,
                load_module_strict=load_module_strict,
                load_optimizer_states=load_optimizer_states and not load_module_only,
                load_lr_scheduler_states=load_lr_scheduler_states and not load_module_only,
                load_module_only=load_module_only,
            )
        compression_state = client_state.pop(COMPRESSION_STATE_KEY, None)
        if compression_state is not None and self.compression_scheduler is not None:
            self.compression_scheduler.load_state_dict(compression_state)
        if self.progressive_layer_drop is not None and self.global_steps > 0:
            # theta(t) is a function of the step count: restore the value the last step set.
            self.progressive_layer_drop.update_state(self.global_steps - 1)
        return path, client_state

    def save_16bit_model(
        self, save_dir: str | Path, save_filename: str = "model.safetensors"
    ) -> bool:
        """Save the module's weights in its dtype as one safetensors file (rank 0 writes).

        At ZeRO stage 3 every rank must call it, and it needs
        ``zero_optimization.stage3_gather_16bit_weights_on_model_save`` (else it warns and
        returns False, as DeepSpeed does).
        """
        from slipstream.runtime.model_export import save_16bit_model

        self.wait_for_step()
        if self._tp_size > 1:
            return save_tensor_parallel_16bit_model(
                self.module, self._tp_group, save_dir, save_filename
            )
        return save_16bit_model(self, save_dir, save_filename)

    @property
    def zero_group(self) -> DataParallelGroup:
        """The group ZeRO shards the optimizer state over (MiCS's shard group, hpZ's
        included); built once, on first use."""
        return self._zero_group()

    @property
    def stage3_model(self) -> Any:
        """The ZeRO-3 parameter owner (slipstream.zero's stage-3 model; None below stage 3)."""
        return self._stage3

    # Internal views used by the checkpoint module.
    @property
    def named_trainable_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(name, parameter) for every trainable parameter, in optimizer order."""
        return list(zip(self._param_names, self._params))

    # ------------------------------------------------------------------ DeepSpeed's engine surface
    # The accessors DeepSpeed's examples call on its engine, with DeepSpeed's meanings
    # (docs/deepspeed-compat.md lists them, and those that are absent).

    #: The loader ``initialize`` built from ``training_data`` (None without one).
    training_dataloader: Any = None

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (``LOCAL_RANK``)."""
        return comm.get_local_rank()

    @property
    def world_size(self) -> int:
        """Processes in the default group (all ranks)."""
        return comm.get_world_size()

    @property
    def data_parallel_group(self) -> Any:
        """The data-parallel process group (the default group unless an ``mpu`` gave one)."""
        return self.dp_group if self.dp_group is not None else dist.group.WORLD

    def fp16_enabled(self) -> bool:
        """Whether fp16 mixed precision is on."""
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        """Whether bf16 mixed precision is on."""
        return self.config.bf16.enabled

    def amp_enabled(self) -> bool:
        """False: Apex AMP is not supported (use fp16 or bf16)."""
        return False

    def zero_optimization(self) -> bool:
        """Whether a ZeRO stage (1-3) is on."""
        return self.zero_stage > 0

    def zero_optimization_stage(self) -> int:
        """The ZeRO stage, 0-3."""
        return self.zero_stage

    def zero_offload_optimizer(self) -> Any:
        """The ``offload_optimizer`` settings, or None."""
        return self.config.zero_optimization.optimizer_offload()

    def gradient_clipping(self) -> float:
        """The global gradient-norm clip (0: none)."""
        return self.config.gradient_clipping

    def steps_per_print(self) -> int:
        """Optimizer steps between progress lines."""
        return self.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        """Whether per-phase timers are on."""
        return self.config.wall_clock_breakdown

    def dynamic_loss_scale(self) -> bool:
        """Whether fp16 loss scaling is dynamic (``fp16.loss_scale`` 0)."""
        return self.config.fp16.loss_scale == 0

    def loss_scale(self) -> float:
        """The configured static fp16 loss scale (0: dynamic), as DeepSpeed's ``loss_scale()``."""
        return self.config.fp16.loss_scale

    @property
    def cur_scale(self) -> float:
        """The loss scale in use now (1.0 without fp16)."""
        self._settle_step()
        return float(self.loss_scaler.loss_scale) if self.loss_scaler is not None else 1.0

    def get_mom(self) -> list[Any]:
        """Each parameter group's momentum: Adam's ``betas`` or SGD's ``momentum``."""
        if self.optimizer is None:
            return []
        return [g.get("betas", g.get("momentum")) for g in self.optimizer.param_groups]

    def get_batch_info(self) -> tuple[int, int, int]:
        """(train batch size, micro-batch per GPU, gradient accumulation steps)."""
        return self._train_batch, self._micro_batch, self._gas

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch by changing gradient accumulation (the micro-batch stays)."""
        per_step = self._micro_batch * self._replicas  # SP ranks share a replica's samples
        if train_batch_size <= 0 or train_batch_size % per_step:
            raise ValueError(
                f"set_train_batch_size({train_batch_size}): the batch must be a positive "
                f"multiple of micro-batch x data-parallel replicas = {per_step}"
            )
        self._gas = train_batch_size // per_step
        self._train_batch = train_batch_size

    def empty_partition_cache(self) -> None:
        """ZeRO-3: free every gathered parameter no one holds, then the device cache."""
        if self._stage3 is not None:
            self._stage3.release_all()
        self.accelerator.empty_cache()

    def save_fp16_model(
        self, save_dir: str | Path, save_filename: str = "model.safetensors"
    ) -> bool:
        """DeepSpeed's older name of :meth:`save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename)

    def module_state_dict(self) -> dict[str, Any]:
        """The wrapped module's state dict (keys without the ``module.`` prefix); stages 0-2."""
        if self._stage3 is not None:
            raise NotImplementedError(
                "engine.module_state_dict() at ZeRO stage 3: the parameters are sharded; use "
                "engine.save_16bit_model(...) or read them inside "
                "slipstream.zero.GatheredParameters(list(engine.module.parameters()))"
            )
        self.wait_for_step()
        return self.module.state_dict()

    def __getattr__(self, name: str) -> Any:
        # As DeepSpeed's engine: what the engine lacks is looked up on the wrapped module.
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__["_modules"].get("module")
            if module is None or name.startswith("__"):
                raise
        try:
            return getattr(module, name)
        except AttributeError:
            raise AttributeError(
                f"neither the {type(self).__name__} nor its module ({type(module).__name__}) "
                f"has an attribute {name!r}"
            ) from None


COMPRESSION_STATE_KEY = "compression_scheduler"


@dataclass(frozen=True, slots=True)
class _UnsettledStep:
    """A step whose outcome the host has not read yet: its number, the path's outcome, and
    the scheduler's arguments for when it turns out taken."""

    step: int
    outcome: StepOutcome
    lr_kwargs: dict[str, Any] | None
    flag: _FlagCopy | None


def _compression_scheduler(
    model: torch.nn.Module, config: SlipstreamConfig
) -> CompressionScheduler | None:
    """The scheduler of ``compression_training`` (None when every technique is off).

    A model that ``init_compression`` has not prepared yet is prepared here (its parameters
    stay the same objects); layer reduction changes the model's depth, so it must happen
    before ``initialize``.
    """
    block = config.compression_training
    grouped = any(t.shared_parameters.enabled for t in block.techniques().values())
    if not grouped:
        # Nothing to schedule; layer reduction is a one-time change made by init_compression.
        return None
    if config.zero_optimization.stage == 3:
        raise ConfigError(
            "compression_training with zero_optimization.stage = 3 is not supported: the "
            "compressed layers need their whole weight in every forward; use stage 0, 1 or 2",
            "compression_training",
        )
    prepared = any(isinstance(module, CompressionState) for module in model.modules())
    if not prepared:
        if block.layer_reduction.enabled:
            raise ConfigError(
                "compression_training.layer_reduction changes the model's depth: call "
                "slipstream.compression.init_compression(model, config, teacher_model) before "
                "slipstream.initialize",
                "compression_training.layer_reduction",
            )
        init_compression(model, block)
    return CompressionScheduler(model, block)


def _refuse_partitioned(model: torch.nn.Module, stage: int) -> None:
    from slipstream.zero import sharded_state_of

    for name, param in model.named_parameters():
        if sharded_state_of(param) is not None:
            raise ValueError(
                f"parameter {name!r} was partitioned by slipstream.zero.Init, which only ZeRO "
                f"stage 3 can train; this config has zero_optimization.stage = {stage}. Set "
                '"stage": 3, or build the model outside zero.Init.'
            )


def _resolved_batch_triple(config: SlipstreamConfig) -> tuple[int, int, int]:
    sizes = (
        config.train_micro_batch_size_per_gpu,
        config.gradient_accumulation_steps,
        config.train_batch_size,
    )
    if any(size is None for size in sizes):
        raise ValueError(
            "the engine needs a config whose batch sizes are resolved: build it with "
            "slipstream.load_config(source, world_size=...)"
        )
    micro, gas, batch = (int(size) for size in sizes)  # type: ignore[arg-type]
    return micro, gas, batch


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(_cast_floats(v, dtype) for v in value)
    if isinstance(value, list):
        return [_cast_floats(v, dtype) for v in value]
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    return value
