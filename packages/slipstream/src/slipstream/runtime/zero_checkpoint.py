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

import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from slipstream import comm
from slipstream.runtime import checkpoint as ckpt
from slipstream.runtime.checkpoint_manager import gradient_path_state
from slipstream.zero import ShardSpec, sharded_state_of

if TYPE_CHECKING:
    from slipstream.runtime.engine import SlipstreamEngine

logger = logging.getLogger(__name__)

PARTITIONING = "flat-per-parameter"

__all__ = [
    "ShardReader",
    "apply",
    "get_fp32_state_dict_from_zero_checkpoint",
    "manifest_fields",
    "tensors_to_check",
    "validate",
    "write_rank_files",
]


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
    stage3 = gradient_path_state(engine).stage3
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
def tensors_to_check(engine: SlipstreamEngine) -> Iterator[tuple[str, torch.Tensor]]:
    """What this rank's part of a ZeRO checkpoint holds, for the non-finite check."""
    assert engine.zero is not None and engine.optimizer is not None
    names = _master_names(engine)
    for master in engine.zero.masters.masters:
        yield f"master weight {names[id(master)]}", master
        for key, value in engine.optimizer.state.get(master, {}).items():
            yield f"optimizer state {names[id(master)]}/{key}", value
    for name, buffer in engine.module.named_buffers():
        yield f"buffer {name}", buffer
    for name, param in _named_params(engine.module):
        if sharded_state_of(param) is None:  # stage-3 shards: their masters were checked
            yield f"parameter {name}", param


def _writes_shards(engine: SlipstreamEngine) -> bool:
    """Whether this rank writes model/optimizer shard files.

    [Note: MiCS checkpoints] MiCS shards over groups of ``mics_shard_size`` adjacent ranks
    and keeps ``replicas`` equal copies of those shards. The checkpoint is the first
    replica's shards (global ranks ``0..m-1``, shard ranks ``0..m-1``) with ``dp_world_size``
    = ``m``: the plain ZeRO layout over ``m`` ranks, so any ZeRO engine (MiCS or not, any
    size) reads it, and a MiCS engine reads any ZeRO checkpoint, each replica the same ranges.
    """
    state = gradient_path_state(engine)
    replicas = int(getattr(state.group, "replicas", 1))
    return replicas == 1 or comm.get_rank() < state.dp_world


