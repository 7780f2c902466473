"""Engine checkpoints: safetensors files plus a JSON manifest, written atomically.

Layout of ``save_dir``::

    latest                          the newest tag (written last, atomically)
    <tag>/manifest.json             format, versions, world size, stage, parameters, files
    <tag>/model.safetensors         module state (the module's dtype); tied tensors stored once
    <tag>/optimizer.safetensors     optimizer state tensors, keyed by parameter name (+ fp32 masters)
    <tag>/rng.rank<R>.safetensors   each rank's torch RNG states (+ Python/NumPy state in metadata)
    <tag>/client_state.json|.pt     what the caller passed as client_state

A tag is assembled in a hidden staging directory and renamed into place only after every file
is written and fsync'ed, so an interrupted save never leaves a directory that looks complete;
``latest`` is replaced only after that. Loading checks every file the manifest lists (presence,
size, safetensors header) before touching the engine.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

import slipstream
from slipstream import comm

if TYPE_CHECKING:
    from slipstream.runtime.engine import SlipstreamEngine

logger = logging.getLogger(__name__)

FORMAT = "slipstream-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint directory, its `latest` file or the requested tag does not exist."""


class CorruptCheckpointError(CheckpointError):
    """The checkpoint exists but is incomplete or damaged."""


# ---------------------------------------------------------------------------- file helpers
def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _save_tensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    cpu = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    save_file(cpu, str(path), metadata=metadata)
    _fsync_file(path)


def _to_json(value: Any) -> Any:
    """JSON-safe copy of optimizer/scheduler metadata (tuples become lists, 0-d tensors numbers)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return {"__tensor_scalar__": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, dict):
        return {str(k): _to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


def _from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if "__tensor_scalar__" in value:
            return torch.tensor(value["__tensor_scalar__"], dtype=getattr(torch, value["dtype"]))
        return {k: _from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value


def _dump_object(directory: Path, stem: str, value: Any) -> str:
    """Write ``value`` as JSON when it can be, else with torch.save; return the file name."""
    try:
        text = json.dumps(_to_json(value))
    except (TypeError, ValueError):
        name = f"{stem}.pt"
        torch.save(value, directory / name)
    else:
        name = f"{stem}.json"
        (directory / name).write_text(text)
    _fsync_file(directory / name)
    return name


def _load_object(directory: Path, name: str) -> Any:
    if name.endswith(".json"):
        return _from_json(json.loads((directory / name).read_text()))
    # Written by this library's own save: arbitrary client objects need full unpickling.
    return torch.load(directory / name, map_location="cpu", weights_only=False)


# ---------------------------------------------------------------------------- state capture
def _model_tensors(module: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The module's state with tensors that share storage (tied weights) stored once."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    for name, tensor in module.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen and tensor.numel() > 0:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = tensor
    return tensors, aliases


def _optimizer_param_names(engine: SlipstreamEngine) -> list[str]:
    """Names of the optimizer's parameters in state_dict index order."""
    by_id = {id(param): name for name, param in engine.module.named_parameters()}
    for index, (name, _) in enumerate(engine.named_trainable_parameters):
        if engine.masters is not None:
            by_id[id(engine.masters.masters[index])] = name
    names: list[str] = []
    if engine.optimizer is None:
        return names
    for group in engine.optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in by_id:
                raise CheckpointError(
                    "the optimizer holds a tensor that is not a trainable parameter of the model; "
                    "cannot name its state in the checkpoint"
                )
            names.append(by_id[id(param)])
    return names


def _rng_state() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from slipstream.kernels import get_accelerator

    tensors = {f"torch.{k}": v for k, v in get_accelerator().get_rng_state().items()}
    metadata = {
        "python": json.dumps(_python_rng_to_json(random.getstate())),
        "numpy": json.dumps(_to_json(list(_numpy_state_to_list(np.random.get_state())))),
    }
    return tensors, metadata


