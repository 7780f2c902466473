"""At ``initialize``: every rank checks that all ranks have the same config and the same model.

Ranks started with different configs or models otherwise fail much later and far from the
cause: a broadcast or the first gradient all-reduce aborts inside gloo/NCCL, or hangs. Here one
small collective (an all-gather of two 32-byte digests) compares them; only when they differ
does a second one gather the details, so that every rank raises the same error naming the
first difference.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
import torch.distributed as dist

from slipstream import comm

__all__ = ["RanksDisagreeError", "check_ranks_agree", "parameter_signature"]

_DIGEST_BYTES = 32
# Blocks that only rank 0 acts on (the monitors write from rank 0 alone), so ranks may differ in
# them without harm, e.g. a per-rank job name or output path from the launch script.
RANK_LOCAL_BLOCKS = frozenset({"tensorboard", "csv_monitor", "wandb", "comet"})


class RanksDisagreeError(RuntimeError):
    """Ranks were started with different configs or models (raised on every rank alike)."""


def parameter_signature(model: torch.nn.Module) -> list[tuple[str, list[int], str]]:
    """(name, shape, dtype) of every parameter, in ``named_parameters()`` order."""
    return [(name, list(p.shape), str(p.dtype)) for name, p in model.named_parameters()]


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key in value:
            out.update(_flatten(value[key], f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def _digest(value: Any) -> bytes:
    text = json.dumps(value, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).digest()


def check_ranks_agree(
    config: dict[str, Any], parameters: list[tuple[str, list[int], str]], device: torch.device
) -> None:
    """Raise :class:`RanksDisagreeError` on every rank unless all ranks passed equal values.

    ``config``: the resolved config as a dict; ``parameters``: :func:`parameter_signature`.
    A no-op without a process group or with one rank.
    """
    if not comm.is_initialized() or comm.get_world_size() == 1:
        return
    world = comm.get_world_size()
    flat_config = {
        key: value
        for key, value in _flatten(config).items()
        if key.split(".", 1)[0] not in RANK_LOCAL_BLOCKS
    }
    local = _digest(flat_config) + _digest(parameters)
    mine = torch.frombuffer(bytearray(local), dtype=torch.int64).to(device)
    everyone = torch.empty(world * mine.numel(), dtype=torch.int64, device=device)
    comm.all_gather_into_tensor(everyone, mine, log_name="initialize_agreement")
    rows = everyone.cpu().view(world, -1)
    if all(torch.equal(rows[0], rows[rank]) for rank in range(1, world)):
        return
    details: list[Any] = [None] * world
    dist.all_gather_object(details, (flat_config, parameters))
    raise RanksDisagreeError(_first_difference(details))


def _first_difference(details: list[Any]) -> str:
    """The message every rank raises: rank 0 against the first rank that differs."""
    config0, params0 = details[0]
    for rank in range(1, len(details)):
        config, params = details[rank]
        for key in sorted(set(config0) | set(config)):
            if config0.get(key, "<absent>") != config.get(key, "<absent>"):
                return _message(
                    f"config key {key!r} is {config0.get(key, '<absent>')!r} on rank 0 but "
                    f"{config.get(key, '<absent>')!r} on rank {rank}"
                )
        if params0 != params:
            return _message(_parameter_difference(params0, params, rank))
    return _message("the ranks' fingerprints differ but their details compare equal")


def _parameter_difference(
    params0: list[tuple[str, list[int], str]], params: list[tuple[str, list[int], str]], rank: int
) -> str:
    for position, (first, other) in enumerate(zip(params0, params)):
        if first != other:
            name0, shape0, dtype0 = first
            name, shape, dtype = other
            if name0 != name:
                return f"parameter #{position} is {name0!r} on rank 0 but {name!r} on rank {rank}"
            return (
                f"parameter {name0!r} has shape {tuple(shape0)} and dtype {dtype0} on rank 0 "
                f"but shape {tuple(shape)} and dtype {dtype} on rank {rank}"
            )
    return (
        f"the model has {len(params0)} parameters on rank 0 but {len(params)} on rank {rank}"
        f" (first extra: {(params0 if len(params0) > len(params) else params)[min(len(params0), len(params))][0]!r})"
    )


def _message(difference: str) -> str:
    return (
        f"ranks disagree at initialize: {difference}. Every rank must build the same model "
        "and pass the same config (check what differs between the ranks' launch commands, "
        "files or random choices before initialize)"
    )
