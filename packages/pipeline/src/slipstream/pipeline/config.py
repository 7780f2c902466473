"""The ``pipeline`` config block: DeepSpeed's keys plus the schedule to run."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from slipstream.kernels.config_schema import ConfigBlock, config_fail

__all__ = ["PipelineConfig"]


def _parse_stages(value: Any, path: str) -> int | Literal["auto"]:
    if value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        config_fail(path, value, '"auto" or an integer >= 1')
    return int(value)


@dataclasses.dataclass(kw_only=True)
class PipelineConfig(ConfigBlock):
    """``"pipeline": {...}``: how the PipelineEngine runs a :class:`PipelineModule`.

    DeepSpeed's keys (``stages``, ``partition``, ``seed_layers``,
    ``activation_checkpoint_interval``) describe the module, which is built before the engine;
    here they are checked against the module given (a mismatch is an error naming both
    values) rather than silently ignored. ``pipe_partitioned`` and ``grad_partitioned``
    split inter-stage tensors across tensor-parallel ranks; without tensor parallelism they
    have nothing to split. Slipstream adds ``schedule``: ``"1f1b"`` (DeepSpeed's, the
    default), ``"gpipe"``, ``"interleaved_1f1b"`` (needs ``PipelineModule(...,
    virtual_stages>1)``) or ``"zero_bubble"``.

    >>> PipelineConfig.from_dict({"schedule": "zero_bubble"}, "pipeline").schedule
    'zero_bubble'
    """

    stages: int | Literal["auto"] = dataclasses.field(
        default="auto",
        metadata={"parser": _parse_stages, "allow_auto": True},
    )
    partition: str = "best"
    seed_layers: bool = False
    activation_checkpoint_interval: int = dataclasses.field(default=0, metadata={"ge": 0})
    pipe_partitioned: bool = True
    grad_partitioned: bool = True
    schedule: Literal["1f1b", "gpipe", "interleaved_1f1b", "zero_bubble"] = "1f1b"
