"""DeepSpeed's ``safe_get_*``/``safe_set_*``: a parameter's fp32 master, gradient and optimizer state.

Each function takes a parameter of a model wrapped by :func:`slipstream.initialize` and works
at every ZeRO stage: at stage 0 the fp32 master (the parameter itself in fp32 training); at
stages 1-3 this rank's shard of it, gathered over the data-parallel group for the ``full``
forms (so every rank of the group must call them together, as with DeepSpeed). Call the grad
getters after ``engine.backward`` at an accumulation boundary and before ``engine.step``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from slipstream.zero import DataParallelGroup, ShardSpec

__all__ = [
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "track_engine",
]

# parameter -> the engine that trains it (set by slipstream.initialize).
_ENGINES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def track_engine(engine: Any) -> None:
    """Remember ``engine`` as the owner of its trainable parameters (``initialize`` calls this)."""
    for _, param in getattr(engine, "named_trainable_parameters", []):
        _ENGINES[param] = engine


class _Where:
    """Where one parameter's fp32 master lives: whole (stage 0) or as a shard (ZeRO 1-3)."""

    def __init__(self, param: torch.Tensor) -> None:
        engine = _ENGINES.get(param)
        if engine is None:
            raise ValueError(
                "this parameter is not trained by a Slipstream engine: pass a trainable parameter "
                "of the model given to slipstream.initialize (engine.module's parameters)"
            )
        self.engine = engine
        zero = engine.zero
        if zero is not None and not hasattr(zero, "masters"):
            raise NotImplementedError(
                "safe_get/safe_set of expert-parallel MoE parameters (ep_size > 1) are not "
                "implemented: their shards live in per-expert-group optimizers; read them "
                "through engine.optimizer instead"
            )
        self.spec: ShardSpec | None = None
        if zero is not None:
            index = zero.masters.index_of[id(param)]
            self.master = zero.masters.masters[index]
            self.spec = zero.masters.specs[index]
            self.grad = zero.masters.grad(index)
            self.group = DataParallelGroup.of(engine.dp_group)
        elif engine.masters is not None:
            index = [id(p) for p in engine.masters.params].index(id(param))
            self.master = engine.masters.masters[index]
            self.grad = self.master.grad
        else:
            self.master = param
            self.grad = param.grad
        self.param = param

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """Finish a step still running in the background; bring NVMe-offloaded state in."""
        self.engine.wait_for_step()
        zero = self.engine.zero
        with zero.optimizer.resident() if zero is not None else contextlib.nullcontext():
            yield

    def full(self, shard: torch.Tensor | None) -> torch.Tensor | None:
        """The whole fp32 tensor from this rank's ``shard`` (gathered at ZeRO 1-3)."""
        if shard is None:
            return None
        if self.spec is None:
            return shard.detach().float().clone()
        device = self.engine.device
        out = torch.empty(self.spec.padded_numel, dtype=torch.float32, device=device)
        self.group.all_gather_into(out, shard.detach().reshape(-1).to(device, torch.float32))
        return out[: self.spec.numel].view(self.spec.shape)

    def local(self, shard: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's part of the tensor (flat, padding dropped), or all of it at stage 0."""
        if shard is None:
            return None
        if self.spec is None:
            return shard.detach().float().clone()
        start, end = self.spec.valid_range(self.group.rank)
        return shard.detach().reshape(-1)[: end - start].float().clone()

    def state(self, key: str) -> Any:
        optimizer = self.engine.optimizer
        state = optimizer.state.get(self.master, {}) if optimizer is not None else {}
        if key not in state:
            raise KeyError(
                f"optimizer state {key!r} not found for this parameter (has: {sorted(state)}); "
                "optimizer states exist after the first engine.step()"
            )
        return state[key]

    def write(self, target: torch.Tensor, value: torch.Tensor, local: bool) -> None:
        """Write a full (or, with ``local``, this rank's flat) value into the sharded ``target``."""
        value = value.detach().to(target.device, torch.float32)
        with torch.no_grad():
            if self.spec is None:
                target.copy_(value.view_as(target))
                return
            start, end = self.spec.valid_range(self.group.rank)
            part = value.reshape(-1) if local else value.reshape(-1)[start:end]
            target.reshape(-1)[: end - start].copy_(part)


def _check_stage_for_set(where: _Where) -> None:
    if where.engine.zero_stage == 3:
        raise NotImplementedError(
            "safe_set_*_fp32_param at ZeRO stage 3 is not implemented (the 16-bit shard and its "
            "master would both have to be re-cut); edit the parameter inside "
            "slipstream.zero.GatheredParameters(param, modifier_rank=0) instead"
        )


def _publish(where: _Where) -> None:
    """Copy a master that was written back into the model's (full, stage 0-2) parameter."""
    if where.master is where.param:
        return
    full = where.full(where.master)
    assert full is not None
    with torch.no_grad():
        where.param.copy_(full.view_as(where.param).to(where.param.dtype))


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor:
    """The whole fp32 master of ``param`` (a new tensor)."""
    where = _Where(param)
    with where.resident():
        full = where.full(where.master)
    assert full is not None
    return full


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The whole fp32 gradient of ``param`` (averaged over the data-parallel group), or None."""
    where = _Where(param)
    return where.full(where.grad)


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> Any:
    """The whole fp32 optimizer state ``optim_state_key`` (``"exp_avg"``, ...) of ``param``.

    Scalar states (``"step"``) are returned as they are.
    """
    where = _Where(param)
    with where.resident():
        value = where.state(optim_state_key)
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        return where.full(value)


def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``param``'s fp32 master (flat at ZeRO 1-3, whole at stage 0)."""
    where = _Where(param)
    with where.resident():
        local = where.local(where.master)
    assert local is not None
    return local


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's part of ``param``'s fp32 gradient, or None."""
    where = _Where(param)
    return where.local(where.grad)


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str) -> Any:
    """This rank's part of an optimizer state of ``param`` (scalars as they are)."""
    where = _Where(param)
    with where.resident():
        value = where.state(optim_state_key)
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        return where.local(value)


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set ``param``'s fp32 master (and the model's parameter) to the whole ``value``.

    ZeRO stages 0-2; every rank of the data-parallel group calls it with the same value.
    """
    where = _Where(param)
    _check_stage_for_set(where)
    with where.resident():
        where.write(where.master, value, local=False)
        _publish(where)


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set this rank's part of ``param``'s fp32 master (as :func:`safe_get_local_fp32_param`
    returns it); the model's parameter is refreshed from all ranks' parts (ZeRO stages 0-2)."""
    where = _Where(param)
    _check_stage_for_set(where)
    with where.resident():
        where.write(where.master, value, local=True)
        _publish(where)


def safe_set_full_optimizer_state(
    param: torch.Tensor, value: torch.Tensor, optim_state_key: str
) -> None:
    """Set the optimizer state ``optim_state_key`` of ``param`` from its whole value."""
    where = _Where(param)
    with where.resident():
        state = where.state(optim_state_key)
        where.write(state, value, local=False)