def _python_rng_to_json(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _numpy_state_to_list(state: Any) -> list:
    name, keys, pos, has_gauss, cached = state
    return [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]


def _restore_rng(path: Path) -> None:
    from slipstream.kernels import get_accelerator

    tensors = load_file(str(path))
    get_accelerator().set_rng_state(
        {k.removeprefix("torch."): v for k, v in tensors.items() if k.startswith("torch.")}
    )
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    if "python" in metadata:
        version, internal, gauss = json.loads(metadata["python"])
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in metadata:
        name, keys, pos, has_gauss, cached = json.loads(metadata["numpy"])
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


# ---------------------------------------------------------------------------- save
def _check_tag(tag: str) -> str:
    if not tag or "/" in tag or "\\" in tag or tag.startswith(".") or tag == LATEST:
        raise ValueError(
            f"checkpoint tag {tag!r} is not usable as a directory name; use letters, digits, "
            "'-', '_' or '.', not starting with '.' and not 'latest'"
        )
    return tag


def save(
    engine: SlipstreamEngine,
    save_dir: str | Path,
    tag: str | None,
    client_state: dict[str, Any],
    save_latest: bool,
) -> Path:
    """Save ``engine`` under ``save_dir/tag`` (collective: every rank must call it)."""
    if engine.zero is not None:
        from slipstream.runtime import zero_checkpoint

        return zero_checkpoint.save(engine, save_dir, tag, client_state, save_latest)
    tag = _check_tag(str(tag) if tag is not None else f"global_step{engine.global_steps}")
    save_dir = Path(save_dir)
    rank, world = comm.get_rank(), comm.get_world_size()
    staging = save_dir / f".{tag}.partial"
    final = save_dir / tag

    if rank == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        if staging.exists():
            shutil.rmtree(staging)  # left by an interrupted save of the same tag
        staging.mkdir()
    _barrier()

    files: list[dict[str, Any]] = []
    rng_tensors, rng_meta = _rng_state()
    rng_name = f"rng.rank{rank}.safetensors"
    _save_tensors(staging / rng_name, rng_tensors, rng_meta)

    manifest: dict[str, Any] | None = None
    if rank == 0:
        manifest = _save_replicated_state(engine, staging, client_state, files)
    _barrier()

    if rank == 0:
        assert manifest is not None
        for r in range(world):
            name = f"rng.rank{r}.safetensors"
            files.append(
                {"name": name, "kind": "rng", "rank": r, "bytes": (staging / name).stat().st_size}
            )
        manifest["files"] = files
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
        _fsync_file(staging / MANIFEST)
        _fsync_dir(staging)
        _replace_dir(staging, final)
        if save_latest:
            _write_text_atomic(save_dir / LATEST, tag)
        logger.info("saved checkpoint %s (%d files)", final, len(files) + 1)
    _barrier()
    return final


def _save_replicated_state(
    engine: SlipstreamEngine,
    staging: Path,
    client_state: dict[str, Any],
    files: list[dict[str, Any]],
) -> dict[str, Any]:
    """Rank 0's part at stage 0: model, optimizer, schedule and client state are replicated."""
    model_tensors, aliases = _model_tensors(engine.module)
    _save_tensors(staging / "model.safetensors", model_tensors)
    files.append({"name": "model.safetensors", "kind": "model", "rank": 0})

    names = _optimizer_param_names(engine)
    state_dict: dict[str, Any] = (
        engine.optimizer.state_dict()
        if engine.optimizer is not None
        else {"state": {}, "param_groups": []}
    )
    opt_tensors: dict[str, torch.Tensor] = {}
    opt_scalars: dict[str, dict[str, Any]] = {}
    for index, per_param in state_dict["state"].items():
        name = names[index]
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                opt_tensors[f"state/{name}/{key}"] = value
            else:
                opt_scalars.setdefault(name, {})[key] = value
    if engine.masters is not None:
        for (name, _), master in zip(engine.named_trainable_parameters, engine.masters.masters):
            opt_tensors[f"master/{name}"] = master.detach()
    _save_tensors(staging / "optimizer.safetensors", opt_tensors)
    files.append({"name": "optimizer.safetensors", "kind": "optimizer", "rank": 0})

    scheduler_file = (
        _dump_object(staging, "lr_scheduler", engine.lr_scheduler.state_dict())
        if engine.lr_scheduler is not None and hasattr(engine.lr_scheduler, "state_dict")
        else None
    )
    client_file = _dump_object(staging, "client_state", client_state)
    for name in (scheduler_file, client_file):
        if name is not None:
            files.append({"name": name, "kind": "object", "rank": 0})
    for entry in files:
        entry["bytes"] = (staging / entry["name"]).stat().st_size

    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "slipstream_version": slipstream.__version__,
        "torch_version": torch.__version__,
        "world_size": comm.get_world_size(),
        "dp_world_size": engine.dp_world_size,
        "zero_stage": 0,
        "partitioning": "replicated",
        "dtype": str(engine.compute_dtype or torch.float32).removeprefix("torch."),
        "parameters": {
            name: {"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch.")}
            for name, p in engine.named_trainable_parameters
        },
        "tied": aliases,
        "optimizer": {
            "class": type(engine.optimizer).__name__,
            "param_names": names,
            "param_groups": _to_json(state_dict["param_groups"]),
            "scalars": _to_json(opt_scalars),
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
    }


