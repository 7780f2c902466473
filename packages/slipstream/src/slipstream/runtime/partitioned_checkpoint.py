"""Checkpoints of tensor- and expert-parallel models: pieces of global tensors, any layout on load.

A model whose parameters are split across ranks (tensor parallelism: ``param.tp_partition_dim``,
``tp_size``, ``tp_rank``; expert parallelism: slipstream.moe layers with ``ep_size > 1``) is
saved under the names and shapes of the unsplit model. Each parameter's manifest entry gives its
global shape and, when split, ``partition = {"dim": d, "pieces": [...]}``: piece ``i`` (the
``i``-th of ``len(pieces)`` equal slices along ``d``) with its shape, shard size and file group
(``tp<i>.``, ``ep<E>_<i>.``). Each piece is stored like any ZeRO parameter: flat, cut into the
shards of the group that shards its optimizer state (the data-parallel group for dense and
tensor-parallel parameters, the expert-data-parallel group for experts; one shard at stage 0):

    model.<group>rank<R>.safetensors, optimizer.<group>rank<R>.safetensors
    buffers.safetensors (rank 0), rng.rank<G>.safetensors, state.*   as for every checkpoint

Experts of a grouped layer (stacked ``(experts, ...)`` weights) are pieces along dim 0 of the
layer's ``(num_experts, ...)`` tensors; a loop layer's ``local_experts.<i>`` are renamed to
their global index ``local_experts.<first + i>``. A load assembles each parameter it needs from
the pieces and cuts its own slice and shard, so TP size, EP size, data-parallel size and ZeRO
stage (0-3; at stage 3 each parameter's values are its flat shard, stored and read like a
master) may all change, and the ZeRO/stage-0 loaders read these checkpoints too (a TP=2 or
EP=2 checkpoint loads into the unsplit model).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.runtime import checkpoint as ckpt
from slipstream.runtime.checkpoint_manager import gradient_path_state
from slipstream.runtime.zero_checkpoint import PARTITIONING, ShardReader, _padded
from slipstream.zero import ShardSpec, sharded_state_of

__all__ = [
    "apply",
    "is_partitioned",
    "manifest_fields",
    "tensors_to_check",
    "validate",
    "write_rank_files",
]


@dataclasses.dataclass
class _Placement:
    """Where one local parameter sits in the unsplit model, and who writes it."""

    name: str  # global name
    dim: int | None  # the split dimension (None: whole)
    index: int  # this piece's index along ``dim``
    count: int  # pieces along ``dim``
    group: str  # file group of this piece
    replica_group: Any  # the process group holding copies of it at stage 0 (None: world)
    tensor_parallel: bool


def _moe_layers(module: torch.nn.Module) -> list[tuple[str, Any]]:
    from slipstream.moe import MoE

    return [(n, m) for n, m in module.named_modules() if isinstance(m, MoE) and m.ep_size > 1]


def _tp_rank(module: torch.nn.Module) -> int:
    """This rank's tensor-parallel index (0 without tensor-parallel parameters)."""
    for param in module.parameters():
        if getattr(param, "tp_partition_dim", None) is not None and param.tp_size > 1:  # type: ignore[attr-defined]
            return int(param.tp_rank)  # type: ignore[attr-defined]
    return 0


