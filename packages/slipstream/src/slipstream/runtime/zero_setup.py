"""Compose slipstream.zero for the engine: config -> ZeroSettings -> the stage's sharding calls."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from slipstream.config import SlipstreamConfig
from slipstream.zero import (
    DataParallelGroup,
    GradientPath,
    MultiGroupPath,
    ReduceSettings,
    ShardedOptimizerStates,
    ZeroSettings,
)

logger = logging.getLogger(__name__)

# DDP's default bucket (25 MiB of fp32) keeps several all-reduces in flight during backward;
# DeepSpeed's 5e8-element default would make one bucket and no overlap. An explicit
# `zero_optimization.reduce_bucket_size` in the user's config wins.
_DEFAULT_STAGE0_BUCKET_NUMEL = 25 * 1024 * 1024 // 4


def replicated_reduce_settings(config: SlipstreamConfig) -> ReduceSettings:
    """Stage 0's all-reduce (the plain and the pipeline engine): DDP's bucket size unless
    the config names one; DeepSpeed's pre-scaling, pre-divide factor and communication dtype."""
    explicit = (config.raw.get("zero_optimization") or {}).get("reduce_bucket_size")
    bucket = int(explicit) if explicit is not None else _DEFAULT_STAGE0_BUCKET_NUMEL
    return ReduceSettings(
        bucket_numel=bucket,
        prescale_gradients=config.prescale_gradients,
        gradient_predivide_factor=config.gradient_predivide_factor,
        communication_dtype=config.communication_data_type,
    )


def zero_settings(config: SlipstreamConfig) -> ZeroSettings:
    """Map the ``zero_optimization`` block (and the precision keys) to ZeroSettings.

    ``overlap_comm`` left unset follows DeepSpeed: on at stage 3, off at stages 1-2.
    """
    zero = config.zero_optimization
    overlap = zero.overlap_comm if zero.overlap_comm is not None else zero.stage == 3
    offload_optimizer, offload_param = offload_settings(config)
    leaf = zero.leaf_modules()
    return ZeroSettings(
        stage=zero.stage,
        reduce_bucket_numel=max(1, int(zero.reduce_bucket_size)),
        stage3_reduce_bucket_parts=int(zero.stage3_reduce_bucket_parts),
        allgather_bucket_numel=max(1, int(zero.allgather_bucket_size)),
        reduce_bucket_tail_numel=(
            int(zero.reduce_bucket_tail_size) if zero.reduce_bucket_tail_size is not None else None
        ),
        publish_transport=zero.publish_transport,
        reduce_scatter_max_ctas=int(zero.reduce_scatter_max_ctas),
        average_in_reduce_scatter=zero.average_in_reduce_scatter,
        overlap_comm=overlap,
        prefetch_numel=int(zero.stage3_prefetch_bucket_size),
        max_live_numel=int(zero.stage3_max_live_parameters),
        max_reuse_numel=int(zero.stage3_max_reuse_distance),
        param_persistence_numel=int(zero.stage3_param_persistence_threshold),
        model_persistence_numel=int(zero.stage3_model_persistence_threshold),
        communication_dtype=config.communication_data_type,
        gradient_predivide_factor=config.gradient_predivide_factor,
        prescale_gradients=config.prescale_gradients,
        offload_optimizer=offload_optimizer,
        offload_param=offload_param,
        leaf_module_classes=leaf["classes"],
        leaf_module_names=leaf["names"],
        leaf_module_name_suffixes=leaf["name_suffixes"],
    )


