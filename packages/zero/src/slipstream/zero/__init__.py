"""ZeRO for plain PyTorch modules: replicated (0), sharded optimizer states (1), gradients (2), parameters (3).

Composable calls over an ``nn.Module`` and a torch optimizer, no engine needed::

    from slipstream.zero import ZeroSettings, ShardedOptimizerStates, shard_parameters

    # stages 1-2: the module keeps full parameters; the optimizer sees only shards
    zero = ShardedOptimizerStates(list(model.parameters()), optimizer, ZeroSettings(stage=2))
    loss.backward(); zero.finish_backward(); zero.optimizer.step(); zero.zero_grad()

    # stage 3: each rank keeps 1/N of every parameter; hooks gather them per module
    sharded = shard_parameters(model, ZeroSettings(stage=3))
    zero = sharded.attach_optimizer(optimizer)

``slipstream.initialize`` composes the same calls from ``zero_optimization.stage``.
See docs/zero.md.
"""

from __future__ import annotations

from slipstream.zero.allreduce import GradientReducer, ReduceSettings
from slipstream.zero.gradient_path import GradientPath, MultiGroupPath
from slipstream.zero.group import DataParallelGroup
from slipstream.zero.init_context import GatheredParameters, Init
from slipstream.zero.layout import ShardSpec
from slipstream.zero.masters import ShardedMasterWeights
from slipstream.zero.optimizer import StepOutcome, ZeroOptimizer, supports_device_skip
from slipstream.zero.replicated import ExpertGroup, MasterWeights, ReplicatedGradientPath
from slipstream.zero.settings import ZeroSettings
from slipstream.zero.stage3 import (
    ShardedParameter,
    Stage3Model,
    register_external_parameter,
    shard_parameters,
    sharded_state_of,
)
from slipstream.zero.stage12 import ShardedOptimizerStates

__all__ = [
    "DataParallelGroup",
    "ExpertGroup",
    "GatheredParameters",
    "GradientPath",
    "GradientReducer",
    "Init",
    "MasterWeights",
    "MultiGroupPath",
    "ReduceSettings",
    "ReplicatedGradientPath",
    "ShardSpec",
    "ShardedMasterWeights",
    "ShardedOptimizerStates",
    "ShardedParameter",
    "Stage3Model",
    "StepOutcome",
    "ZeroOptimizer",
    "ZeroSettings",
    "register_external_parameter",
    "shard_parameters",
    "sharded_state_of",
    "supports_device_skip",
]
