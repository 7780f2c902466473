"""Pipeline checkpoints: per-stage shards; loading reshards across PP stage count, DP and TP size.

Layout of ``save_dir/<tag>`` (the common files and manifest keys are checkpoint.py's)::

    manifest.json                          + ``pipeline`` (stages, parts, layer -> stage map)
    model.stage<S>.rank<R>.safetensors     stage S, data-parallel rank R: its flat shard of each
                                           parameter the stage owns (model dtype)
    optimizer.stage<S>.rank<R>.safetensors fp32 masters and optimizer state, the same shards
    buffers.stage<S>.safetensors           the stage's buffers (its first replica writes them)
    *.stage<S>.tp<I>.rank<R>.safetensors   tensor-parallel stages: tensor index I's pieces (the
                                           manifest entry's ``partition``, as partitioned
                                           checkpoints store them); replicated parameters
                                           stay in ``stage<S>.``, written by tensor index 0
    rng.rank<G>.safetensors, state.*       as for every checkpoint (global rank G)

Parameter names are the pipeline module's own (``<layer index>.<name>``,
``tied_modules.<key>.<name>``), the same on every layout, so each manifest entry records the
file group (``stage<S>.``) and shard size of its writer and any later layout reads any
parameter, or any range of it, from there (``zero_checkpoint.ShardReader``). Shards follow
slipstream.zero's flat-per-parameter layout over the stage's data-parallel group at ZeRO
stages 1-2; stage 0 is the one-shard case (its first replica writes whole tensors). A tied
weight held by several stages is stored once, by the lowest of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from slipstream import comm
from slipstream.runtime import checkpoint as ckpt
from slipstream.runtime.checkpoint_manager import gradient_path_state
from slipstream.runtime.zero_checkpoint import PARTITIONING, ShardReader, _padded
from slipstream.zero import ShardSpec

if TYPE_CHECKING:
    from slipstream.runtime.pipeline_engine import PipelineEngine

__all__ = ["apply", "manifest_fields", "tensors_to_check", "validate", "write_rank_files"]


# ---------------------------------------------------------------------------- engine views
def _coordinates(engine: PipelineEngine) -> tuple[int, int, int]:
    """(stage, data-parallel rank, data-parallel size) of this rank."""
    grid = engine.grid
    if grid is None:
        return engine.module.stage_id, 0, 1
    return engine.module.stage_id, grid.data_parallel_id, grid.data_parallel_size


def _owned(engine: PipelineEngine, name: str) -> bool:
    """Whether this stage stores ``name`` (tied modules: the lowest stage holding them)."""
    if name.startswith("tied_modules."):
        return engine.module.owns_tied_key(name.split(".")[1])
    return True


def _param_names(engine: PipelineEngine) -> dict[int, str]:
    """id(parameter) -> name, and id(fp32 master shard) -> name at ZeRO."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    zero = gradient_path_state(engine).zero
    if zero is not None:
        for param, master in zip(zero.params, zero.masters.masters):
            names[id(master)] = names[id(param)]
    return names


def _optimizer_entries(engine: PipelineEngine) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, parameter, stepped tensor) in optimizer order; the stepped tensor is the fp32
    master shard at ZeRO, the parameter itself at stage 0."""
    path = gradient_path_state(engine)
    assert path.optimizer is not None
    names = _param_names(engine)
    model_param = {id(p): p for p in engine.module.parameters()}
    if path.zero is not None:
        model_param.update({id(m): p for p, m in zip(path.zero.params, path.zero.masters.masters)})
    return [
        (names[id(stepped)], model_param[id(stepped)], stepped)
        for group in path.optimizer.param_groups
        for stepped in group["params"]
    ]


def tensors_to_check(engine: PipelineEngine) -> Iterator[tuple[str, torch.Tensor]]:
    """What this rank's part of the checkpoint holds, for the non-finite check."""
    optimizer = gradient_path_state(engine).optimizer
    assert optimizer is not None
    for name, param in engine.module.named_parameters():
        yield f"parameter {name}", param
    for name, _, stepped in _optimizer_entries(engine):
        yield f"master weight {name}", stepped
        for key, value in optimizer.state.get(stepped, {}).items():
            yield f"optimizer state {name}/{key}", value
    for name, buffer in engine.module.named_buffers():
        yield f"buffer {name}", buffer


# ---------------------------------------------------------------------------- save
def _tensor_split(param: torch.Tensor) -> tuple[int, int, int] | None:
    """(dim, index, count) when ``param`` is one tensor-parallel piece, else None."""
    dim = getattr(param, "tp_partition_dim", None)
    if dim is None or getattr(param, "tp_size", 1) <= 1:
        return None
    return int(dim), int(param.tp_rank), int(param.tp_size)  # type: ignore[attr-defined]