def zero_group(config: SlipstreamConfig, dp_group: Any) -> DataParallelGroup:
    """The group ZeRO shards over: ZeRO++ (qwZ, qgZ) and MiCS change its collectives."""
    from slipstream.kernels import get_accelerator
    from slipstream.zero.zeropp import build_zero_group

    zero = config.zero_optimization
    return build_zero_group(
        dp_group,
        quantize_weights=zero.zero_quantized_weights,
        quantize_gradients=zero.zero_quantized_gradients,
        mics_shard_size=zero.mics_shard_size,
        hpz_partition_size=zero.zero_hpz_partition_size,
        gradient_bits=zero.zero_quantized_gradients_bits,
        hierarchical_gather=zero.mics_hierarchical_params_gather,
        # DeepSpeed's node: the devices this process sees (GPUs per node).
        node_size=get_accelerator().device_count(),
    )


def offload_settings(config: SlipstreamConfig) -> tuple[Any, Any]:
    """``(OptimizerOffload | None, ParamOffload | None)`` from ``offload_*`` and ``aio``.

    Imports slipstream.offload only when a block asks for offload, and says which package to
    install when it is missing.
    """
    zero = config.zero_optimization
    optimizer, param = zero.optimizer_offload(), zero.param_offload()
    if optimizer is None and param is None:
        return None, None
    from slipstream.zero.offload import require_offload_package

    package = require_offload_package("zero_optimization.offload_optimizer/offload_param")
    aio_block = config.aio
    aio = package.AioSettings(
        block_size=aio_block.block_size,
        queue_depth=aio_block.queue_depth,
        intra_op_parallelism=aio_block.intra_op_parallelism,
        single_submit=aio_block.single_submit,
        overlap_events=aio_block.overlap_events,
        o_direct=aio_block.o_direct,
        verify_checksums=aio_block.verify_checksums,
        kernel_aio=aio_block.kernel_aio,
    )
    _warn_inert_offload_keys(optimizer, param)
    optimizer_settings = None
    if optimizer is not None:
        assert optimizer.device in ("cpu", "nvme")
        # The CPU step during backward (stages 1-2): exact without clipping or fp16 loss
        # scaling; speculative with either (the global norm, and the overflow vote, come only
        # at the end of backward).
        overlap = optimizer.overlap_step and optimizer.device == "cpu" and zero.stage in (1, 2)
        fp16 = config.fp16.enabled
        optimizer_settings = package.OptimizerOffload(
            device=optimizer.device,
            nvme_path=optimizer.nvme_path,
            pin_memory=optimizer.pin_memory,
            buffer_count=max(1, optimizer.buffer_count),
            pipeline_read=optimizer.pipeline_read,
            pipeline_write=optimizer.pipeline_write,
            sub_group_numel=max(1, int(zero.sub_group_size)),
            cores_fraction=optimizer.cpuadam_cores_perc,
            convert_grad_on_cpu=optimizer.convert_grad_on_cpu,
            aio=aio,
            # Step each bucket during backward when the update needs no global norm (no
            # clipping, no fp16 loss scaling): measured faster on 2x H200 (docs/benchmarks.md).
            overlap_step=overlap and config.gradient_clipping == 0 and not fp16,
            # With clipping or fp16: step during backward speculatively, kept when nothing is
            # clipped and nothing overflowed (docs/offload.md); the stage falls back to
            # stepping after backward where it cannot (no C++ Adam, too little host memory for
            # the spare buffers).
            speculative_step=overlap
            and (config.gradient_clipping > 0 or fp16)
            and optimizer.speculative_step,
            ratio=optimizer.ratio,
            threads=optimizer.threads,
            cpu_schedule=optimizer.cpu_schedule,
            cpu_stores=optimizer.cpu_stores,
            cpu_prefetch=optimizer.cpu_prefetch,
            early_upload=optimizer.early_upload,
            overlap_bucket_numel=max(1, int(optimizer.overlap_bucket_size)),
            gpu_share=optimizer.gpu_share,
            gil_switch_interval_us=optimizer.gil_switch_interval_us,
            merge_bucket_numel=int(optimizer.merge_bucket_size),
            upload_model_dtype=optimizer.upload_model_dtype and optimizer.device == "cpu",
        )
    param_settings = None
    if param is not None:
        assert param.device in ("cpu", "nvme")
        param_settings = package.ParamOffload(
            device=param.device,
            nvme_path=param.nvme_path,
            pin_memory=param.pin_memory,
            buffer_count=max(1, param.buffer_count),
            buffer_size=max(1, param.buffer_size),
            max_in_cpu=param.max_in_cpu,
            aio=aio,
        )
    return optimizer_settings, param_settings