def _replace_dir(staging: Path, final: Path) -> None:
    old = final.with_name(f".{final.name}.old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(staging, final)
    _fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old)


def _barrier() -> None:
    if comm.is_initialized() and comm.get_world_size() > 1:
        comm.barrier()


# ---------------------------------------------------------------------------- load
def available_tags(load_dir: str | Path) -> list[str]:
    """Complete checkpoints (those with a manifest) under ``load_dir``, oldest first."""
    root = Path(load_dir)
    if not root.is_dir():
        return []
    tags = [
        p
        for p in root.iterdir()
        if p.is_dir() and not p.name.startswith(".") and (p / MANIFEST).exists()
    ]
    return [p.name for p in sorted(tags, key=lambda p: p.stat().st_mtime)]


def latest_tag(load_dir: str | Path) -> str | None:
    """The tag named by ``load_dir/latest``, or None when there is none."""
    path = Path(load_dir) / LATEST
    return path.read_text().strip() if path.is_file() else None


def _resolve(load_dir: str | Path, tag: str | None) -> Path:
    root = Path(load_dir)
    if not root.is_dir():
        raise CheckpointNotFoundError(f"checkpoint directory {str(root)!r} does not exist")
    if tag is None:
        tag = latest_tag(root)
        if tag is None:
            tags = available_tags(root)
            raise CheckpointNotFoundError(
                f"no '{LATEST}' file in {str(root)!r}, so there is no checkpoint to resume from; "
                + (f"pass tag= one of {tags}" if tags else "the directory holds no checkpoint")
            )
    path = root / str(tag)
    if not path.is_dir():
        raise CheckpointNotFoundError(
            f"checkpoint tag {tag!r} not found in {str(root)!r}; available: {available_tags(root) or 'none'}"
        )
    return path


