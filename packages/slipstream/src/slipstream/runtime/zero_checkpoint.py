"""ZeRO checkpoints: every rank writes its own shards; loading reshards to any world size and stage.

Layout of ``save_dir/<tag>`` (beside the stage-0 files described in checkpoint.py)::

    manifest.json                    world size, stage, partitioning, every parameter's shape
    model.rank<R>.safetensors        rank R's shard of every parameter (model dtype), by name
    optimizer.rank<R>.safetensors    rank R's fp32 master shards (master/<name>) and optimizer
                                     state (state/<name>/<key>): sharded tensors flat, others whole
    buffers.safetensors              the module's buffers (replicated; written by rank 0)
    rng.rank<R>.safetensors, lr_scheduler.*, client_state.*   as at stage 0

Shards follow slipstream.zero's layout (``partitioning: "flat-per-parameter"``): parameter
``p`` is flattened and padded to a multiple of the world size W, and rank r holds elements
``[r*s, (r+1)*s)`` with ``s = ceil(numel / W)``. Any rank of any later run can therefore
read any range of any parameter from the ranks that wrote it (``ShardReader``), which is all
that resharding needs: 4 ranks at stage 3 -> 2 ranks at stage 2 reads each new range from the
two old files that cover it, and a stage-0 checkpoint reads as one shard of world size 1.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

import slipstream
from slipstream import comm
from slipstream.runtime import checkpoint as ckpt
from slipstream.zero import ShardSpec, sharded_state_of

if TYPE_CHECKING:
    from slipstream.runtime.engine import SlipstreamEngine

logger = logging.getLogger(__name__)

PARTITIONING = "flat-per-parameter"

__all__ = ["ShardReader", "get_fp32_state_dict_from_zero_checkpoint", "load", "save"]


# ---------------------------------------------------------------------------- engine views
def _named_params(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return list(module.named_parameters())


def _tied(module: torch.nn.Module) -> dict[str, str]:
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def _model_shard(param: torch.nn.Parameter, world: int, rank: int) -> torch.Tensor:
    sharded = sharded_state_of(param)
    if sharded is not None:
        return sharded.shard.to(param.dtype)  # the fp32 master when they share (stage 3)
    return ShardSpec(param.shape, world).shard_of(param, rank)


def _shards_resident(engine: SlipstreamEngine, dirty: bool) -> AbstractContextManager[None]:
    """Stage 3 with NVMe parameters: every parameter shard in host memory for the block."""
    stage3 = engine._stage3
    if stage3 is None:
        return nullcontext()
    return stage3.shards_resident(dirty)  # type: ignore[no-any-return]


def _master_names(engine: SlipstreamEngine) -> dict[int, str]:
    """id(master shard) -> parameter name."""
    assert engine.zero is not None
    name_of = {id(p): n for n, p in _named_params(engine.module)}
    return {
        id(master): name_of[id(param)]
        for param, master in zip(engine.zero.params, engine.zero.masters.masters)
    }


# ---------------------------------------------------------------------------- save
def save(
    engine: SlipstreamEngine,
    save_dir: str | Path,
    tag: str | None,
    client_state: dict[str, Any],
    save_latest: bool,
) -> Path:
    """Save a ZeRO engine: each rank its shards, rank 0 the manifest (collective)."""
    assert engine.zero is not None and engine.optimizer is not None
    tag = ckpt._check_tag(str(tag) if tag is not None else f"global_step{engine.global_steps}")
    save_dir = Path(save_dir)
    rank, world = engine._zero_group().rank, engine.dp_world_size
    staging = save_dir / f".{tag}.partial"
    final = save_dir / tag
    if comm.get_rank() == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir()
    ckpt._barrier()

    named = _named_params(engine.module)
    with _shards_resident(engine, dirty=False):
        ckpt._save_tensors(
            staging / f"model.rank{rank}.safetensors",
            {name: _model_shard(p, world, rank) for name, p in named},
        )
    names = _master_names(engine)
    tensors: dict[str, torch.Tensor] = {}
    sharded_keys: set[str] = set()
    for master in engine.zero.masters.masters:
        name = names[id(master)]
        tensors[f"master/{name}"] = master.detach()
        for key, value in engine.optimizer.state.get(master, {}).items():
            if isinstance(value, torch.Tensor):
                tensors[f"state/{name}/{key}"] = value
                if value.dim() == 1 and value.numel() == master.numel():
                    sharded_keys.add(key)
    ckpt._save_tensors(staging / f"optimizer.rank{rank}.safetensors", tensors)
    rng_tensors, rng_meta = ckpt._rng_state()
    ckpt._save_tensors(staging / f"rng.rank{comm.get_rank()}.safetensors", rng_tensors, rng_meta)
    gathered: list[Any] = [None] * comm.get_world_size() if comm.get_world_size() > 1 else []
    if comm.get_world_size() > 1:
        torch.distributed.all_gather_object(gathered, sorted(sharded_keys))
        sharded_keys = {key for keys in gathered for key in keys}
    if comm.get_rank() == 0:
        _save_rank0_part(engine, staging, client_state, sorted(sharded_keys), save_latest, tag)
        ckpt._replace_dir(staging, final)
        if save_latest:
            ckpt._write_text_atomic(save_dir / ckpt.LATEST, tag)
        logger.info("saved ZeRO stage-%d checkpoint %s (%d ranks)", engine.zero_stage, final, world)
    ckpt._barrier()
    return final


def _save_rank0_part(
    engine: SlipstreamEngine,
    staging: Path,
    client_state: dict[str, Any],
    sharded_keys: list[str],
    save_latest: bool,
    tag: str,
) -> None:
    assert engine.optimizer is not None and engine.zero is not None
    world = engine.dp_world_size
    buffers = {name: b for name, b in engine.module.named_buffers()}
    ckpt._save_tensors(staging / "buffers.safetensors", buffers)
    files: list[dict[str, Any]] = [{"name": "buffers.safetensors", "kind": "buffers", "rank": 0}]
    for r in range(world):
        files.append({"name": f"model.rank{r}.safetensors", "kind": "model", "rank": r})
        files.append({"name": f"optimizer.rank{r}.safetensors", "kind": "optimizer", "rank": r})
    for r in range(comm.get_world_size()):
        files.append({"name": f"rng.rank{r}.safetensors", "kind": "rng", "rank": r})

    names = _master_names(engine)
    param_names = [names[id(p)] for g in engine.optimizer.param_groups for p in g["params"]]
    state_dict = engine.optimizer.state_dict()
    scalars: dict[str, dict[str, Any]] = {}
    for index, per_param in state_dict["state"].items():
        for key, value in per_param.items():
            if not isinstance(value, torch.Tensor):
                scalars.setdefault(param_names[index], {})[key] = value
    scheduler_file = (
        ckpt._dump_object(staging, "lr_scheduler", engine.lr_scheduler.state_dict())
        if engine.lr_scheduler is not None and hasattr(engine.lr_scheduler, "state_dict")
        else None
    )
    client_file = ckpt._dump_object(staging, "client_state", client_state)
    for name in (scheduler_file, client_file):
        if name is not None:
            files.append({"name": name, "kind": "object", "rank": 0})
    for entry in files:
        entry["bytes"] = (staging / entry["name"]).stat().st_size
    manifest = {
        "format": ckpt.FORMAT,
        "format_version": ckpt.FORMAT_VERSION,
        "slipstream_version": slipstream.__version__,
        "torch_version": torch.__version__,
        "world_size": comm.get_world_size(),
        "dp_world_size": world,
        "zero_stage": engine.zero_stage,
        "partitioning": PARTITIONING,
        "dtype": str(engine.compute_dtype or torch.float32).removeprefix("torch."),
        "parameters": {
            name: {
                "shape": list(p.shape),
                "dtype": str(p.dtype).removeprefix("torch."),
                "shard_numel": ShardSpec(p.shape, world).shard_numel,
                "requires_grad": p.requires_grad,
            }
            for name, p in _named_params(engine.module)
        },
        "buffers": [name for name, _ in engine.module.named_buffers()],
        "tied": _tied(engine.module),
        "optimizer": {
            "class": type(engine.optimizer).__name__,
            "param_names": param_names,
            "param_groups": ckpt._to_json(state_dict["param_groups"]),
            "scalars": ckpt._to_json(scalars),
            "sharded_state_keys": sharded_keys,
        },
        "lr_scheduler_file": scheduler_file,
        "client_state_file": client_file,
        "engine": {
            "global_steps": engine.global_steps,
            "global_samples": engine.global_samples,
            "micro_steps": engine.micro_steps,
            "skipped_steps": engine.skipped_steps,
            "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler else None,
        },
        "config": engine.config.raw,
        "files": files,
    }
    (staging / ckpt.MANIFEST).write_text(json.dumps(manifest, indent=1))
    ckpt._fsync_file(staging / ckpt.MANIFEST)
    ckpt._fsync_dir(staging)


# ---------------------------------------------------------------------------- reading
class ShardReader:
    """Reads any flat range of any saved tensor, whichever world size and stage wrote it.

    ``kind`` is ``"model"`` (the parameters in the model dtype), ``"master"`` (fp32 master
    weights; falls back to the model weights where a checkpoint has none) or
    ``"state/<key>"`` (an optimizer state). Files are opened lazily and read slice by slice
    (safetensors memory-maps them), so a rank reads only the bytes of its new shards.
    """

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path = path
        self.manifest = manifest
        self.zero = manifest.get("partitioning") == PARTITIONING
        self.world = int(manifest["dp_world_size"]) if self.zero else 1
        self._stack = ExitStack()
        self._handles: dict[str, Any] = {}

    def close(self) -> None:
        """Close the open files."""
        self._stack.close()

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self, name: str) -> Any:
        if name not in self._handles:
            self._handles[name] = self._stack.enter_context(
                safe_open(str(self.path / name), framework="pt", device="cpu")
            )
        return self._handles[name]

    def _locate(self, kind: str, name: str, rank: int) -> tuple[Any, str] | None:
        if kind == "model":
            file, key = (
                (f"model.rank{rank}.safetensors", name)
                if self.zero
                else ("model.safetensors", name)
            )
        elif kind == "master":
            file = f"optimizer.rank{rank}.safetensors" if self.zero else "optimizer.safetensors"
            key = f"master/{name}"
        else:
            file = f"optimizer.rank{rank}.safetensors" if self.zero else "optimizer.safetensors"
            key = f"state/{name}/{kind.removeprefix('state/')}"
        handle = self._open(file)
        if key not in handle.keys():
            if not self.zero and kind == "model":
                # Tied weights are stored once at stage 0.
                source = self.manifest.get("tied", {}).get(name)
                if source is not None and source in handle.keys():
                    return handle, source
            return None
        return handle, key

    def has(self, kind: str, name: str) -> bool:
        """Whether the checkpoint holds ``kind`` for parameter ``name``."""
        return self._locate(kind, name, 0) is not None

    def numel(self, name: str) -> int:
        """Elements of parameter ``name``."""
        shape = self.manifest["parameters"][name]["shape"]
        total = 1
        for size in shape:
            total *= int(size)
        return total

    def read(self, kind: str, name: str, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of the flattened tensor (``kind`` of parameter ``name``)."""
        if kind == "master" and not self.has("master", name):
            return self.read("model", name, start, end).float()
        if not self.zero:
            located = self._locate(kind, name, 0)
            if located is None:
                raise ckpt.CorruptCheckpointError(f"{self.path} holds no {kind} for {name!r}")
            handle, key = located
            return handle.get_tensor(key).reshape(-1)[start:end]
        shard = int(self.manifest["parameters"][name]["shard_numel"])
        pieces = []
        position = start
        while position < end:
            rank = position // shard
            stop = min(end, (rank + 1) * shard)
            located = self._locate(kind, name, rank)
            if located is None:
                raise ckpt.CorruptCheckpointError(
                    f"{self.path} holds no {kind} for {name!r} in rank {rank}'s file"
                )
            handle, key = located
            pieces.append(handle.get_slice(key)[position - rank * shard : stop - rank * shard])
            position = stop
        if not pieces:
            return torch.empty(0)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def read_replicated(self, kind: str, name: str) -> torch.Tensor | None:
        """A tensor stored whole (e.g. Adam's ``step``), from rank 0's file; None if absent."""
        located = self._locate(kind, name, 0)
        return None if located is None else located[0].get_tensor(located[1])

    def read_full(self, kind: str, name: str) -> torch.Tensor:
        """The whole tensor, in its shape."""
        shape = self.manifest["parameters"][name]["shape"]
        return self.read(kind, name, 0, self.numel(name)).reshape(shape)

    def buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of the saved module buffers."""
        names = self.manifest.get("buffers")
        if self.zero:
            handle = self._open("buffers.safetensors")
            for key in handle.keys():
                yield key, handle.get_tensor(key)
            return
        handle = self._open("model.safetensors")
        params = set(self.manifest.get("parameters", {}))
        for key in handle.keys():
            if (names is not None and key in names) or (names is None and key not in params):
                yield key, handle.get_tensor(key)

    def sharded_state_keys(self, name: str) -> list[str]:
        """Optimizer-state keys of parameter ``name`` laid out like the parameter."""
        if self.zero:
            return list(self.manifest["optimizer"].get("sharded_state_keys", []))
        handle = self._open("optimizer.safetensors")
        prefix = f"state/{name}/"
        shape = self.manifest["parameters"][name]["shape"]
        keys = []
        for key in handle.keys():
            if key.startswith(prefix) and list(handle.get_slice(key).get_shape()) == shape:
                if key[len(prefix) :] != "step":
                    keys.append(key[len(prefix) :])
        return keys


# ---------------------------------------------------------------------------- load
def _padded(values: torch.Tensor, numel: int) -> torch.Tensor:
    out = torch.zeros(numel, dtype=values.dtype)
    out[: values.numel()] = values
    return out


def _load_model_shards(
    reader: ShardReader, named: list[tuple[str, torch.nn.Parameter]], world: int, rank: int
) -> None:
    """Each parameter's model-dtype values: this rank's shard (stage 3) or the whole tensor."""
    for name, param in named:
        numel = param.numel()
        spec = ShardSpec(param.shape, world)
        sharded = sharded_state_of(param)
        if sharded is not None:
            start, end = spec.valid_range(rank)
            values = reader.read("model", name, start, end)
            sharded.shard.copy_(_padded(values, spec.shard_numel).to(sharded.shard.dtype))
        else:
            param.data.copy_(reader.read("model", name, 0, numel).view(param.shape))


def load(
    engine: SlipstreamEngine,
    load_dir: str | Path,
    tag: str | None,
    *,
    load_module_strict: bool,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
    load_module_only: bool,
) -> tuple[Path, dict[str, Any]]:
    """Restore a ZeRO engine from a ZeRO or stage-0 checkpoint of any world size."""
    assert engine.zero is not None and engine.optimizer is not None
    path = ckpt._resolve(load_dir, tag)
    manifest = ckpt.read_manifest(path)
    world, rank = engine.dp_world_size, engine._zero_group().rank
    named = _named_params(engine.module)
    saved = manifest["parameters"]
    known = set(saved) | set(manifest.get("tied", {}))
    if manifest.get("partitioning") != PARTITIONING:
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            known |= set(f.keys())  # stage 0 lists trainable parameters only
    missing = [n for n, _ in named if n not in known]
    extra = [n for n in saved if n not in dict(named)]
    if missing or (extra and load_module_strict):
        raise ckpt.CheckpointError(
            f"the model in {str(path)!r} does not fit this module: missing {missing[:5]}, "
            f"unexpected {extra[:5]}"
        )
    with ShardReader(path, manifest) as reader, torch.no_grad():
        with _shards_resident(engine, dirty=True):
            _load_model_shards(reader, named, world, rank)
        for buffer_name, value in reader.buffers():
            buffer = dict(engine.module.named_buffers()).get(buffer_name)
            if buffer is not None:
                buffer.copy_(value)
        names = _master_names(engine)
        for param, master in zip(engine.zero.params, engine.zero.masters.masters):
            spec = ShardSpec(param.shape, world)
            start, end = spec.valid_range(rank)
            kind = "master" if not load_module_only else "model"
            master.copy_(
                _padded(reader.read(kind, names[id(master)], start, end).float(), spec.shard_numel)
            )
        if load_optimizer_states:
            _load_optimizer(engine, reader, manifest, path)
    if engine._stage3 is not None:
        engine._stage3.release_all()  # gathered copies (persistent ones) hold old values
    return path, ckpt.restore_engine_state(
        engine, path, manifest, load_lr_scheduler_states, load_module_only
    )


def _load_optimizer(
    engine: SlipstreamEngine, reader: ShardReader, manifest: dict[str, Any], path: Path
) -> None:
    assert engine.zero is not None and engine.optimizer is not None
    saved = manifest["optimizer"]
    names = _master_names(engine)
    order = [names[id(p)] for g in engine.optimizer.param_groups for p in g["params"]]
    if sorted(order) != sorted(saved["param_names"]):
        raise ckpt.CheckpointError(
            f"the optimizer state in {str(path)!r} is for other parameters; pass "
            "load_optimizer_states=False to load the weights alone"
        )
    scalars = ckpt._from_json(saved["scalars"])
    world, rank = engine.dp_world_size, engine._zero_group().rank
    state: dict[int, dict[str, Any]] = {}
    params = [p for g in engine.optimizer.param_groups for p in g["params"]]
    model_param = {id(m): p for p, m in zip(engine.zero.params, engine.zero.masters.masters)}
    for index, (name, master) in enumerate(zip(order, params)):
        entry: dict[str, Any] = dict(scalars.get(name, {}))
        spec = ShardSpec(model_param[id(master)].shape, world)
        start, end = spec.valid_range(rank)
        sharded_keys = reader.sharded_state_keys(name)
        for key in sharded_keys:
            if reader.has(f"state/{key}", name):
                entry[key] = _padded(
                    reader.read(f"state/{key}", name, start, end), spec.shard_numel
                )
        for key in ("step",):
            value = reader.read_replicated(f"state/{key}", name)
            if value is not None:
                entry[key] = value
        if entry:
            state[index] = entry
    saved_groups = ckpt._from_json(saved["param_groups"])
    current = engine.optimizer.state_dict()["param_groups"]
    if len(saved_groups) != len(current):
        raise ckpt.CheckpointError(
            f"the checkpoint has {len(saved_groups)} optimizer parameter groups, this optimizer "
            f"{len(current)}"
        )
    groups = [{**dict(s), "params": c["params"]} for s, c in zip(saved_groups, current)]
    engine.optimizer.load_state_dict({"state": state, "param_groups": groups})


# ---------------------------------------------------------------------------- consolidation
def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | Path, tag: str | None = None
) -> dict[str, torch.Tensor]:
    """The full fp32 weights of a checkpoint, as a module state dict (DeepSpeed's helper).

    Reads the fp32 master shards (the model weights where there are none: frozen parameters,
    fp32 stage-0 checkpoints) and concatenates them; buffers come as saved. Tied parameters
    appear under every name, sharing one tensor. Needs no process group and no GPU.

    >>> state = get_fp32_state_dict_from_zero_checkpoint("checkpoints")
    >>> model.load_state_dict(state)
    """
    path = ckpt._resolve(checkpoint_dir, tag)
    manifest = ckpt.read_manifest(path)
    out: dict[str, torch.Tensor] = {}
    with ShardReader(path, manifest) as reader:
        for name, _info in manifest["parameters"].items():
            if reader.has("master", name):
                tensor = reader.read_full("master", name)
            else:
                tensor = reader.read_full("model", name)
                tensor = tensor.float() if tensor.is_floating_point() else tensor
            out[name] = tensor.clone()
        for name, value in reader.buffers():
            out[name] = value.clone()
    for alias, source in manifest.get("tied", {}).items():
        if source in out:
            out[alias] = out[source]
    return out