def shard_module_for_stage3(
    module: torch.nn.Module,
    settings: ZeroSettings,
    group: DataParallelGroup,
    device: torch.device,
    dtype: torch.dtype | None,
    param_groups: Mapping[int, DataParallelGroup] | None = None,
) -> Any:
    """Stage 3: shard ``module``'s parameters in place (placement and cast included);
    ``param_groups``: parameters sharded over another group (expert parameters)."""
    from slipstream.zero.stage3 import shard_parameters

    return shard_parameters(
        module, settings, group=group, device=device, dtype=dtype, param_groups=param_groups
    )


def build_gradient_path(
    settings: ZeroSettings,
    group: DataParallelGroup,
    params: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    stage3_model: Any = None,
    expert_parts: Mapping[str, tuple[list[int], DataParallelGroup]] | None = None,
) -> GradientPath:
    """The ZeRO stage's gradient path for ``params``, with ``optimizer`` re-homed onto shards.

    ``expert_parts`` (stages 1-2): for each expert group, the indices into ``params`` of its
    parameters and its expert-data-parallel group; they become parts of a
    :class:`~slipstream.zero.MultiGroupPath` beside the dense part (at stage 3 the model's
    ``param_groups`` say the same, and ``attach_optimizer`` builds the parts).
    """
    if settings.stage == 3:
        return stage3_model.attach_optimizer(optimizer)  # type: ignore[no-any-return]
    if not expert_parts:
        return ShardedOptimizerStates(params, optimizer, settings, group)
    in_experts = {i for indices, _ in expert_parts.values() for i in indices}
    parts = [
        ShardedOptimizerStates(
            [p for i, p in enumerate(params) if i not in in_experts],
            optimizer,
            settings,
            group,
            strict_optimizer=False,
        )
    ]
    for indices, expert_group in expert_parts.values():
        parts.append(
            ShardedOptimizerStates(
                [params[i] for i in indices],
                optimizer,
                settings,
                expert_group,
                # Summed over the expert-DP group, averaged over every DP rank's loss.
                gradient_divisor=group.world_size,
                strict_optimizer=False,
            )
        )
    device = params[0].device if params else torch.device("cpu")
    return MultiGroupPath(parts, optimizer, group, device)


def _warn_inert_offload_keys(optimizer: Any, param: Any) -> None:
    """Say which offload keys were set to a non-default value that Slipstream does not use."""
    inert: list[str] = []
    if optimizer is not None:
        if optimizer.buffer_count != 4 and optimizer.device != "nvme":
            inert.append("offload_optimizer.buffer_count")
        if optimizer.fast_init:
            inert.append("offload_optimizer.fast_init")
        if not optimizer.convert_grad_on_cpu:
            inert.append("offload_optimizer.convert_grad_on_cpu")
    if param is not None and param.device == "cpu":  # NVMe parameters use all three
        for key, default in (("buffer_count", 5), ("buffer_size", 100_000_000)):
            if getattr(param, key) != default:
                inert.append(f"offload_param.{key}")
        if param.max_in_cpu != 1_000_000_000:
            inert.append("offload_param.max_in_cpu")
    if inert:
        logger.warning(
            "zero_optimization: %s have no effect in Slipstream (CPU parameter offload keeps "
            "every shard in host memory, only NVMe parameter offload reads them; buffer_count "
            "bounds NVMe optimizer swapping only; gradients reach the host in the communication "
            "dtype): see docs/offload.md",
            ", ".join(inert),
        )