def read_manifest(path: Path) -> dict[str, Any]:
    """Read and verify a checkpoint's manifest and every file it lists."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CorruptCheckpointError(
            f"{str(path)!r} has no {MANIFEST}: the checkpoint is incomplete (a save that was "
            "interrupted, or not a Slipstream checkpoint). Load an earlier tag."
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as error:
        raise CorruptCheckpointError(
            f"{str(manifest_path)!r} is not valid JSON: {error}"
        ) from error
    if manifest.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{str(manifest_path)!r} is not a {FORMAT} manifest")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{str(path)!r} was written by a newer Slipstream ({manifest.get('slipstream_version')}); "
            f"this version reads format {FORMAT_VERSION}. Upgrade slipstream."
        )
    for entry in manifest.get("files", []):
        file = path / entry["name"]
        if not file.is_file():
            raise CorruptCheckpointError(f"checkpoint file {str(file)!r} is missing")
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise CorruptCheckpointError(
                f"checkpoint file {str(file)!r} has {size} bytes but the manifest records "
                f"{entry['bytes']}: it is truncated or was modified"
            )
        if file.suffix == ".safetensors":
            try:
                with safe_open(str(file), framework="pt") as f:
                    f.keys()
            except (SafetensorError, OSError, ValueError) as error:
                raise CorruptCheckpointError(
                    f"checkpoint file {str(file)!r} is corrupt: {error}"
                ) from error
    return manifest


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
    """Restore ``engine`` from a checkpoint; returns ``(path, client_state)``."""
    if engine.zero is not None:
        from slipstream.runtime import zero_checkpoint

        return zero_checkpoint.load(
            engine,
            load_dir,
            tag,
            load_module_strict=load_module_strict,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
        )
    path = _resolve(load_dir, tag)
    manifest = read_manifest(path)
    if manifest.get("zero_stage", 0) > 0:
        raise CheckpointError(
            f"{str(path)!r} is a ZeRO stage-{manifest['zero_stage']} checkpoint (sharded over "
            f"{manifest.get('dp_world_size')} ranks); load it with zero_optimization.stage >= 1 "
            "(any world size), or consolidate it first with "
            "slipstream.runtime.zero_checkpoint.get_fp32_state_dict_from_zero_checkpoint"
        )
    device = engine.device

    model_state = load_file(str(path / "model.safetensors"), device=str(device))
    for alias, source in manifest.get("tied", {}).items():
        model_state[alias] = model_state[source]
    try:
        engine.module.load_state_dict(model_state, strict=load_module_strict)
    except RuntimeError as error:
        raise CheckpointError(
            f"the model in {str(path)!r} does not fit this module: {error}"
        ) from error

    optimizer_tensors: dict[str, torch.Tensor] | None = None
    if load_optimizer_states or engine.masters is not None:
        # On the CPU: Optimizer.load_state_dict moves state to each parameter's device itself,
        # and keeps Adam's `step` counters on the CPU where the non-fused kernels expect them.
        optimizer_tensors = load_file(str(path / "optimizer.safetensors"), device="cpu")
    if engine.masters is not None:
        assert optimizer_tensors is not None
        _restore_masters(engine, optimizer_tensors, use_saved=not load_module_only)
    if load_optimizer_states and engine.optimizer is not None:
        assert optimizer_tensors is not None
        _restore_optimizer(engine, manifest["optimizer"], optimizer_tensors, path)

    return path, restore_engine_state(
        engine, path, manifest, load_lr_scheduler_states, load_module_only
    )


def restore_engine_state(
    engine: SlipstreamEngine,
    path: Path,
    manifest: dict[str, Any],
    load_lr_scheduler_states: bool,
    load_module_only: bool,
) -> dict[str, Any]:
    """Restore schedule, counters, loss scale, RNG and client state; return the client state."""
    if (
        load_lr_scheduler_states
        and engine.lr_scheduler is not None
        and manifest.get("lr_scheduler_file")
    ):
        engine.lr_scheduler.load_state_dict(_load_object(path, manifest["lr_scheduler_file"]))

    client_state: dict[str, Any] = {}
    if not load_module_only:
        state = manifest["engine"]
        engine.global_steps = state["global_steps"]
        engine.global_samples = state["global_samples"]
        engine.micro_steps = state["micro_steps"]
        engine.skipped_steps = state["skipped_steps"]
        if engine.loss_scaler is not None and state.get("loss_scaler"):
            engine.loss_scaler.load_state_dict(state["loss_scaler"])
        rng = path / f"rng.rank{comm.get_rank()}.safetensors"
        if rng.is_file():
            _restore_rng(rng)
        else:
            logger.warning(
                "checkpoint %s was saved by %d ranks; rank %d has no RNG state there and keeps its own",
                path,
                manifest["world_size"],
                comm.get_rank(),
            )
        if manifest.get("client_state_file"):
            client_state = _load_object(path, manifest["client_state_file"])
    if comm.get_rank() == 0:
        logger.info("loaded checkpoint %s (step %d)", path, manifest["engine"]["global_steps"])
    return client_state


def _restore_masters(
    engine: SlipstreamEngine, tensors: dict[str, torch.Tensor], use_saved: bool
) -> None:
    assert engine.masters is not None
    with torch.no_grad():
        for (name, _), master in zip(engine.named_trainable_parameters, engine.masters.masters):
            saved = tensors.get(f"master/{name}") if use_saved else None
            if saved is not None:
                master.copy_(saved)
            else:
                master.copy_(dict(engine.named_trainable_parameters)[name])


def _restore_optimizer(
    engine: SlipstreamEngine, saved: dict[str, Any], tensors: dict[str, torch.Tensor], path: Path
) -> None:
    names = _optimizer_param_names(engine)
    if sorted(names) != sorted(saved["param_names"]):
        missing = sorted(set(saved["param_names"]) - set(names))[:5]
        extra = sorted(set(names) - set(saved["param_names"]))[:5]
        raise CheckpointError(
            f"the optimizer state in {str(path)!r} is for other parameters (in the checkpoint only: "
            f"{missing}; in this model only: {extra}). Pass load_optimizer_states=False to load the "
            "weights alone."
        )
    saved_groups = _from_json(saved["param_groups"])
    assert engine.optimizer is not None  # checked by load()
    current_groups = engine.optimizer.state_dict()["param_groups"]
    if len(saved_groups) != len(current_groups):
        raise CheckpointError(
            f"the checkpoint has {len(saved_groups)} optimizer parameter groups, this optimizer "
            f"{len(current_groups)}"
        )
    scalars = _from_json(saved["scalars"])
    state: dict[int, dict[str, Any]] = {}
    for index, name in enumerate(names):
        entry = dict(scalars.get(name, {}))
        prefix = f"state/{name}/"
        for key, tensor in tensors.items():
            if key.startswith(prefix):
                entry[key[len(prefix) :]] = tensor
        if entry:
            state[index] = entry
    groups = []
    for saved_group, current in zip(saved_groups, current_groups):
        group = dict(saved_group)
        group["params"] = current["params"]
        groups.append(group)
    engine.optimizer.load_state_dict({"state": state, "param_groups": groups})
