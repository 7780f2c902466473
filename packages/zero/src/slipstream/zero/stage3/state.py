"""The two state machines of stage 3: a parameter's shard state and a unit's training state."""

from __future__ import annotations

from enum import Enum, auto

__all__ = ["ShardState", "TrainingState"]


class ShardState(Enum):
    """Whether a parameter's full data exists on this rank.

    SHARDED: only the shard exists; the parameter keeps its shape but its storage has zero
    bytes (it must not be read: use GatheredParameters). UNSHARDED: the storage holds the gathered full tensor.
    """

    SHARDED = auto()
    UNSHARDED = auto()


class TrainingState(Enum):
    """Where a parameter unit (one module's parameters) is in the iteration.

    IDLE -> FORWARD (between its pre- and post-forward hooks) -> IDLE ... -> PRE_BACKWARD
    (gathered for its backward, from the first gradient reaching one of its outputs) ->
    POST_BACKWARD (its own gradients are in their buckets; parameters released) -> IDLE at
    the end of backward.
    """

    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()
    POST_BACKWARD = auto()