def _tensor_rank(engine: PipelineEngine) -> int:
    """This rank's tensor-parallel index (0 without a tensor axis)."""
    return 0 if engine.grid is None else int(engine.grid.tensor_parallel_id)


def _local_slice(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's tensor-parallel slice of a global tensor (the whole of a replicated one)."""
    split = _tensor_split(param)
    if split is None:
        return full
    dim, index, count = split
    size = full.shape[dim] // count
    return full.narrow(dim, index * size, size)


def write_rank_files(
    engine: PipelineEngine, staging: Path
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every rank: its shards of the stage's parameters and optimizer state, and its RNG.

    With tensor-parallel stages, each tensor-parallel piece goes to the file group
    ``stage<S>.tp<i>.`` of its tensor index ``i`` (the manifest assembles the pieces, as the
    plain engine's partitioned checkpoints do); replicated parameters, the buffers and the
    optimizer's replicated state are written by tensor index 0 alone.
    """
    path = gradient_path_state(engine)
    optimizer = path.optimizer
    assert optimizer is not None
    stage, dp_rank, dp = _coordinates(engine)
    sharded = path.zero is not None
    world = dp if sharded else 1
    rank = comm.get_rank()
    group = f"stage{stage}."
    files = []
    rng_tensors, rng_meta = ckpt._rng_state()
    rng_name = f"rng.rank{rank}.safetensors"
    ckpt._save_tensors(staging / rng_name, rng_tensors, rng_meta)
    files.append(ckpt.file_entry(staging, rng_name, "rng", rank))
    info: dict[str, Any] = {"parameters": {}, "scalars": {}, "sharded_keys": [], "buffers": []}
    if not sharded and dp_rank != 0:
        return files, info  # stage 0: the stage's first replica writes it whole
    tp_rank = _tensor_rank(engine)
    outputs: dict[str, dict[str, torch.Tensor]] = {}

    def file_group(param: torch.Tensor) -> str | None:
        """Where ``param``'s values go; None where another tensor index writes them."""
        if _tensor_split(param) is not None:
            return f"{group}tp{tp_rank}."
        return group if tp_rank == 0 else None

    for name, param in engine.module.named_parameters():
        where = file_group(param)
        if not _owned(engine, name) or where is None:
            continue
        spec = ShardSpec(param.shape, world)
        values = spec.shard_of(param.detach(), dp_rank) if sharded else param.reshape(-1)
        outputs.setdefault(f"model.{where}rank{dp_rank}.safetensors", {})[name] = values
        record: dict[str, Any] = {
            "shape": list(param.shape),
            "dtype": str(param.dtype).removeprefix("torch."),
            "shard_numel": spec.shard_numel,
            "requires_grad": param.requires_grad,
            "file_group": where,
        }
        split = _tensor_split(param)
        if split is not None:
            record["tensor_piece"] = list(split)
        info["parameters"][name] = record
    sharded_keys: set[str] = set()
    for name, weight, stepped in _optimizer_entries(engine):
        where = file_group(weight)
        if not _owned(engine, name) or where is None:
            continue
        tensors = outputs.setdefault(f"optimizer.{where}rank{dp_rank}.safetensors", {})
        tensors[f"master/{name}"] = stepped.detach().float().reshape(-1)
        for key, value in optimizer.state.get(stepped, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                if value.numel() == stepped.numel():
                    tensors[f"state/{name}/{key}"] = value.reshape(-1)
                    sharded_keys.add(key)
                    continue
            if isinstance(value, torch.Tensor):
                tensors[f"state/{name}/{key}"] = value
            else:
                info["scalars"].setdefault(name, {})[key] = value
    if tp_rank == 0:  # every reader looks for its stage's files, even when empty
        outputs.setdefault(f"model.{group}rank{dp_rank}.safetensors", {})
        outputs.setdefault(f"optimizer.{group}rank{dp_rank}.safetensors", {})
    for file, tensors in outputs.items():
        ckpt._save_tensors(staging / file, tensors)
        files.append(ckpt.file_entry(staging, file, file.partition(".")[0], rank))
    if dp_rank == 0 and tp_rank == 0:
        buffers = {name: b for name, b in engine.module.named_buffers() if _owned(engine, name)}
        buffer_name = f"buffers.{group}safetensors"
        ckpt._save_tensors(staging / buffer_name, buffers)
        files.append(ckpt.file_entry(staging, buffer_name, "buffers", rank))
        info["buffer_file"] = buffer_name
        info["buffers"] = sorted(buffers)
    info["sharded_keys"] = sorted(sharded_keys)
    if rank == 0:
        info["param_groups"] = ckpt._to_json(optimizer.state_dict()["param_groups"])
    return files, info


def _assemble(infos: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's parameter records -> the manifest's; tensor-parallel pieces become one
    entry with the global shape and ``partition = {"dim", "pieces"}`` (checkpoints.md)."""
    parameters: dict[str, Any] = {}
    pieces: dict[str, dict[int, dict[str, Any]]] = {}
    for info in infos:
        for name, record in info["parameters"].items():
            split = record.pop("tensor_piece", None)
            if split is None:
                parameters[name] = record
                continue
            dim, index, count = split
            pieces.setdefault(name, {})[index] = record
            parameters[name] = {"dim": dim, "count": count, **record}
    for name, found in pieces.items():
        entry = parameters[name]
        dim, count = entry.pop("dim"), entry.pop("count")
        if sorted(found) != list(range(count)):
            raise ckpt.CheckpointError(
                f"parameter {name!r} is split in {count} tensor-parallel pieces along dim {dim} "
                f"but only {sorted(found)} were written; are the tensor groups consistent?"
            )
        ordered = [found[i] for i in range(count)]
        shape = list(ordered[0]["shape"])
        shape[dim] = sum(p["shape"][dim] for p in ordered)
        parameters[name] = {
            "shape": shape,
            "dtype": entry["dtype"],
            "requires_grad": entry["requires_grad"],
            "partition": {
                "dim": dim,
                "pieces": [
                    {k: p[k] for k in ("shape", "shard_numel", "file_group")} for p in ordered
                ],
            },
        }
    return parameters


def manifest_fields(engine: PipelineEngine, infos: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0: the pipeline layout's part of the manifest, from every rank's write info."""
    optimizer = gradient_path_state(engine).optimizer
    module = engine.module
    parameters = _assemble(infos)
    scalars: dict[str, Any] = {}
    for info in infos:
        scalars.update(info["scalars"])
    _, _, dp = _coordinates(engine)
    groups = next(info["param_groups"] for info in infos if "param_groups" in info)
    return {
        "zero_stage": engine.zero_stage,
        "partitioning": PARTITIONING,
        "dp_world_size": dp,
        "pipeline": {
            "num_stages": module.num_stages,
            "virtual_stages": module.virtual_stages,
            "parts": list(module.parts),
            "layer_stage": module.layer_stages(),
        },
        "parameters": parameters,
        "buffers": sorted({b for info in infos for b in info["buffers"]}),
        "buffer_files": sorted({info["buffer_file"] for info in infos if "buffer_file" in info}),
        "tied": {},
        "optimizer": {
            "class": type(optimizer).__name__,
            "param_names": sorted(scalars.keys() | {n for n in parameters}),
            "param_groups": groups,
            "scalars": ckpt._to_json(scalars),
            "sharded_state_keys": sorted({k for info in infos for k in info["sharded_keys"]}),
        },
    }


# ---------------------------------------------------------------------------- load
def validate(
    engine: PipelineEngine, path: Path, manifest: dict[str, Any], options: dict[str, bool]
) -> dict[str, Any]:
    """Check a pipeline checkpoint against this engine's stage before anything is copied."""
    if "pipeline" not in manifest:
        raise ckpt.CheckpointMismatchError(
            f"{str(path)!r} is not a pipeline checkpoint (it was saved by slipstream.initialize's "
            "engine, whose parameter names differ from a PipelineModule's); load it into the "
            "engine that saved it, or consolidate it with `slipstream convert` and load the "
            "weights into the PipelineModule's layers yourself"
        )
    saved = manifest["parameters"]
    listed = {entry["name"] for entry in manifest.get("files", [])}
    for name, param in engine.module.named_parameters():
        if name not in saved:
            raise ckpt.CheckpointMismatchError(
                f"parameter {name!r} of pipeline stage {engine.module.stage_id} is not in "
                f"{str(path)!r}: the checkpoint is of another model (its stages held "
                f"{manifest['pipeline']['num_stages']} parts of a model without this layer)"
            )
        info = saved[name]
        shape = list(info["shape"])
        split = _tensor_split(param)
        if split is not None:
            dim, _, count = split
            if shape[dim] % count:
                raise ckpt.CheckpointShapeError(
                    f"{name!r} has {shape[dim]} rows along dim {dim} in {str(path)!r}, not "
                    f"divisible into this layout's {count} tensor-parallel pieces"
                )
            shape[dim] //= count
        ckpt.check_tensor_fits(path, f"parameter {name!r}", shape, info["dtype"], param)
        partition = info.get("partition")
        for piece in partition["pieces"] if partition else [info]:
            numel = 1
            for size in piece["shape"]:
                numel *= int(size)
            shards = -(-numel // max(int(piece["shard_numel"]), 1)) if numel else 1
            for r in range(shards):
                for kind in ("model", "optimizer"):
                    file = f"{kind}.{piece['file_group']}rank{r}.safetensors"
                    if file not in listed:
                        raise ckpt.CorruptCheckpointError(
                            f"{str(path)!r} lists no {file}, which holds part of {name!r}: "
                            "the checkpoint is incomplete. Load an earlier tag."
                        )
    if options["load_optimizer_states"]:
        optimizer = gradient_path_state(engine).optimizer
        assert optimizer is not None
        ckpt.check_optimizer_class_and_groups(manifest["optimizer"], optimizer, path)
    return {}


def apply(
    engine: PipelineEngine,
    path: Path,
    manifest: dict[str, Any],
    plan: dict[str, Any],
    options: dict[str, bool],
) -> None:
    """Copy a validated pipeline checkpoint into this stage (each rank reads its own ranges).

    The weights and buffers go into the module; the fp32 master shards (ZeRO) and the
    optimizer state go back through the gradient path's ``load_state_dict``, as every
    layout's do ([Note: one gradient-path adapter] in checkpoint_manager.py), which then
    publishes the masters into the weights.
    """
    state = gradient_path_state(engine)
    _, dp_rank, dp = _coordinates(engine)
    masters: list[torch.Tensor] | None = None  # stage 0: the weights are the stepped tensors
    optimizer_state: dict[str, Any] = {}
    with ShardReader(path, manifest) as reader, torch.no_grad():
        for name, param in engine.module.named_parameters():
            kind = "master" if param.dtype == torch.float32 and reader.has("master", name) else ""
            value = _local_slice(reader.read_full(kind or "model", name), param)
            param.copy_(value.to(param.dtype))
        buffers = dict(engine.module.named_buffers())
        for name, value in reader.buffers():
            if name in buffers:
                buffers[name].copy_(value)
        names = _param_names(engine)
        if state.zero is not None:
            kind = "model" if options["load_module_only"] else "master"
            masters = []
            for param, master in zip(state.zero.params, state.zero.masters.masters):
                spec = ShardSpec(param.shape, dp)
                start, end = spec.valid_range(dp_rank)
                full = _local_slice(reader.read_full(kind, names[id(master)]), param)
                values = full.reshape(-1)[start:end].float()
                masters.append(_padded(values, spec.shard_numel))
        if options["load_optimizer_states"]:
            optimizer_state = _saved_optimizer_state(engine, reader, manifest, dp_rank, dp)
    state.path.load_state_dict({"masters": masters, "optimizer": optimizer_state})


def _saved_optimizer_state(
    engine: PipelineEngine, reader: ShardReader, manifest: dict[str, Any], dp_rank: int, dp: int
) -> dict[str, Any]:
    """The torch ``state_dict`` of this stage's optimizer that the checkpoint holds (this
    rank's ranges of the sharded state at ZeRO)."""
    path = gradient_path_state(engine)
    optimizer = path.optimizer
    assert optimizer is not None
    saved = manifest["optimizer"]
    scalars = ckpt._from_json(saved["scalars"])
    sharded_keys = saved.get("sharded_state_keys", [])
    state: dict[int, dict[str, Any]] = {}
    for index, (name, param, stepped) in enumerate(_optimizer_entries(engine)):
        entry: dict[str, Any] = dict(scalars.get(name, {}))
        for key in sharded_keys:
            if not reader.has(f"state/{key}", name):
                continue
            if path.zero is not None:
                spec = ShardSpec(param.shape, dp)
                start, end = spec.valid_range(dp_rank)
                full = _local_slice(reader.read_full(f"state/{key}", name), param)
                entry[key] = _padded(full.reshape(-1)[start:end], spec.shard_numel)
            else:
                full = reader.read_full(f"state/{key}", name)
                entry[key] = _local_slice(full, param).to(stepped.device)
        value = reader.read_replicated("state/step", name)
        if value is not None:
            entry["step"] = value
        if entry:
            state[index] = entry
    current = optimizer.state_dict()["param_groups"]
    groups = ckpt.saved_param_groups(saved["param_groups"], current)
    return {"state": state, "param_groups": groups}
