"""Compose slipstream.zero for the engine: config -> ZeroSettings -> the stage's sharding calls."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from slipstream.config import SlipstreamConfig
from slipstream.zero import DataParallelGroup, ShardedOptimizerStates, ZeroOptimizer, ZeroSettings

if TYPE_CHECKING:
    from slipstream.zero import ShardedMasterWeights, ShardSpec


class ZeroGradientPath(Protocol):
    """What the engine needs from a ZeRO stage: the backward bracket and the sharded optimizer."""

    optimizer: ZeroOptimizer
    masters: ShardedMasterWeights
    specs: list[ShardSpec]
    params: list[torch.nn.Parameter]

    def prepare_backward(self, is_boundary: bool) -> None: ...

    def finish_backward(self, is_boundary: bool = True) -> None: ...

    def zero_grad(self) -> None: ...


def zero_settings(config: SlipstreamConfig) -> ZeroSettings:
    """Map the ``zero_optimization`` block (and the precision keys) to ZeroSettings.

    ``overlap_comm`` left unset follows DeepSpeed: on at stage 3, off at stages 1-2.
    """
    zero = config.zero_optimization
    overlap = zero.overlap_comm if zero.overlap_comm is not None else zero.stage == 3
    return ZeroSettings(
        stage=zero.stage,
        reduce_bucket_numel=max(1, int(zero.reduce_bucket_size)),
        allgather_bucket_numel=max(1, int(zero.allgather_bucket_size)),
        overlap_comm=overlap,
        prefetch_numel=int(zero.stage3_prefetch_bucket_size),
        max_live_numel=int(zero.stage3_max_live_parameters),
        max_reuse_numel=int(zero.stage3_max_reuse_distance),
        param_persistence_numel=int(zero.stage3_param_persistence_threshold),
        model_persistence_numel=int(zero.stage3_model_persistence_threshold),
        communication_dtype=config.communication_data_type,
        gradient_predivide_factor=config.gradient_predivide_factor,
        prescale_gradients=config.prescale_gradients,
    )


def shard_module_for_stage3(
    module: torch.nn.Module,
    settings: ZeroSettings,
    group: DataParallelGroup,
    device: torch.device,
    dtype: torch.dtype | None,
) -> Any:
    """Stage 3: shard ``module``'s parameters in place (placement and cast included)."""
    from slipstream.zero.stage3 import shard_parameters

    return shard_parameters(module, settings, group=group, device=device, dtype=dtype)


def attach_optimizer(
    settings: ZeroSettings,
    group: DataParallelGroup,
    params: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    stage3_model: Any = None,
) -> ZeroGradientPath:
    """Re-home ``optimizer`` onto master shards and install the stage's gradient path."""
    if settings.stage == 3:
        return stage3_model.attach_optimizer(optimizer)  # type: ignore[no-any-return]
    return ShardedOptimizerStates(params, optimizer, settings, group)