def is_partitioned(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds tensor- or expert-parallel pieces (this layout saves it)."""
    return bool(_moe_layers(module)) or any(
        getattr(p, "tp_partition_dim", None) is not None and getattr(p, "tp_size", 1) > 1
        for p in module.parameters()
    )


def _placements(module: torch.nn.Module) -> dict[str, _Placement]:
    """Local parameter name -> its placement."""
    from slipstream.moe.experts import LoopExperts

    out: dict[str, _Placement] = {}
    for prefix, layer in _moe_layers(module):
        experts = f"{prefix}.experts." if prefix else "experts."
        group = f"ep{layer.ep_size}_{layer.groups.ep_rank}."
        replicas = layer.groups.expert_dp_group
        for local, _ in layer.experts.named_parameters():
            if isinstance(layer.experts, LoopExperts):
                index, _, rest = local.removeprefix("local_experts.").partition(".")
                name = f"{experts}local_experts.{int(index) + layer.first_local_expert}.{rest}"
                out[experts + local] = _Placement(name, None, 0, 1, group, replicas, False)
            else:
                out[experts + local] = _Placement(
                    experts + local, 0, layer.groups.ep_rank, layer.ep_size, group, replicas, False
                )
    for name, param in module.named_parameters():
        if name in out:
            continue
        dim = getattr(param, "tp_partition_dim", None)
        if dim is not None and getattr(param, "tp_size", 1) > 1:
            rank, size = int(param.tp_rank), int(param.tp_size)  # type: ignore[attr-defined]
            out[name] = _Placement(name, int(dim), rank, size, f"tp{rank}.", "dp", True)
        else:
            out[name] = _Placement(name, None, 0, 1, "", "dp", False)
    return out


def _parts(engine: Any) -> list[Any]:
    """The ZeRO parts (dense, then each expert group) or [] at stage 0."""
    zero = gradient_path_state(engine).zero
    if zero is None:
        return []
    return list(getattr(zero, "parts", [zero]))


def _stepped(engine: Any) -> list[tuple[str, torch.nn.Parameter, torch.Tensor, Any]]:
    """(local name, parameter, stepped tensor, sharding group or None) in optimizer order."""
    state = gradient_path_state(engine)
    local = {id(p): n for n, p in engine.module.named_parameters()}
    owner: dict[int, tuple[torch.nn.Parameter, Any]] = {}
    for part in _parts(engine):
        for param, master in zip(part.params, part.masters.masters):
            owner[id(master)] = (param, part.group)
    if state.masters is not None:
        for (_, param), master in zip(engine.named_trainable_parameters, state.masters.masters):
            owner[id(master)] = (param, None)
    out = []
    assert state.optimizer is not None
    for group in state.optimizer.param_groups:
        for stepped in group["params"]:
            param, sharding = owner.get(id(stepped), (stepped, None))
            out.append((local[id(param)], param, stepped, sharding))
    return out


def _replica_rank(placement: _Placement, engine: Any) -> int:
    group = engine.dp_group if placement.replica_group == "dp" else placement.replica_group
    return int(dist.get_rank(group)) if comm.is_initialized() else 0


def tensors_to_check(engine: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """What this rank's part of the checkpoint holds, for the non-finite check."""
    optimizer = gradient_path_state(engine).optimizer
    assert optimizer is not None
    for name, param in engine.module.named_parameters():
        sharded = sharded_state_of(param)  # stage 3: the full storage is freed
        yield f"parameter {name}", param if sharded is None else sharded.shard
    for name, _, stepped, _ in _stepped(engine):
        yield f"master weight {name}", stepped
        for key, value in optimizer.state.get(stepped, {}).items():
            yield f"optimizer state {name}/{key}", value
    for name, buffer in engine.module.named_buffers():
        yield f"buffer {name}", buffer


# ---------------------------------------------------------------------------- save
def write_rank_files(engine: Any, staging: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every rank: its shards of its pieces (a piece's first replica at stage 0), and RNG."""
    optimizer = gradient_path_state(engine).optimizer
    assert optimizer is not None
    placements = _placements(engine.module)
    tp_rank = _tp_rank(engine.module)
    sharding = {id(param): group for _, param, _, group in _stepped(engine) if group is not None}
    files: dict[str, dict[str, torch.Tensor]] = {}
    info: dict[str, Any] = {"pieces": {}, "scalars": {}, "sharded_keys": set()}

    def writes(name: str, param: torch.nn.Parameter) -> tuple[bool, int, int]:
        """(this rank writes the piece, shard rank, shard world)."""
        place = placements[name]
        if not place.tensor_parallel and place.group == "" and tp_rank != 0:
            return False, 0, 1  # replicated across the tensor-parallel group
        group = sharding.get(id(param))
        sharded = sharded_state_of(param)
        if group is None and sharded is not None:
            group = sharded.group  # stage 3: a frozen parameter is sharded too
        if group is not None:
            return True, int(group.rank), int(group.world_size)
        return _replica_rank(place, engine) == 0, 0, 1

    for name, param in engine.module.named_parameters():
        write, rank, world = writes(name, param)
        if not write:
            continue
        place = placements[name]
        spec = ShardSpec(param.shape, world)
        sharded = sharded_state_of(param)
        # Stage 3 holds the shard itself (same flat layout over the same group).
        values = (
            spec.shard_of(param.detach(), rank)
            if sharded is None
            else sharded.shard.detach().to(param.dtype)
        )
        files.setdefault(f"model.{place.group}rank{rank}.safetensors", {})[place.name] = values
        info["pieces"][place.name] = {
            "dim": place.dim,
            "index": place.index,
            "count": place.count,
            "piece": {
                "shape": list(param.shape),
                "shard_numel": spec.shard_numel,
                "file_group": place.group,
            },
            "dtype": str(param.dtype).removeprefix("torch."),
            "requires_grad": param.requires_grad,
        }
    for name, param, stepped, _ in _stepped(engine):
        write, rank, _world = writes(name, param)
        if not write:
            continue
        place = placements[name]
        out = files.setdefault(f"optimizer.{place.group}rank{rank}.safetensors", {})
        out[f"master/{place.name}"] = stepped.detach().float().reshape(-1)
        for key, value in optimizer.state.get(stepped, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                if value.numel() == stepped.numel():
                    out[f"state/{place.name}/{key}"] = value.reshape(-1)
                    info["sharded_keys"].add(key)
                    continue
            if isinstance(value, torch.Tensor):
                out[f"state/{place.name}/{key}"] = value
            else:
                info["scalars"].setdefault(place.name, {})[key] = value
    entries = []
    for file, tensors in files.items():
        ckpt._save_tensors(staging / file, tensors)
        entries.append(ckpt.file_entry(staging, file, file.partition(".")[0], comm.get_rank()))
    rng_tensors, rng_meta = ckpt._rng_state()
    rng_name = f"rng.rank{comm.get_rank()}.safetensors"
    ckpt._save_tensors(staging / rng_name, rng_tensors, rng_meta)
    entries.append(ckpt.file_entry(staging, rng_name, "rng", comm.get_rank()))
    if comm.get_rank() == 0:
        buffers = dict(engine.module.named_buffers())
        ckpt._save_tensors(staging / "buffers.safetensors", buffers)
        entries.append(ckpt.file_entry(staging, "buffers.safetensors", "buffers", 0))
        info["param_groups"] = ckpt._to_json(optimizer.state_dict()["param_groups"])
        info["buffers"] = sorted(buffers)
    info["sharded_keys"] = sorted(info["sharded_keys"])
    return entries, info


def manifest_fields(engine: Any, infos: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0: every parameter's global shape and pieces, from every rank's write info."""
    optimizer = gradient_path_state(engine).optimizer
    parameters: dict[str, Any] = {}
    scalars: dict[str, Any] = {}
    for info in infos:
        scalars.update(info["scalars"])
        for name, record in info["pieces"].items():
            entry = parameters.setdefault(
                name,
                {"dtype": record["dtype"], "requires_grad": record["requires_grad"], "_p": {}},
            )
            entry["_p"][record["index"]] = (record["dim"], record["count"], record["piece"])
    for name, entry in parameters.items():
        found = entry.pop("_p")
        dim, count, first = found[0]
        if dim is None:
            entry.update(first)
            continue
        if sorted(found) != list(range(count)):
            raise ckpt.CheckpointError(
                f"parameter {name!r} is split in {count} pieces along dim {dim} but only "
                f"{sorted(found)} were written; are the tensor/expert-parallel groups consistent?"
            )
        pieces = [found[i][2] for i in range(count)]
        shape = list(first["shape"])
        shape[dim] = sum(p["shape"][dim] for p in pieces)
        entry.update(shape=shape, partition={"dim": dim, "pieces": pieces})
    first = next(info for info in infos if "param_groups" in info)
    return {
        "zero_stage": gradient_path_state(engine).zero_stage,
        "partitioning": PARTITIONING,
        "layout": "partitioned",
        "parameters": parameters,
        "buffers": first["buffers"],
        "tied": {},
        "optimizer": {
            "class": type(optimizer).__name__,
            "param_names": sorted(parameters),
            "param_groups": first["param_groups"],
            "scalars": ckpt._to_json(scalars),
            "sharded_state_keys": sorted({k for info in infos for k in info["sharded_keys"]}),
        },
    }


# ---------------------------------------------------------------------------- load
def _local_slice(full: torch.Tensor, place: _Placement) -> torch.Tensor:
    if place.dim is None:
        return full
    size = full.shape[place.dim] // place.count
    return full.narrow(place.dim, place.index * size, size)


def _cut(full: torch.Tensor, place: _Placement, group: Any, shape: torch.Size) -> torch.Tensor:
    """This rank's part of a global tensor: its slice, as the stepped tensor holds it (the
    parameter's shape at stage 0, its flat padded shard of the ZeRO ``group``)."""
    piece = _local_slice(full, place)
    if group is None:
        return piece.reshape(shape)
    spec = ShardSpec(piece.shape, int(group.world_size))
    start, end = spec.valid_range(int(group.rank))
    return _padded(piece.reshape(-1)[start:end], spec.shard_numel)


def validate(
    engine: Any, path: Path, manifest: dict[str, Any], options: dict[str, bool]
) -> dict[str, Any]:
    """Every local parameter's global name exists and its slice has the local shape."""
    saved = manifest["parameters"]
    for local, place in _placements(engine.module).items():
        param = dict(engine.module.named_parameters())[local]
        if place.name not in saved:
            raise ckpt.CheckpointMismatchError(
                f"parameter {place.name!r} (this rank's {local!r}) is not in {str(path)!r}: "
                "the checkpoint is of another model"
            )
        shape = list(saved[place.name]["shape"])
        if place.dim is not None:
            if shape[place.dim] % place.count:
                raise ckpt.CheckpointShapeError(
                    f"{place.name!r} has {shape[place.dim]} rows along dim {place.dim} in "
                    f"{str(path)!r}, not divisible into this layout's {place.count} pieces"
                )
            shape[place.dim] //= place.count
        ckpt.check_tensor_fits(
            path, f"parameter {local!r}", shape, saved[place.name].get("dtype"), param
        )
    if options["load_optimizer_states"]:
        optimizer = gradient_path_state(engine).optimizer
        assert optimizer is not None
        ckpt.check_optimizer_class_and_groups(manifest["optimizer"], optimizer, path)
    return {}


def apply(
    engine: Any,
    path: Path,
    manifest: dict[str, Any],
    plan: dict[str, Any],
    options: dict[str, bool],
) -> None:
    """Assemble each local parameter's slice (and shard) from the saved pieces.

    The weights and buffers go into the module; the stepped tensors (fp32 masters, this
    rank's shards of them) and the optimizer state go back through the gradient path's
    ``load_state_dict`` ([Note: one gradient-path adapter] in checkpoint_manager.py), which
    publishes the masters into the weights.
    """
    state = gradient_path_state(engine)
    optimizer = state.optimizer
    assert optimizer is not None
    placements = _placements(engine.module)
    values: dict[int, torch.Tensor] = {}  # id(stepped tensor) -> its loaded value
    optimizer_state: dict[str, Any] = {}  # empty: the optimizer keeps its state
    with ShardReader(path, manifest) as reader, torch.no_grad():
        for local, param in engine.module.named_parameters():
            place = placements[local]
            full = reader.read_full("model", place.name)
            sharded = sharded_state_of(param)
            if sharded is None:
                param.copy_(_local_slice(full, place))
            else:  # stage 3: this rank's flat shard of its slice
                cut = _cut(full, place, sharded.group, param.shape)
                sharded.shard.copy_(cut.to(sharded.shard.dtype))
        buffers = dict(engine.module.named_buffers())
        for name, value in reader.buffers():
            if name in buffers:
                buffers[name].copy_(value)
        kind = "model" if options["load_module_only"] else "master"
        entries: dict[int, dict[str, Any]] = {}
        scalars = ckpt._from_json(manifest["optimizer"]["scalars"])
        keys = manifest["optimizer"].get("sharded_state_keys", [])
        for index, (local, param, stepped, group) in enumerate(_stepped(engine)):
            place = placements[local]

            if stepped is not param:
                full = reader.read_full(kind, place.name).float()
                values[id(stepped)] = _cut(full, place, group, stepped.shape)
            if not options["load_optimizer_states"]:
                continue
            entry: dict[str, Any] = dict(scalars.get(place.name, {}))
            for key in keys:
                if reader.has(f"state/{key}", place.name):
                    full = reader.read_full(f"state/{key}", place.name)
                    entry[key] = _cut(full, place, group, stepped.shape)
            step = reader.read_replicated("state/step", place.name)
            if step is not None:
                entry["step"] = step
            if entry:
                entries[index] = entry
        if options["load_optimizer_states"]:
            current = optimizer.state_dict()["param_groups"]
            groups = ckpt.saved_param_groups(manifest["optimizer"]["param_groups"], current)
            optimizer_state = {"state": entries, "param_groups": groups}
    state.path.load_state_dict(_path_state(state.path, values, optimizer_state))


def _path_state(
    path: Any, values: dict[int, torch.Tensor], optimizer_state: dict[str, Any]
) -> dict[str, Any]:
    """``values`` (loaded stepped tensors, by id) laid out as ``path.state_dict()`` lays them
    out. A master the optimizer does not step (so the checkpoint has none for it) keeps its
    value; stage 0's takes the loaded weight's."""
    from slipstream.zero import MultiGroupPath, ReplicatedGradientPath

    def loaded(masters: list[torch.Tensor]) -> list[torch.Tensor]:
        return [values.get(id(m), m.detach()) for m in masters]

    if isinstance(path, MultiGroupPath):
        parts = [{"masters": loaded(part.masters.masters)} for part in path.parts]
        return {"parts": parts, "optimizer": optimizer_state}
    if isinstance(path, ReplicatedGradientPath):
        if path.masters is None:  # the weights are the stepped tensors: loaded above
            return {"masters": None, "optimizer": optimizer_state}
        masters = [
            values.get(id(m), p.detach().float()) for m, p in zip(path.masters.masters, path.params)
        ]
        return {"masters": masters, "optimizer": optimizer_state}
    return {"masters": loaded(path.masters.masters), "optimizer": optimizer_state}
