"""The checkpoint manager: every part of a run hands its state over through one protocol.

A checkpoint (see checkpoint_store.py for the directory protocol) holds two kinds of state:

- **tensors laid out by the run's parallelism** (weights, fp32 masters, optimizer moments),
  written per rank by a layout writer: stage 0 (checkpoint.py), ZeRO (zero_checkpoint.py),
  pipelines (pipeline_checkpoint.py); they reach the gradient path's state through
  :func:`gradient_path_state` alone;
- **the state of every other part** (engine counters and loss scale, learning-rate
  schedule, data sampler/curriculum, RNG), each a :class:`Stateful` with a name. The
  manager writes each replicated part's ``state_dict()`` into one object file
  (``state.<name>.json``, or ``.pt`` where it is not JSON), lists them in the manifest's
  ``parts``, and gives each its state back with ``load_state_dict`` on load; the RNG is a
  per-rank part (``rng.rank<R>.safetensors``).

So no checkpoint code reads an engine's private attributes: the engines build their parts
with :func:`engine_parts` from public attributes, and the one adapter
:func:`gradient_path_state` is the only place that knows how the gradient path is reached.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = [
    "CheckpointParts",
    "EngineCounters",
    "GradientPathState",
    "Stateful",
    "engine_parts",
    "gradient_path_state",
]


@runtime_checkable
class Stateful(Protocol):
    """What a part of a run gives the checkpoint manager (torch's own objects qualify)."""

    def state_dict(self) -> Any:
        """The part's state (JSON-able values and tensors)."""
        ...

    def load_state_dict(self, state: Any) -> None:
        """Take back what ``state_dict`` returned."""
        ...


class EngineCounters:
    """An engine's step counters (and its fp16 loss scale) as a :class:`Stateful`.

    Reads and writes the public attributes ``fields`` of ``engine``; ``loss_scaler`` (when
    not None) is saved inside, as DeepSpeed keeps it beside the counters.
    """

    def __init__(self, engine: Any, fields: tuple[str, ...], loss_scaler: Any = None) -> None:
        self.engine = engine
        self.fields = fields
        self.loss_scaler = loss_scaler

    def state_dict(self) -> dict[str, Any]:
        """The counters, and ``loss_scaler`` (None without fp16)."""
        state = {field: getattr(self.engine, field) for field in self.fields}
        state["loss_scaler"] = self.loss_scaler.state_dict() if self.loss_scaler else None
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Set the counters (those the checkpoint has) and the loss scale."""
        for field in self.fields:
            if field in state:
                setattr(self.engine, field, state[field])
        if self.loss_scaler is not None and state.get("loss_scaler"):
            self.loss_scaler.load_state_dict(state["loss_scaler"])


ENGINE_FIELDS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


def engine_parts(engine: Any, fields: tuple[str, ...] = ENGINE_FIELDS) -> dict[str, Any]:
    """The replicated parts of ``engine``'s run, by name (None where the run has none).

    ``engine`` (the counters and loss scale), ``lr_scheduler``, ``data`` (slipstream.data's
    sampler, curricula and consumed samples). Public attributes only.
    """
    counters = EngineCounters(
        engine,
        tuple(f for f in fields if hasattr(engine, f)),
        getattr(engine, "loss_scaler", None),
    )
    scheduler = getattr(engine, "lr_scheduler", None)
    if scheduler is not None and not hasattr(scheduler, "state_dict"):
        scheduler = None
    return {
        "engine": counters,
        "lr_scheduler": scheduler,
        "data": getattr(engine, "data_efficiency", None),
    }


class CheckpointParts:
    """Writes and restores the replicated parts of a run (rank 0 writes, every rank loads).

    ``parts`` maps a name to a :class:`Stateful` (None: the run has no such part; its saved
    state, if any, is left unread).
    """

    def __init__(self, parts: dict[str, Stateful | None]) -> None:
        for name, part in parts.items():
            if part is not None and not isinstance(part, Stateful):
                raise TypeError(
                    f"checkpoint part {name!r} is a {type(part).__name__} without "
                    "state_dict()/load_state_dict()"
                )
        self.parts = parts

    def write(self, staging: Path) -> tuple[dict[str, str], list[str]]:
        """Rank 0: each part's object file; returns ``(manifest parts, file names)``."""
        from slipstream.runtime.checkpoint import _dump_object

        listed: dict[str, str] = {}
        for name, part in self.parts.items():
            if part is not None:
                listed[name] = _dump_object(staging, f"state.{name}", part.state_dict())
        return listed, list(listed.values())

    def read(
        self, path: Path, manifest: dict[str, Any], skip: frozenset[str] = frozenset()
    ) -> dict[str, Any]:
        """Every rank: the saved states this run has parts for (read before anything changes)."""
        from slipstream.runtime.checkpoint import _load_object

        states: dict[str, Any] = {}
        if "parts" not in manifest:
            # Written before the parts had files of their own (format 1 as first released):
            # the counters inline, the schedule in lr_scheduler_file.
            legacy = {"engine": manifest.get("engine"), "lr_scheduler": None}
            if manifest.get("lr_scheduler_file"):
                legacy["lr_scheduler"] = _load_object(path, manifest["lr_scheduler_file"])
            return {
                name: state
                for name, state in legacy.items()
                if state is not None and name not in skip and self.parts.get(name) is not None
            }
        for name, file in manifest["parts"].items():
            if name in skip or self.parts.get(name) is None:
                continue
            states[name] = _load_object(path, file)
        return states

    def apply(self, states: dict[str, Any]) -> None:
        """Give each part its state."""
        for name, state in states.items():
            part = self.parts[name]
            assert part is not None
            part.load_state_dict(state)


@dataclasses.dataclass
class GradientPathState:
    """What the tensor layouts of a checkpoint need from a run's gradient path.

    ``path``: the gradient path itself (slipstream.zero.GradientPath; the pipeline engine's
    ZeRO state, or None where a pipeline runs stage 0), whose ``state_dict`` /
    ``load_state_dict`` stage 0's layout goes through; ``optimizer``: the torch optimizer
    stepping the masters (or the parameters at stage 0); ``zero``: the ZeRO state
    (``params``/``masters``, None at stage 0); ``masters``: stage 0's low-precision master
    copies (None in fp32 or above stage 0); ``stage3``: the ZeRO-3 parameter owner (None
    below stage 3); ``group``: the group that shards the state (a
    slipstream.zero.DataParallelGroup, MiCS's included; None at stage 0), and
    ``dp_rank``/``dp_world`` this rank's coordinate in it.
    """

    path: Any
    optimizer: torch.optim.Optimizer | None
    zero: Any
    masters: Any
    stage3: Any
    group: Any
    dp_rank: int
    dp_world: int
    zero_stage: int


def gradient_path_state(engine: Any) -> GradientPathState:
    """The one adapter from an engine to its gradient path's checkpoint state.

    [Note: one gradient-path adapter] Every checkpoint layout reaches the optimizer, ZeRO
    shards and masters through this function and nothing else; it reads only the engines'
    public attributes (``gradient_path``, ``zero``, ``zero_group``, ``optimizer``,
    ``zero_stage``, ``stage3_model``).
    """
    from slipstream.zero import ReplicatedGradientPath

    zero = getattr(engine, "zero", None)
    # The plain engine names its gradient path; the pipeline engine's is its ZeRO state.
    path = getattr(engine, "gradient_path", zero)
    plain = hasattr(type(engine), "zero_group")  # SlipstreamEngine's public accessors
    stage3 = engine.stage3_model if plain else None
    group = None
    if zero is not None:
        # The plain engine's ZeRO group (MiCS's shard group included); the pipeline
        # engine's ZeRO state carries the stage's own.
        group = engine.zero_group if plain else zero.group
    return GradientPathState(
        path=path,
        optimizer=getattr(engine, "optimizer", None),
        zero=zero,
        masters=path.masters if isinstance(path, ReplicatedGradientPath) else None,
        stage3=stage3,
        group=group,
        dp_rank=int(group.rank) if group is not None else 0,
        dp_world=int(group.world_size) if group is not None else 1,
        zero_stage=int(getattr(engine, "zero_stage", 0)),
    )
