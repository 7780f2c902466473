"""AutoTP at ``initialize``: the DP × TP process grid, the model's sharding and TP-aware norms."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.comm.config import TensorParallelConfig
from slipstream.comm.tensor_parallel import (
    gather_tensor_parallel_state_dict,
    shard_hf_decoder_for_training,
)
from slipstream.comm.topology import PipeModelDataParallelTopology, ProcessGrid
from slipstream.config.loading import ConfigSource, read_config_source
from slipstream.kernels import get_accelerator
from slipstream.kernels.config_schema import ConfigError

__all__ = [
    "agree_nonfinite_across_tensor_group",
    "apply_autotp",
    "autotp_size",
    "check_tensor_parallel_support",
    "clip_by_norm_",
    "is_tensor_parallel",
    "reduce_sequence_parallel_grads_",
    "refuse_autotp_for_pipelines",
    "save_tensor_parallel_16bit_model",
    "tensor_parallel_grad_norm",
    "with_data_group",
    "zero_tensor_parallel_grad_norm",
]

logger = logging.getLogger(__name__)


def _tensor_parallel_block(source: ConfigSource) -> TensorParallelConfig:
    raw, _ = read_config_source(source)
    block = raw.get("tensor_parallel") or {}
    return TensorParallelConfig.from_dict(block, "tensor_parallel")


def autotp_size(source: ConfigSource) -> int:
    """``tensor_parallel.autotp_size`` of the config (0 or 1: AutoTP is off)."""
    return int(_tensor_parallel_block(source).autotp_size)


def apply_autotp(
    model: torch.nn.Module,
    source: ConfigSource,
    mpu: Any,
    optimizer: Any = None,
    model_parameters: Any = None,
) -> tuple[Any, Any]:
    """Shard ``model`` over ``tensor_parallel.autotp_size`` ranks.

    Returns ``(mpu, model_parameters)``: the mpu to train with, and ``model_parameters``
    re-taken from the sharded model (the caller's list named the unsharded parameters).

    Builds a :class:`ProcessGrid` with axes (pipe=1, data=world/tp, tensor=tp), tensor-parallel
    ranks adjacent, unless the caller passed an ``mpu`` of that tensor-parallel size. Every
    rank of a tensor-parallel group first receives its group rank 0's full weights (so the
    slices fit together whatever each rank loaded), then keeps its shard. Both come back
    unchanged when ``autotp_size`` is 0 or 1.
    """
    size = _tensor_parallel_block(source).autotp_size
    if size <= 1:
        return mpu, model_parameters
    world = comm.get_world_size()
    if world % size:
        raise ConfigError(
            f"tensor_parallel.autotp_size = {size} does not divide the world size {world}; "
            f"choose a tensor-parallel size that divides {world} (the data-parallel size is "
            "world_size / autotp_size)",
            "tensor_parallel.autotp_size",
        )
    if mpu is not None:
        given = int(mpu.get_model_parallel_world_size())
        if given != size:
            raise ConfigError(
                f"tensor_parallel.autotp_size = {size} but the mpu passed to initialize has a "
                f"tensor-parallel size of {given}; make them agree or drop one of them",
                "tensor_parallel.autotp_size",
            )
        grid = mpu
    else:
        grid = ProcessGrid(
            PipeModelDataParallelTopology(num_pp=1, num_mp=size, num_dp=world // size)
        )
    group = grid.get_model_parallel_group()
    _broadcast_within_group(model, group)
    shard_hf_decoder_for_training(model, group)
    if comm.get_rank() == 0:
        logger.info(
            "AutoTP: %s sharded over %d tensor-parallel ranks; data-parallel size %d",
            type(model).__name__,
            size,
            world // size,
        )
    if model_parameters is not None:
        model_parameters = [p for p in model.parameters() if p.requires_grad]
    return with_data_group(grid), model_parameters


def with_data_group(mpu: Any) -> Any:
    """``mpu``, or a view of it whose one-rank data axis answers with a one-rank group.

    A :class:`ProcessGrid` has no group for an axis of size 1 (None), which the engine would
    read as "the whole world" and reduce gradients over the tensor-parallel ranks.
    """
    if (
        mpu is None
        or mpu.get_data_parallel_group() is not None
        or int(mpu.get_data_parallel_world_size()) != 1
        or comm.get_world_size() == 1
    ):
        return mpu
    return _SingleRankDataAxis(mpu)


class _SingleRankDataAxis:
    """An mpu whose data axis has one rank, answered with a one-rank group.

    The grid has no group for an axis of size 1 (None), but the engine reads a None data
    group as "the whole world"; a real one-rank group keeps its reductions on this rank.
    """

    def __init__(self, grid: Any) -> None:
        self._grid = grid
        # new_group is collective over the world: every rank creates every singleton.
        self._data_group: dist.ProcessGroup | None = None
        for rank in range(dist.get_world_size()):
            made = dist.new_group([rank])
            if rank == dist.get_rank():
                self._data_group = made

    def get_data_parallel_group(self) -> dist.ProcessGroup | None:
        """This rank alone."""
        return self._data_group

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)


def refuse_autotp_for_pipelines(source: ConfigSource) -> None:
    """AutoTP shards Hugging Face decoders; a PipelineModule brings its own tensor axis."""
    size = _tensor_parallel_block(source).autotp_size
    if size > 1:
        raise ConfigError(
            f"tensor_parallel.autotp_size = {size} with a PipelineModule: AutoTP shards Hugging "
            "Face decoders, not pipeline stages. Build the stages from slipstream.comm."
            "tensor_parallel's layers over the topology's tensor group and pass the module a "
            "PipeModelDataParallelTopology with num_mp > 1 instead (docs/tensor-parallel.md)",
            "tensor_parallel.autotp_size",
        )


def _broadcast_within_group(model: torch.nn.Module, group: dist.ProcessGroup | None) -> None:
    # One tensor at a time through the accelerator (NCCL cannot send host tensors), so the
    # whole unsharded model never sits on the device.
    if group is None:
        return
    device = get_accelerator().device()
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            staged = tensor.data.to(device)
            comm.broadcast(staged, src=src, group=group)
            if staged is not tensor.data:
                tensor.data.copy_(staged)


def check_tensor_parallel_support(model: torch.nn.Module, config: Any) -> None:
    """Refuse, by name, what the engine cannot yet train with tensor parallelism."""
    stage = config.zero_optimization.stage
    if stage == 3:
        raise NotImplementedError(
            "zero_optimization.stage = 3 with tensor parallelism (tensor_parallel.autotp_size "
            "or an mpu with a tensor axis): ZeRO-3 would have to shard the tensor-parallel "
            "shards over the data axis. Use stage 1 or 2 (as DeepSpeed's AutoTP training does)"
        )
    marked = [n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)]
    if marked and hasattr(model, "num_stages"):
        raise NotImplementedError(
            f"parameters {marked[:3]} are marked sequence_parallel in a PipelineModule: the "
            "pipeline engine does not all-reduce their gradients over the tensor group yet. "
            "Build the stages without sequence_parallel=True"
        )


def is_tensor_parallel(param: torch.Tensor) -> bool:
    """Whether ``param`` is one shard of a tensor-parallel parameter (``tp_partition_dim``)."""
    return getattr(param, "tp_partition_dim", None) is not None and getattr(param, "tp_size", 1) > 1


def tensor_parallel_grad_norm(
    sharded: Sequence[torch.Tensor],
    replicated: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> torch.Tensor:
    """The L2 norm of the whole gradient: shards' squares summed over ``group``, replicas once."""

    def squares(grads: Sequence[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=device)
        return torch.stack([g.float().pow(2).sum() for g in grads]).sum().to(device)

    total = squares(sharded)
    if group is not None:
        comm.all_reduce(total, group=group)
    return (total + squares(replicated)).sqrt()


def clip_by_norm_(grads: Sequence[torch.Tensor], total: torch.Tensor, max_norm: float) -> None:
    """Scale ``grads`` so that ``total`` becomes at most ``max_norm`` (torch's coefficient)."""
    if not grads or max_norm <= 0 or math.isinf(max_norm):
        return
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_(list(grads), coefficient.to(grads[0].device))


def save_tensor_parallel_16bit_model(
    module: torch.nn.Module, tp_group: Any, save_dir: Any, save_filename: str
) -> bool:
    """Gather ``module``'s shards over ``tp_group``; global rank 0 writes one safetensors file."""
    from pathlib import Path

    from safetensors.torch import save_file

    state = gather_tensor_parallel_state_dict(module, tp_group)
    if comm.get_rank() == 0:
        path = Path(save_dir)
        path.mkdir(parents=True, exist_ok=True)
        # safetensors refuses shared storage: each name gets its own copy (tied weights).
        save_file(
            {name: t.detach().to("cpu").clone().contiguous() for name, t in state.items()},
            str(path / save_filename),
        )
    comm.barrier()
    return True


def agree_nonfinite_across_tensor_group(
    check: torch.Tensor, grads: Sequence[torch.Tensor | None], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """``check`` (the losses' scalar for the ZeRO step's non-finite vote; under fp16 a zero),
    or inf when any rank of the tensor group sees an inf/nan in its loss or gradient shards.

    The ZeRO vote (fp16's overflow vote as well as fp32/bf16's non-finite one) spans the
    data-parallel group only; tensor-parallel ranks hold different gradient shards, so
    without this one could skip a step that its peers take (and, under fp16, halve its loss
    scale alone). One scalar MAX all-reduce, no host synchronisation: the result rides into
    the ZeRO step's own vote as its ``nonfinite_check``.
    """
    from slipstream.kernels.loss_scaler import inf_or_nan_flag

    flag = inf_or_nan_flag([*grads, check.detach()])
    if flag is None:
        flag = torch.zeros((), dtype=torch.float32, device=check.device)
    if group is not None:
        comm.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return torch.where(flag > 0, torch.full_like(check, math.inf), check)


def zero_tensor_parallel_grad_norm(
    masters: Any,
    data_group: Any,
    tensor_group: dist.ProcessGroup | None,
    device: torch.device,
    loss_scale: float | None,
) -> torch.Tensor:
    """The global gradient norm of a ZeRO 1-2 run with tensor parallelism, for its step.

    ``masters`` are the path's fp32 master shards (one per parameter, over the data group):
    each rank's squares are summed over the data group, and those of tensor-parallel shards
    also over the tensor group (replicated parameters count once). Unscaled by ``loss_scale``.
    """
    sharded: list[torch.Tensor] = []
    replicated: list[torch.Tensor] = []
    for index, param in enumerate(masters.params):
        grad = masters.grad(index)
        if grad is not None:
            (sharded if is_tensor_parallel(param) else replicated).append(grad)

    def squares(grads: list[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=device)
        return torch.stack([g.float().pow(2).sum().to(device) for g in grads]).sum()

    parts = torch.stack([squares(sharded), squares(replicated)])
    data_group.sum_(parts)
    shards = parts[0].clone()
    if tensor_group is not None:
        comm.all_reduce(shards, group=tensor_group)
    norm = (shards + parts[1]).sqrt()
    return norm / loss_scale if loss_scale not in (None, 1.0) else norm


def reduce_sequence_parallel_grads_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    group: dist.ProcessGroup | None,
) -> None:
    """Sum over the tensor group the gradients (``grads[i]`` of ``params[i]``, masters or the
    parameters' own) of parameters marked ``sequence_parallel``: each TP rank saw only its
    sequence chunk. Data-parallel and tensor-parallel sums commute, so this may run after the
    data-parallel reduction, on ZeRO's master shards as well (they are aligned across TP)."""
    if group is None:
        return
    for param, grad in zip(params, grads):
        if grad is not None and getattr(param, "sequence_parallel", False):
            comm.all_reduce(grad, group=group)
