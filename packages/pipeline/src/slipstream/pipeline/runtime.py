"""Training and evaluation steps over a pipelined module, as plain functions.

``build_executor`` wires a :class:`PipelineModule` to its neighbours; ``train_batch`` runs one
optimizer step's worth of micro-batches through a schedule and applies the gradient steps of
:mod:`slipstream.pipeline.gradients` and the optimizer; ``eval_batch`` runs forward only. The
umbrella's PipelineEngine composes these with the config; they work without it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.pipeline.executor import PipelineExecutor
from slipstream.pipeline.gradients import (
    allreduce_data_parallel_gradients,
    clip_grad_norm_across_stages,
    reduce_tied_gradients,
)
from slipstream.pipeline.module import PipelineModule
from slipstream.pipeline.p2p import StageCommunicator
from slipstream.pipeline.schedules import PipelineSchedule, forward_only

__all__ = [
    "StepResult",
    "aggregate_loss",
    "build_executor",
    "build_optimizer",
    "eval_batch",
    "train_batch",
]


def build_optimizer(
    spec: torch.optim.Optimizer | Mapping[str, Any] | Callable[[list[torch.Tensor]], Any],
    params: Iterable[torch.Tensor],
) -> torch.optim.Optimizer:
    """An optimizer over this stage's ``params``: ``spec`` itself when it is one, ``spec(params)``
    for a factory, or a DeepSpeed-style block ``{"type": "AdamW", "params": {"lr": 1e-4}}``
    naming any ``torch.optim`` class (case-insensitive).

    >>> opt = build_optimizer({"type": "sgd", "params": {"lr": 0.1}}, [torch.zeros(1, requires_grad=True)])
    >>> type(opt).__name__, opt.defaults["lr"]
    ('SGD', 0.1)
    """
    if isinstance(spec, torch.optim.Optimizer):
        return spec
    trainable = [p for p in params if p.requires_grad]
    if isinstance(spec, Mapping):
        unknown = set(spec) - {"type", "params"}
        if "type" not in spec or unknown:
            raise ValueError(
                f"an optimizer block needs 'type' and optionally 'params', got keys {sorted(spec)}"
            )
        classes = {
            name.lower(): getattr(torch.optim, name)
            for name in dir(torch.optim)
            if isinstance(getattr(torch.optim, name), type)
            and issubclass(getattr(torch.optim, name), torch.optim.Optimizer)
        }
        name = str(spec["type"]).lower()
        if name not in classes:
            raise ValueError(
                f"optimizer type {spec['type']!r} is not a torch.optim class; choose one of "
                f"{', '.join(sorted(classes))}"
            )
        return classes[name](trainable, **dict(spec.get("params") or {}))
    if callable(spec):
        return spec(trainable)
    raise TypeError(
        f"cannot make an optimizer from {type(spec).__name__}: pass a torch optimizer, a "
        "factory taking the parameters, or {'type': ..., 'params': {...}}"
    )


def _module_device(module: PipelineModule) -> torch.device:
    for tensor in [*module.parameters(), *module.buffers()]:
        return tensor.device
    return torch.device("cpu")


def build_executor(
    module: PipelineModule,
    device: torch.device | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> PipelineExecutor:
    """The executor for this rank's stage of ``module``, with its communicator.

    Collective when the module spans several ranks (it creates the message groups and makes
    the copies of tied weights equal): call it on every rank, after moving the module to its
    device.

    >>> executor = build_executor(module)  # doctest: +SKIP
    """
    device = device or _module_device(module)
    grid = module.mpu()
    if not module.tied_weights_synchronized:
        module.synchronize_tied_weights()
    communicator = None
    if grid is not None:
        groups = StageCommunicator.create_groups(
            module.topology().get_axis_comm_lists("pipe")
            or [[r] for r in range(dist.get_world_size())],
            grid.global_rank,
        )
        communicator = StageCommunicator(grid.group_ranks("pipe"), grid.stage_id, device, groups)
    elif module.num_chunks > 1:
        communicator = StageCommunicator([0], 0, device, {})
    return PipelineExecutor(module, communicator, device, autocast_dtype=autocast_dtype)


class StepResult(NamedTuple):
    """``(loss, grad_norm)`` of a training step.

    ``loss`` is the mean over the batch's micro-batches and data-parallel replicas, on every
    rank; ``grad_norm`` the global gradient norm before clipping (None when not measured).
    """

    loss: torch.Tensor
    grad_norm: torch.Tensor | None


def aggregate_loss(
    executor: PipelineExecutor, losses: list[torch.Tensor], device: torch.device
) -> torch.Tensor:
    """Mean of the last stage's micro-batch ``losses``, averaged over data-parallel
    replicas and broadcast to every stage (collective over the data and pipe groups)."""
    module = executor.module
    grid = module.mpu()
    value = (
        torch.stack(losses).mean()
        if losses
        else torch.zeros((), dtype=torch.float32, device=device)
    )
    if grid is None:
        return value
    value = value.to(device)
    last = module.num_stages - 1
    if grid.stage_id == last and grid.data_parallel_size > 1:
        comm.all_reduce(value, group=grid.get_data_parallel_group())
        value /= grid.data_parallel_size
    if grid.pipe_parallel_size > 1:
        comm.broadcast(value, src=grid.stage_to_global(last), group=grid.get_pipe_parallel_group())
    return value


def train_batch(
    executor: PipelineExecutor,
    schedule: PipelineSchedule,
    data_iter: Iterator[Any] | None,
    optimizer: torch.optim.Optimizer,
    *,
    max_grad_norm: float = 0.0,
    measure_grad_norm: bool = True,
    before_step: Callable[[list[torch.Tensor]], bool] | None = None,
) -> StepResult:
    """One optimizer step over ``schedule.num_microbatches`` micro-batches.

    In order: the schedule's forwards and backwards; tied-weight gradient sums; the
    data-parallel gradient mean; ``before_step(gradients)`` (fp16 unscaling and the overflow
    vote: when it returns True the step is skipped, the gradients dropped and the norm is
    None); the global norm (clipped to ``max_grad_norm`` when > 0); ``optimizer.step()``;
    ``optimizer.zero_grad()``. Collective over the whole grid.

    >>> loss, norm = train_batch(executor, one_f_one_b(2, 4), iter(batches), optimizer)  # doctest: +SKIP
    """
    if not schedule.train:
        raise ValueError(f"schedule {schedule.name} is forward-only; use eval_batch")
    module = executor.module
    module.train()
    result = executor.run(schedule, data_iter)
    reduce_tied_gradients(module)
    grid = module.mpu()
    params = [p for p in module.parameters() if p.requires_grad]
    if grid is not None:
        allreduce_data_parallel_gradients(params, grid.get_data_parallel_group())
    if before_step is not None and before_step([p.grad for p in params if p.grad is not None]):
        optimizer.zero_grad(set_to_none=True)
        return StepResult(aggregate_loss(executor, result.losses, executor.device), None)
    grad_norm = None
    if max_grad_norm > 0 or measure_grad_norm:
        grad_norm = clip_grad_norm_across_stages(
            module,
            max_grad_norm,
            grid.get_pipe_parallel_group() if grid is not None else None,
            params,
            device=executor.device,
            tensor_group=(
                grid.get_model_parallel_group()
                if grid is not None and grid.model_parallel_size > 1
                else None
            ),
        )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(aggregate_loss(executor, result.losses, executor.device), grad_norm)


def eval_batch(
    executor: PipelineExecutor,
    data_iter: Iterator[Any] | None,
    num_microbatches: int,
    *,
    compute_loss: bool = True,
    return_logits: bool = False,
) -> tuple[torch.Tensor | None, list[Any] | None]:
    """Forward ``num_microbatches`` micro-batches without gradients.

    Returns ``(loss, logits)``: the mean loss on every rank (None when ``compute_loss`` is
    False) and, on the last stage when ``return_logits``, the last part's outputs per
    micro-batch (None elsewhere).
    """
    module = executor.module
    was_training = module.training
    module.eval()
    try:
        schedule = forward_only(module.num_stages, num_microbatches, module.num_chunks)
        result = executor.run(
            schedule, data_iter, compute_loss=compute_loss, return_outputs=return_logits
        )
    finally:
        module.train(was_training)
    loss = aggregate_loss(executor, result.losses, executor.device) if compute_loss else None
    logits = result.outputs if return_logits and result.outputs else None
    return loss, logits
