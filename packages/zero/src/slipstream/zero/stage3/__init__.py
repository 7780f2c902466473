"""ZeRO stage 3: parameters sharded across the data-parallel group, gathered per module."""

from __future__ import annotations

from slipstream.zero.stage3.model import (
    Stage3GradientPath,
    Stage3Model,
    register_external_parameter,
    shard_parameters,
)
from slipstream.zero.stage3.sharded_param import ShardedParameter, sharded_state_of
from slipstream.zero.stage3.state import ShardState, TrainingState
from slipstream.zero.stage3.unit import ParamUnit

__all__ = [
    "ParamUnit",
    "ShardState",
    "ShardedParameter",
    "Stage3GradientPath",
    "Stage3Model",
    "TrainingState",
    "register_external_parameter",
    "shard_parameters",
    "sharded_state_of",
]
