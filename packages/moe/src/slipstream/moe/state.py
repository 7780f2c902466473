"""Moving weights between a model with all experts local and its expert-parallel shards."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from slipstream import comm
from slipstream.moe.experts import LoopExperts
from slipstream.moe.layer import MoE

__all__ = ["expert_parallel_state_dict", "full_state_dict"]


def expert_parallel_state_dict(
    full_state: Mapping[str, torch.Tensor], model: nn.Module
) -> dict[str, torch.Tensor]:
    """The state dict of `model` (expert-parallel on this rank) cut from `full_state`, the state
    dict of the same architecture built with ``ep_size=1`` (every expert local).

    Dense entries are taken as they are; each MoE layer's experts are the slice that this
    rank's expert-parallel position owns. Load the result with ``model.load_state_dict``.

    >>> full = build_model(ep_size=1).state_dict()          # doctest: +SKIP
    >>> sharded = build_model(ep_size=2)                    # doctest: +SKIP
    >>> sharded.load_state_dict(expert_parallel_state_dict(full, sharded))  # doctest: +SKIP
    """
    result: dict[str, torch.Tensor] = {}
    expert_prefixes = []
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            prefix = f"{name}.experts." if name else "experts."
            expert_prefixes.append(prefix)
            result.update(
                module.experts.shard_full_state(prefix, full_state, module.first_local_expert)
            )
    for key in model.state_dict():
        if any(key.startswith(prefix) for prefix in expert_prefixes):
            continue
        if key not in full_state:
            raise KeyError(f"the full state has no {key!r}: is it the same architecture?")
        result[key] = full_state[key]
    return result


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of `model` with every expert of every MoE layer, as the same architecture
    built with ``ep_size=1`` would have it (the inverse of :func:`expert_parallel_state_dict`).

    Collective: every rank of each layer's expert-parallel group must call it (each layer's
    experts are all-gathered over that group); every rank gets the full result. Use it to
    export or to reshard a checkpoint.
    """
    state = dict(model.state_dict())
    for name, module in model.named_modules():
        if not isinstance(module, MoE):
            continue
        prefix = f"{name}.experts." if name else "experts."
        group, ep_size = module.groups.ep_group, module.ep_size
        local = module.experts.state_dict()
        for key in local:
            del state[prefix + key]
        if isinstance(module.experts, LoopExperts):
            # Stack the local experts' tensors per suffix so that each gathers in one call.
            suffixes = [key.partition(".")[2].partition(".")[2] for key in local]
            for suffix in dict.fromkeys(suffixes):
                stacked = torch.stack(
                    [local[f"local_experts.{i}.{suffix}"] for i in range(module.num_local_experts)]
                )
                gathered = _gather_experts(stacked, group, ep_size)
                for index in range(module.num_experts):
                    state[f"{prefix}local_experts.{index}.{suffix}"] = gathered[index]
        else:
            for key, value in local.items():
                state[prefix + key] = _gather_experts(value, group, ep_size)
    return state


def _gather_experts(
    local: torch.Tensor, group: torch.distributed.ProcessGroup | None, ep_size: int
) -> torch.Tensor:
    """Concatenate along dim 0 the local experts of every rank of `group`, in rank order."""
    if ep_size == 1:
        return local.detach().clone()
    local = local.detach().contiguous()
    output = local.new_empty((ep_size * local.shape[0], *local.shape[1:]))
    comm.all_gather_into_tensor(output, local, group=group, log_name="moe_gather_experts")
    return output