def write_rank_files(
    engine: SlipstreamEngine, staging: Path
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every rank: its model and optimizer shards and RNG state; rank 0 also the buffers."""
    assert engine.zero is not None and engine.optimizer is not None
    state = gradient_path_state(engine)
    rank, world = state.dp_rank, state.dp_world
    rng_tensors, rng_meta = ckpt._rng_state()
    rng_name = f"rng.rank{comm.get_rank()}.safetensors"
    if not _writes_shards(engine):  # a MiCS replica past the first: see [Note: MiCS checkpoints]
        ckpt._save_tensors(staging / rng_name, rng_tensors, rng_meta)
        return [ckpt.file_entry(staging, rng_name, "rng", comm.get_rank())], {"sharded_keys": []}
    named = _named_params(engine.module)
    model_name = f"model.rank{rank}.safetensors"
    with _shards_resident(engine, dirty=False):
        ckpt._save_tensors(
            staging / model_name, {name: _model_shard(p, world, rank) for name, p in named}
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
    optimizer_name = f"optimizer.rank{rank}.safetensors"
    ckpt._save_tensors(staging / optimizer_name, tensors)
    ckpt._save_tensors(staging / rng_name, rng_tensors, rng_meta)
    files = [
        ckpt.file_entry(staging, model_name, "model", rank),
        ckpt.file_entry(staging, optimizer_name, "optimizer", rank),
        ckpt.file_entry(staging, rng_name, "rng", comm.get_rank()),
    ]
    if comm.get_rank() == 0:
        buffers = {name: b for name, b in engine.module.named_buffers()}
        ckpt._save_tensors(staging / "buffers.safetensors", buffers)
        files.append(ckpt.file_entry(staging, "buffers.safetensors", "buffers", 0))
    return files, {"sharded_keys": sorted(sharded_keys)}


def manifest_fields(engine: SlipstreamEngine, infos: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0: the ZeRO layout's part of the manifest (``infos``: every rank's write info)."""
    assert engine.optimizer is not None and engine.zero is not None
    world = gradient_path_state(engine).dp_world  # MiCS: the shard group's size
    sharded_keys = sorted({key for info in infos for key in info["sharded_keys"]})
    names = _master_names(engine)
    param_names = [names[id(p)] for g in engine.optimizer.param_groups for p in g["params"]]
    state_dict = engine.optimizer.state_dict()
    scalars: dict[str, dict[str, Any]] = {}
    for index, per_param in state_dict["state"].items():
        for key, value in per_param.items():
            if not isinstance(value, torch.Tensor):
                scalars.setdefault(param_names[index], {})[key] = value
    return {
        "dp_world_size": world,
        "zero_stage": engine.zero_stage,
        "partitioning": PARTITIONING,
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
    }


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

    def _piece(self, name: str, index: int = 0) -> dict[str, Any]:
        """The manifest record that says where ``name`` (or its piece ``index``) is stored."""
        entry: dict[str, Any] = self.manifest.get("parameters", {}).get(name, {})
        partition = entry.get("partition")
        return partition["pieces"][index] if partition else entry

    def _locate(
        self, kind: str, name: str, rank: int, piece: dict[str, Any] | None = None
    ) -> tuple[Any, str] | None:
        # A parameter's files: ``<kind>.<file_group>rank<R>``, where a pipeline checkpoint
        # records the stage that wrote it as its file group (``stage1.``), and a partitioned
        # one (tensor/expert parallel) each piece's holder (``tp1.``, ``ep2_1.``).
        group = (piece if piece is not None else self._piece(name)).get("file_group", "")
        if kind == "model":
            file, key = (
                (f"model.{group}rank{rank}.safetensors", name)
                if self.zero
                else ("model.safetensors", name)
            )
        elif kind == "master":
            file = (
                f"optimizer.{group}rank{rank}.safetensors" if self.zero else "optimizer.safetensors"
            )
            key = f"master/{name}"
        else:
            file = (
                f"optimizer.{group}rank{rank}.safetensors" if self.zero else "optimizer.safetensors"
            )
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

    def partition(self, name: str) -> dict[str, Any] | None:
        """``{"dim", "pieces"}`` when ``name`` was saved in pieces (tensor/expert parallel)."""
        partition: dict[str, Any] | None = self.manifest["parameters"][name].get("partition")
        return partition

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
        if self.partition(name) is not None:
            # Saved in pieces along a dimension: assemble the whole tensor (one parameter at
            # a time), then cut the range.
            return self.read_full(kind, name).reshape(-1)[start:end]
        return self._read_flat(kind, name, self._piece(name), start, end)

    def _read_flat(
        self, kind: str, name: str, piece: dict[str, Any], start: int, end: int
    ) -> torch.Tensor:
        shard = int(piece["shard_numel"])
        pieces = []
        position = start
        while position < end:
            rank = position // shard
            stop = min(end, (rank + 1) * shard)
            located = self._locate(kind, name, rank, piece)
            if located is None:
                raise ckpt.CorruptCheckpointError(
                    f"{self.path} holds no {kind} for {name!r} in rank {rank}'s file "
                    f"(group {piece.get('file_group', '')!r})"
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
        """The whole tensor, in its shape (pieces concatenated along their dimension)."""
        shape = self.manifest["parameters"][name]["shape"]
        partition = self.partition(name) if self.zero else None
        if partition is None:
            return self.read(kind, name, 0, self.numel(name)).reshape(shape)
        if kind == "master" and not self.has("master", name):
            return self.read_full("model", name).float()
        parts = []
        for piece in partition["pieces"]:
            numel = 1
            for size in piece["shape"]:
                numel *= int(size)
            flat = self._read_flat(kind, name, piece, 0, numel)
            parts.append(flat.reshape(piece["shape"]))
        return torch.cat(parts, dim=int(partition["dim"])).reshape(shape)

    def buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of the saved module buffers."""
        names = self.manifest.get("buffers")
        if self.zero:
            for file in self.manifest.get("buffer_files", ["buffers.safetensors"]):
                handle = self._open(file)
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


def validate(
    engine: SlipstreamEngine, path: Path, manifest: dict[str, Any], options: dict[str, bool]
) -> dict[str, Any]:
    """Check a (ZeRO or stage-0) checkpoint against a ZeRO engine before anything is copied.

    Names, every parameter's and buffer's shape (a larger or smaller model is a
    CheckpointShapeError), the saved world layout's files, and (when optimizer state is
    loaded) the optimizer's class, parameters and groups.
    """
    assert engine.zero is not None and engine.optimizer is not None
    named = _named_params(engine.module)
    saved = manifest["parameters"]
    tied = manifest.get("tied", {})
    zero_layout = manifest.get("partitioning") == PARTITIONING
    shapes: dict[str, tuple[list[int], str | None]] = {
        name: (info["shape"], info.get("dtype")) for name, info in saved.items()
    }
    buffer_header: dict[str, tuple[list[int], str]]
    if zero_layout:
        buffer_header = ckpt._header(path / "buffers.safetensors")
        saved_world = int(manifest["dp_world_size"])
        listed = {entry["name"] for entry in manifest.get("files", [])}
        for r in range(saved_world):
            for kind in ("model", "optimizer"):
                if f"{kind}.rank{r}.safetensors" not in listed:
                    raise ckpt.CorruptCheckpointError(
                        f"{str(path)!r} was saved by {saved_world} ranks but lists no "
                        f"{kind}.rank{r}.safetensors: the checkpoint is incomplete"
                    )
        for name, info in saved.items():
            numel = 1
            for size in info["shape"]:
                numel *= int(size)
            if (
                int(info["shard_numel"])
                != ShardSpec(torch.Size(info["shape"]), saved_world).shard_numel
            ):
                raise ckpt.CorruptCheckpointError(
                    f"{str(path)!r}: parameter {name!r} of {numel} elements records shards of "
                    f"{info['shard_numel']} over {saved_world} ranks; the manifest is inconsistent"
                )
    else:
        header = ckpt._header(path / "model.safetensors")  # stage 0 lists trainable ones only
        for key, value in header.items():
            shapes.setdefault(key, value)
        buffer_header = header
    known = set(shapes) | set(tied)
    missing = [n for n, _ in named if n not in known]
    extra = [n for n in saved if n not in dict(named)]
    if missing or (extra and options["load_module_strict"]):
        raise ckpt.CheckpointMismatchError(
            f"the model in {str(path)!r} does not fit this module: missing {missing[:5]}, "
            f"unexpected {extra[:5]}"
        )
    for name, param in named:
        shape, dtype = shapes[tied.get(name, name) if name not in shapes else name]
        ckpt.check_tensor_fits(path, f"parameter {name!r}", shape, dtype, param)
    for name, buffer in engine.module.named_buffers():
        if name in buffer_header:
            shape, dtype = buffer_header[name]
            ckpt.check_tensor_fits(path, f"buffer {name!r}", shape, dtype, buffer)
        elif options["load_module_strict"] and zero_layout:
            raise ckpt.CheckpointMismatchError(
                f"buffer {name!r} of this module is not in {str(path)!r}"
            )
    if options["load_optimizer_states"]:
        names = _master_names(engine)
        order = [names[id(p)] for g in engine.optimizer.param_groups for p in g["params"]]
        ckpt.check_optimizer_fits(engine, manifest["optimizer"], order, path)
    return {}


def apply(
    engine: SlipstreamEngine,
    path: Path,
    manifest: dict[str, Any],
    plan: dict[str, Any],
    options: dict[str, bool],
) -> None:
    """Copy a validated checkpoint into a ZeRO engine (each rank reads its new shards).

    The parameters the gradient path does not step (frozen ones) and the buffers go into the
    module; this rank's fp32 master shards and optimizer state go back through the gradient
    path's ``load_state_dict``, as every layout's do ([Note: one gradient-path adapter] in
    checkpoint_manager.py), which restores them in its own way (NVMe-swapped states inside
    its ``resident()``, a step still running on the CPU finished first) and publishes the
    masters into the trainable parameters (stages 1-2: all-gathered; stage 3: each shard,
    gathered copies dropped).
    """
    state = gradient_path_state(engine)
    assert state.zero is not None and state.optimizer is not None
    world, rank = state.dp_world, state.dp_rank
    stepped = {id(p) for p in state.zero.params}
    frozen = [(n, p) for n, p in _named_params(engine.module) if id(p) not in stepped]
    kind = "model" if options["load_module_only"] else "master"
    optimizer_state: dict[str, Any] = {}  # empty: the optimizer keeps its state
    with ShardReader(path, manifest) as reader, torch.no_grad():
        with _shards_resident(engine, dirty=True):
            _load_model_shards(reader, frozen, world, rank)
        buffers = dict(engine.module.named_buffers())
        for buffer_name, value in reader.buffers():
            if buffer_name in buffers:
                buffers[buffer_name].copy_(value)
        names = _master_names(engine)
        masters = []
        for param, master in zip(state.zero.params, state.zero.masters.masters):
            spec = ShardSpec(param.shape, world)
            start, end = spec.valid_range(rank)
            values = reader.read(kind, names[id(master)], start, end).float()
            masters.append(_padded(values, spec.shard_numel))
        if options["load_optimizer_states"]:
            optimizer_state = _saved_optimizer_state(engine, reader, manifest)
    state.path.load_state_dict({"masters": masters, "optimizer": optimizer_state})


def _saved_optimizer_state(
    engine: SlipstreamEngine, reader: ShardReader, manifest: dict[str, Any]
) -> dict[str, Any]:
    """The torch ``state_dict`` of the optimizer that the checkpoint holds for this rank's
    shards (sharded states cut to this rank's ranges, scalars and ``step`` whole)."""
    state_of_path = gradient_path_state(engine)
    optimizer = state_of_path.optimizer
    assert state_of_path.zero is not None and optimizer is not None
    saved = manifest["optimizer"]
    names = _master_names(engine)
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    scalars = ckpt._from_json(saved["scalars"])
    world, rank = state_of_path.dp_world, state_of_path.dp_rank
    state: dict[int, dict[str, Any]] = {}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    zero = state_of_path.zero
    model_param = {id(m): p for p, m in zip(zero.params, zero.masters.masters)}
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
    current = optimizer.state_dict()["param_groups"]
    groups = ckpt.saved_param_groups(saved["param_groups"], current)
    return {"state": state, "param_groups": groups}


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
