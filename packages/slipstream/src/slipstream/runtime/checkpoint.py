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

import ctypes
import errno
import json
import logging
import os
import random
import re
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

import slipstream
from slipstream import comm
from slipstream.offload.checksum import ALGORITHM as CHECKSUM_ALGORITHM
from slipstream.offload.checksum import ChecksumUnavailableError, file_checksum

if TYPE_CHECKING:
    from slipstream.runtime.engine import SlipstreamEngine

logger = logging.getLogger(__name__)

FORMAT = "slipstream-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"

# Error types that ``agree`` re-raises as themselves on every rank (filled below).
_AGREED_TYPES: dict[str, type[Exception]] = {}


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint directory, its `latest` file or the requested tag does not exist."""


class CorruptCheckpointError(CheckpointError):
    """The checkpoint exists but is incomplete or damaged (missing file, size, checksum)."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit this engine (names, dtypes, optimizer, schedule, layout)."""


class CheckpointShapeError(CheckpointMismatchError):
    """A saved tensor's shape differs from the engine's (a checkpoint of another model size)."""


class NonFiniteCheckpointError(CheckpointError):
    """The weights or optimizer state to be saved hold NaN or inf."""


class CheckpointSaveError(CheckpointError, OSError):
    """Writing the checkpoint failed (permissions, a path that is a file, I/O errors)."""


class CheckpointDiskFullError(CheckpointSaveError):
    """Writing the checkpoint failed for lack of space (ENOSPC / EDQUOT)."""


for _cls in (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    CheckpointMismatchError,
    CheckpointShapeError,
    NonFiniteCheckpointError,
    CheckpointSaveError,
    CheckpointDiskFullError,
    ValueError,
):
    _AGREED_TYPES[_cls.__name__] = _cls


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


# ---------------------------------------------------------------------------- agreement
# [Note: checkpoint agreement]
# Saving and loading are collectives. Each phase runs on every rank without collectives inside
# it and ends with one all_gather_object (``agree``) of every rank's outcome; if any rank failed,
# every rank raises the same error (the first failing rank's type and message). So a rank whose
# mkdir failed, whose disk is full or whose file is corrupt never leaves the others waiting in
# the next collective until the process-group timeout, and a caller that catches the error can
# go on training on every rank alike.
def _distributed() -> bool:
    return comm.is_initialized() and comm.get_world_size() > 1


def agree(error: BaseException | None, what: str, payload: Any = None) -> list[Any]:
    """Collective: every rank's ``payload``, or the first failing rank's error on every rank.

    ``error`` is this rank's failure (None when it succeeded). Outside a process group of
    several ranks it is raised as it is.
    """
    if not _distributed():
        if error is not None:
            raise error
        return [payload]
    record = None if error is None else (type(error).__name__, str(error))
    gathered: list[Any] = [None] * comm.get_world_size()
    torch.distributed.all_gather_object(gathered, (record, payload))
    failures = [(rank, entry[0]) for rank, entry in enumerate(gathered) if entry[0] is not None]
    if not failures:
        return [entry[1] for entry in gathered]
    rank, (name, message) = failures[0]
    also = f" (and on ranks {[r for r, _ in failures[1:]]})" if len(failures) > 1 else ""
    raised = _AGREED_TYPES.get(name, CheckpointError)(
        f"{what} failed on rank {rank}{also}: {message}"
    )
    if error is not None:
        raise raised from error
    raise raised


def _attempt(function: Any, *args: Any, saving: bool = False) -> tuple[Any, Exception | None]:
    """``(function(*args), None)`` or ``(None, the error)``; OSErrors of a save become named."""
    try:
        return function(*args), None
    except Exception as error:  # handed to agree(), which raises it on every rank
        if saving and isinstance(error, OSError) and not isinstance(error, CheckpointError):
            cls = (
                CheckpointDiskFullError
                if error.errno in (errno.ENOSPC, errno.EDQUOT)
                else CheckpointSaveError
            )
            wrapped = cls(f"could not write the checkpoint: {error}")
            wrapped.__cause__ = error
            return None, wrapped
        return None, error


# ---------------------------------------------------------------------------- save
def _check_tag(tag: str) -> str:
    if not tag or "/" in tag or "\\" in tag or tag.startswith(".") or tag == LATEST:
        raise ValueError(
            f"checkpoint tag {tag!r} is not usable as a directory name; use letters, digits, "
            "'-', '_' or '.', not starting with '.' and not 'latest'"
        )
    return tag


def file_entry(directory: Path, name: str, kind: str, rank: int) -> dict[str, Any]:
    """The manifest's record of a written file: name, kind, rank, bytes and checksum."""
    path = directory / name
    return {
        "name": name,
        "kind": kind,
        "rank": rank,
        "bytes": path.stat().st_size,
        "checksum": file_checksum(path),
    }


def first_non_finite(named: Any) -> str | None:
    """The name of the first floating-point tensor of ``(name, tensor)`` pairs holding NaN/inf."""
    for name, tensor in named:
        if (
            isinstance(tensor, torch.Tensor)
            and tensor.is_floating_point()
            and tensor.numel()
            and not bool(torch.isfinite(tensor).all())
        ):
            return str(name)
    return None


def _stage0_tensors(engine: SlipstreamEngine) -> Any:
    """What a stage-0 checkpoint stores, for the non-finite check."""
    for name, tensor in engine.module.state_dict().items():
        yield f"model tensor {name}", tensor
    if engine.masters is not None:
        for (name, _), master in zip(engine.named_trainable_parameters, engine.masters.masters):
            yield f"master weight {name}", master
    if engine.optimizer is not None:
        names = _optimizer_param_names(engine)
        index = 0
        for group in engine.optimizer.param_groups:
            for param in group["params"]:
                for key, value in engine.optimizer.state.get(param, {}).items():
                    yield f"optimizer state {names[index]}/{key}", value
                index += 1


def save(
    engine: SlipstreamEngine,
    save_dir: str | Path,
    tag: str | None,
    client_state: dict[str, Any],
    save_latest: bool,
    allow_non_finite: bool | None = None,
) -> Path:
    """Save ``engine`` under ``save_dir/tag`` (collective: every rank must call it).

    The phases (see the module docstring and [Note: checkpoint agreement]): check (tag,
    non-finite values), prepare the staging directory (rank 0), write each rank's files,
    write the manifest and switch the tag and ``latest`` over (rank 0). A failure anywhere
    raises the same error on every rank and leaves the previous checkpoints as they were.
    """
    zero = engine.zero is not None
    if zero:
        from slipstream.runtime import zero_checkpoint as layout
    save_dir = Path(save_dir)
    if allow_non_finite is None:
        allow_non_finite = _checkpoint_config(engine, "allow_non_finite", False)
    chosen = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    what = f"saving checkpoint {str(save_dir / chosen)!r}"

    def check() -> None:
        _check_tag(chosen)
        if allow_non_finite:
            return
        bad = first_non_finite(layout.tensors_to_check(engine) if zero else _stage0_tensors(engine))
        if bad is not None:
            raise NonFiniteCheckpointError(
                f"{bad} holds NaN or inf: refusing to checkpoint non-finite weights, so "
                f"'{LATEST}' keeps naming the last good checkpoint. Find the step that diverged "
                "(lower the learning rate, enable gradient clipping), or pass "
                'save_checkpoint(..., allow_non_finite=True) / "checkpoint": '
                '{"allow_non_finite": true} to write it anyway.'
            )

    agree(_attempt(check)[1], what)
    rank = comm.get_rank()
    staging = save_dir / f".{chosen}.partial"
    final = save_dir / chosen
    error = _attempt(_prepare_staging, save_dir, staging, saving=True)[1] if rank == 0 else None
    agree(error, what)

    def write() -> dict[str, Any]:
        if zero:
            files, info = layout.write_rank_files(engine, staging)
        else:
            files, info = _write_stage0_rank_files(engine, staging)
        return {"files": files, "info": info}

    part, error = _attempt(write, saving=True)
    parts = agree(error, what, part)

    def finish() -> None:
        files = [entry for p in parts for entry in p["files"]]
        specific = (
            layout.manifest_fields(engine, [p["info"] for p in parts])
            if zero
            else _stage0_manifest_fields(engine, [p["info"] for p in parts])
        )
        manifest = _common_manifest(engine, staging, client_state, files)
        manifest.update(specific)
        manifest["files"] = sorted(manifest["files"], key=lambda e: (e["kind"], e["name"]))
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
        _fsync_file(staging / MANIFEST)
        _fsync_dir(staging)
        _commit(staging, final)
        if save_latest:
            _write_text_atomic(save_dir / LATEST, chosen)
        logger.info("saved checkpoint %s (%d files)", final, len(manifest["files"]) + 1)

    agree(_attempt(finish, saving=True)[1] if rank == 0 else None, what)
    return final


def _checkpoint_config(engine: SlipstreamEngine, key: str, default: bool) -> bool:
    block = getattr(engine.config, "checkpoint", None)
    return bool(getattr(block, key, default))


def _write_stage0_rank_files(
    engine: SlipstreamEngine, staging: Path
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every rank: its RNG state; rank 0 also the (replicated) model and optimizer."""
    rank = comm.get_rank()
    rng_tensors, rng_meta = _rng_state()
    rng_name = f"rng.rank{rank}.safetensors"
    _save_tensors(staging / rng_name, rng_tensors, rng_meta)
    files = [file_entry(staging, rng_name, "rng", rank)]
    info: dict[str, Any] = {}
    if rank != 0:
        return files, info
    model_tensors, aliases = _model_tensors(engine.module)
    _save_tensors(staging / "model.safetensors", model_tensors)
    files.append(file_entry(staging, "model.safetensors", "model", 0))

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
    files.append(file_entry(staging, "optimizer.safetensors", "optimizer", 0))
    info = {
        "tied": aliases,
        "optimizer": {
            "class": type(engine.optimizer).__name__,
            "param_names": names,
            "param_groups": _to_json(state_dict["param_groups"]),
            "scalars": _to_json(opt_scalars),
        },
    }
    return files, info


def _stage0_manifest_fields(
    engine: SlipstreamEngine, infos: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "zero_stage": 0,
        "partitioning": "replicated",
        "parameters": {
            name: {"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch.")}
            for name, p in engine.named_trainable_parameters
        },
        **infos[0],
    }


def _common_manifest(
    engine: SlipstreamEngine, staging: Path, client_state: dict[str, Any], files: list[Any]
) -> dict[str, Any]:
    """Rank 0: what both layouts record alike, plus the schedule and client-state files."""
    scheduler_file = (
        _dump_object(staging, "lr_scheduler", engine.lr_scheduler.state_dict())
        if engine.lr_scheduler is not None and hasattr(engine.lr_scheduler, "state_dict")
        else None
    )
    client_file = _dump_object(staging, "client_state", client_state)
    files = list(files)
    for name in (scheduler_file, client_file):
        if name is not None:
            files.append(file_entry(staging, name, "object", 0))
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "slipstream_version": slipstream.__version__,
        "torch_version": torch.__version__,
        "checksum_algorithm": CHECKSUM_ALGORITHM,
        "world_size": comm.get_world_size(),
        "dp_world_size": engine.dp_world_size,
        "dtype": str(engine.compute_dtype or torch.float32).removeprefix("torch."),
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


# [Note: crash-safe tag switch]
# A tag is written into ``.<tag>.partial`` and becomes visible by one rename. A new tag: a
# rename onto the free name. An existing tag (a re-save): the two directories are exchanged
# in one atomic renameat2(RENAME_EXCHANGE) (Linux: ext4, xfs, btrfs, tmpfs, ...), after which
# ``.<tag>.partial`` holds the old copy and is deleted. Where the file system refuses the
# exchange (NFS, some FUSE mounts, non-Linux), the old copy is first renamed to ``.<tag>.old``;
# a crash between that rename and the next leaves both complete copies under hidden names, and
# ``_resolve`` (every load) and ``recover_leftovers`` (every save) find them: the newest
# complete one (``.partial`` with a manifest, else ``.old``) is used, and only then is anything
# deleted. ``latest`` is replaced (write, fsync, rename) only after the tag is in place.
def _prepare_staging(save_dir: Path, staging: Path) -> None:
    if save_dir.exists() and not save_dir.is_dir():
        raise CheckpointSaveError(
            f"checkpoint directory {str(save_dir)!r} exists and is not a directory; pass a "
            "directory path as save_dir"
        )
    save_dir.mkdir(parents=True, exist_ok=True)
    recover_leftovers(save_dir)
    if staging.exists():
        shutil.rmtree(staging)  # an interrupted save of this tag; never the only good copy
    staging.mkdir()


_LEFTOVER = re.compile(r"\.(?P<tag>.+)\.(?P<what>partial|old)")


def _complete(path: Path) -> bool:
    return path.is_dir() and (path / MANIFEST).is_file()


def _survivor(root: Path, tag: str) -> Path | None:
    """A complete hidden copy of ``tag`` left by an interrupted switch, newest first."""
    for what in ("partial", "old"):
        candidate = root / f".{tag}.{what}"
        if _complete(candidate):
            return candidate
    return None


def recover_leftovers(save_dir: str | Path) -> list[str]:
    """Finish interrupted saves in ``save_dir``: restore lost tags, then delete leftovers.

    A tag missing while a complete hidden copy of it exists (a crash inside the switch; see
    [Note: crash-safe tag switch]) is renamed back into place; every other ``.<tag>.partial``
    or ``.<tag>.old`` is an incomplete or superseded copy and is removed. Returns the tags
    restored. Run by rank 0 at the start of every save.
    """
    root = Path(save_dir)
    restored = []
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        match = _LEFTOVER.fullmatch(entry.name)
        if match is None or not entry.is_dir():
            continue
        tag = match["tag"]
        final = root / tag
        if not final.exists():
            survivor = _survivor(root, tag)
            if survivor is not None:
                os.replace(survivor, final)
                _fsync_dir(root)
                restored.append(tag)
                logger.warning(
                    "checkpoint %s was left under %s by an interrupted save; restored it",
                    final,
                    survivor.name,
                )
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        match = _LEFTOVER.fullmatch(entry.name)
        if match is not None and entry.is_dir() and (root / match["tag"]).exists():
            shutil.rmtree(entry)
    return restored


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(first: Path, second: Path) -> bool:
    """Swap two directories atomically (Linux renameat2); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    result = renameat2(
        _AT_FDCWD,
        os.fsencode(first),
        _AT_FDCWD,
        os.fsencode(second),
        ctypes.c_uint(_RENAME_EXCHANGE),
    )
    if result == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, f"cannot exchange {first} and {second}: {os.strerror(err)}")


def _commit(staging: Path, final: Path) -> None:
    """Make ``staging`` the tag ``final`` (see [Note: crash-safe tag switch])."""
    if not final.exists():
        os.rename(staging, final)
    elif _exchange(staging, final):
        _fsync_dir(final.parent)
        shutil.rmtree(staging)  # the previous copy now
    else:
        old = final.with_name(f".{final.name}.old")
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(staging, final)
        _fsync_dir(final.parent)
        shutil.rmtree(old)
    _fsync_dir(final.parent)


def _barrier() -> None:
    if _distributed():
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
        survivor = _survivor(root, str(tag))
        if survivor is not None:
            # A crash inside the tag switch on a file system without atomic exchange: the
            # complete copy is still there under its hidden name (the next save renames it).
            logger.warning("checkpoint %s is missing; loading its complete copy %s", path, survivor)
            return survivor
        raise CheckpointNotFoundError(
            f"checkpoint tag {tag!r} not found in {str(root)!r}; available: {available_tags(root) or 'none'}"
        )
    return path


def read_manifest(
    path: Path,
    verify_checksums: bool = True,
    share: tuple[int, int] | None = None,
    progress: Any = None,
) -> dict[str, Any]:
    """Read a checkpoint's manifest and verify every file it lists.

    Every file's presence, size and (safetensors) header are checked; with
    ``verify_checksums`` also its content against the manifest's checksum. ``share`` =
    ``(rank, world)`` checks only every ``world``-th file's content, from the ``rank``-th
    (the ranks of a load split the reading; ``agree`` combines their verdicts).
    ``progress(bytes)`` is called as content is read.

    Raises:
        CorruptCheckpointError: a file is missing, truncated, unreadable or does not match its
            checksum (named, with what to do).
    """
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CorruptCheckpointError(
            f"{str(path)!r} has no {MANIFEST}: the checkpoint is incomplete (a save that was "
            "interrupted, or not a Slipstream checkpoint). Load an earlier tag."
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CorruptCheckpointError(
            f"{str(manifest_path)!r} is not valid JSON: {error}"
        ) from error
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{str(manifest_path)!r} is not a {FORMAT} manifest")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{str(path)!r} was written by a newer Slipstream ({manifest.get('slipstream_version')}); "
            f"this version reads format {FORMAT_VERSION}. Upgrade slipstream."
        )
    unchecked = 0
    for index, entry in enumerate(manifest.get("files", [])):
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
        expected = entry.get("checksum")
        if not verify_checksums or (share is not None and index % share[1] != share[0]):
            continue
        if expected is None:
            unchecked += 1
            continue
        try:
            actual = file_checksum(file, like=expected, progress=progress)
        except ChecksumUnavailableError as error:
            raise CheckpointError(f"cannot verify {str(file)!r}: {error}") from error
        if actual != expected:
            raise CorruptCheckpointError(
                f"checkpoint file {str(file)!r} does not match its checksum (manifest "
                f"{expected}, file {actual}): its content was damaged after it was written. "
                "Load an earlier tag (tag=...), or restore the file from a copy."
            )
    if unchecked:
        logger.info("%s: %d files predate checksums and were not verified", path, unchecked)
    return manifest


def _open_checkpoint(engine: SlipstreamEngine, load_dir: str | Path, tag: str | None) -> Any:
    """Every rank: resolve and verify (each rank checks its share of the files' content)."""
    path = _resolve(load_dir, tag)
    share = (comm.get_rank(), comm.get_world_size()) if _distributed() else None
    verify = _checkpoint_config(engine, "verify_checksums", True)
    return path, read_manifest(path, verify_checksums=verify, share=share)


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
    """Restore ``engine`` from a checkpoint; returns ``(path, client_state)``.

    Transactional: the checkpoint is resolved, its files verified and every name, shape,
    dtype and the optimizer's class and groups compared with this engine, on every rank and
    agreed, before the first tensor is copied; a refused load leaves the engine as it was.
    """
    what = f"loading checkpoint from {str(load_dir)!r}"
    zero = engine.zero is not None
    if zero:
        from slipstream.runtime import zero_checkpoint as layout
    options = {
        "load_module_strict": load_module_strict,
        "load_optimizer_states": load_optimizer_states,
        "load_lr_scheduler_states": load_lr_scheduler_states,
        "load_module_only": load_module_only,
    }

    def prepare() -> tuple[Path, dict[str, Any], Any, _Extras]:
        path, manifest = _open_checkpoint(engine, load_dir, tag)
        if zero:
            plan = layout.validate(engine, path, manifest, options)
        else:
            plan = _validate_stage0(engine, path, manifest, options)
        extras = _read_extras(engine, path, manifest, load_lr_scheduler_states, load_module_only)
        return path, manifest, plan, extras

    prepared, error = _attempt(prepare)
    agree(error, what)
    path, manifest, plan, extras = prepared
    if zero:
        layout.apply(engine, path, manifest, plan, options)
    else:
        _apply_stage0(engine, path, manifest, plan, options)
    return path, apply_extras(engine, path, manifest, extras)


# ---------------------------------------------------------------------------- validation
class _Extras:
    """What a load reads besides tensors, read before anything is changed."""

    def __init__(self) -> None:
        self.scheduler: Any = None
        self.client_state: dict[str, Any] = {}
        self.rng: Path | None = None
        self.counters: dict[str, Any] | None = None


def _read_extras(
    engine: SlipstreamEngine,
    path: Path,
    manifest: dict[str, Any],
    load_lr_scheduler_states: bool,
    load_module_only: bool,
) -> _Extras:
    extras = _Extras()
    if (
        load_lr_scheduler_states
        and engine.lr_scheduler is not None
        and manifest.get("lr_scheduler_file")
    ):
        extras.scheduler = _load_object(path, manifest["lr_scheduler_file"])
        current = engine.lr_scheduler.state_dict()
        if isinstance(extras.scheduler, dict) and isinstance(current, dict):
            if set(extras.scheduler) != set(current):
                raise CheckpointMismatchError(
                    f"the learning-rate schedule in {str(path)!r} has keys "
                    f"{sorted(extras.scheduler)}, this engine's scheduler "
                    f"({type(engine.lr_scheduler).__name__}) {sorted(current)}: another "
                    "scheduler type. Pass load_lr_scheduler_states=False to keep this one."
                )
    if not load_module_only:
        extras.counters = manifest["engine"]
        rng = path / f"rng.rank{comm.get_rank()}.safetensors"
        extras.rng = rng if rng.is_file() else None
        if manifest.get("client_state_file"):
            extras.client_state = _load_object(path, manifest["client_state_file"])
    return extras


def apply_extras(
    engine: SlipstreamEngine, path: Path, manifest: dict[str, Any], extras: _Extras
) -> dict[str, Any]:
    """Restore schedule, counters, loss scale and RNG (read and checked already)."""
    if extras.scheduler is not None:
        assert engine.lr_scheduler is not None
        engine.lr_scheduler.load_state_dict(extras.scheduler)
    if extras.counters is not None:
        state = extras.counters
        engine.global_steps = state["global_steps"]
        engine.global_samples = state["global_samples"]
        engine.micro_steps = state["micro_steps"]
        engine.skipped_steps = state["skipped_steps"]
        if engine.loss_scaler is not None and state.get("loss_scaler"):
            engine.loss_scaler.load_state_dict(state["loss_scaler"])
        if extras.rng is not None:
            _restore_rng(extras.rng)
        else:
            logger.warning(
                "checkpoint %s was saved by %d ranks; rank %d has no RNG state there and keeps its own",
                path,
                manifest["world_size"],
                comm.get_rank(),
            )
    if comm.get_rank() == 0:
        logger.info("loaded checkpoint %s (step %d)", path, manifest["engine"]["global_steps"])
    return extras.client_state


def _header(path: Path) -> dict[str, tuple[list[int], str]]:
    """Each tensor's (shape, dtype name) in a safetensors file, without reading the data."""
    out = {}
    with safe_open(str(path), framework="pt") as handle:
        for key in handle.keys():
            piece = handle.get_slice(key)
            out[key] = (list(piece.get_shape()), str(piece.get_dtype()))
    return out


_FLOAT_CODES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}


def check_tensor_fits(
    path: Path, what: str, saved_shape: list[int], saved_dtype: str | None, target: torch.Tensor
) -> None:
    """A saved tensor must have the target's shape, and be floating point exactly where it is.

    Floating-point precision may differ (a bf16 run resuming an fp32 checkpoint casts);
    floating point against integer (or bool) may not.
    """
    if list(saved_shape) != list(target.shape):
        raise CheckpointShapeError(
            f"{what} has shape {list(saved_shape)} in {str(path)!r} but "
            f"{list(target.shape)} in this model: the checkpoint is of a different model "
            "(size or architecture). Load a checkpoint of this model, or build the model the "
            "checkpoint was saved from."
        )
    if saved_dtype is not None:
        saved_float = saved_dtype.upper() in _FLOAT_CODES or saved_dtype.startswith(
            ("float", "bfloat")
        )
        if saved_float != target.is_floating_point():
            raise CheckpointMismatchError(
                f"{what} is {saved_dtype} in {str(path)!r} but {target.dtype} in this model"
            )


def check_optimizer_fits(
    engine: SlipstreamEngine, saved: dict[str, Any], names: list[str], path: Path
) -> None:
    """Same optimizer class, parameters, group count and hyper-parameter keys."""
    assert engine.optimizer is not None
    current_class = type(engine.optimizer).__name__
    if saved.get("class") != current_class:
        raise CheckpointMismatchError(
            f"the optimizer state in {str(path)!r} is {saved.get('class')}'s, this engine's "
            f"optimizer is {current_class}: its state and hyper-parameters would not fit. "
            f"Configure {saved.get('class')} as the checkpoint's run did, or pass "
            "load_optimizer_states=False to load the weights alone."
        )
    if sorted(names) != sorted(saved["param_names"]):
        missing = sorted(set(saved["param_names"]) - set(names))[:5]
        extra = sorted(set(names) - set(saved["param_names"]))[:5]
        raise CheckpointMismatchError(
            f"the optimizer state in {str(path)!r} is for other parameters (in the checkpoint only: "
            f"{missing}; in this model only: {extra}). Pass load_optimizer_states=False to load the "
            "weights alone."
        )
    saved_groups = _from_json(saved["param_groups"])
    current_groups = engine.optimizer.state_dict()["param_groups"]
    if len(saved_groups) != len(current_groups):
        raise CheckpointMismatchError(
            f"the checkpoint has {len(saved_groups)} optimizer parameter groups, this optimizer "
            f"{len(current_groups)}"
        )
    for index, (old, new) in enumerate(zip(saved_groups, current_groups)):
        if set(old) - {"params"} != set(new) - {"params"}:
            raise CheckpointMismatchError(
                f"optimizer parameter group {index} in {str(path)!r} has hyper-parameters "
                f"{sorted(set(old) - {'params'})}, this optimizer's "
                f"{sorted(set(new) - {'params'})}; pass load_optimizer_states=False to load the "
                "weights alone"
            )
        if len(old["params"]) != len(new["params"]):
            raise CheckpointMismatchError(
                f"optimizer parameter group {index} holds {len(old['params'])} parameters in "
                f"{str(path)!r}, {len(new['params'])} in this optimizer"
            )
    # State keys: where this optimizer already has state, the checkpoint's must match it.
    scalars = _from_json(saved["scalars"])
    for name, param in zip(names, (p for g in engine.optimizer.param_groups for p in g["params"])):
        have = set(engine.optimizer.state.get(param, {}))
        if have and name in scalars and not set(scalars[name]) <= have:
            raise CheckpointMismatchError(
                f"the optimizer state of {name!r} in {str(path)!r} has keys "
                f"{sorted(scalars[name])}, this optimizer's {sorted(have)}"
            )


def _validate_stage0(
    engine: SlipstreamEngine, path: Path, manifest: dict[str, Any], options: dict[str, bool]
) -> dict[str, Any]:
    if manifest.get("zero_stage", 0) > 0:
        raise CheckpointMismatchError(
            f"{str(path)!r} is a ZeRO stage-{manifest['zero_stage']} checkpoint (sharded over "
            f"{manifest.get('dp_world_size')} ranks); load it with zero_optimization.stage >= 1 "
            "(any world size), or consolidate it first with "
            "slipstream.runtime.zero_checkpoint.get_fp32_state_dict_from_zero_checkpoint"
        )
    header = _header(path / "model.safetensors")
    tied = manifest.get("tied", {})
    current = engine.module.state_dict()
    saved_names = set(header) | set(tied)
    missing = sorted(set(current) - saved_names)
    unexpected = sorted(saved_names - set(current))
    if options["load_module_strict"] and (missing or unexpected):
        raise CheckpointMismatchError(
            f"the model in {str(path)!r} does not fit this module: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]} (load_module_strict=False loads the names both have)"
        )
    for name, tensor in current.items():
        source = tied.get(name, name)
        if source in header:
            shape, dtype = header[source]
            check_tensor_fits(path, f"model tensor {name!r}", shape, dtype, tensor)
    load_optimizer = options["load_optimizer_states"] and engine.optimizer is not None
    optimizer_header: dict[str, tuple[list[int], str]] = {}
    if load_optimizer or engine.masters is not None:
        optimizer_header = _header(path / "optimizer.safetensors")
    if engine.masters is not None:
        for name, param in engine.named_trainable_parameters:
            if f"master/{name}" in optimizer_header:
                shape, dtype = optimizer_header[f"master/{name}"]
                check_tensor_fits(path, f"master weight {name!r}", shape, dtype, param)
    if load_optimizer:
        names = _optimizer_param_names(engine)
        check_optimizer_fits(engine, manifest["optimizer"], names, path)
        shapes = dict(engine.named_trainable_parameters)
        for key, (shape, _) in optimizer_header.items():
            if key.startswith("state/"):
                name = key[len("state/") :].rpartition("/")[0]
                numel = 1
                for size in shape:
                    numel *= size
                if name in shapes and numel > 1 and shape != list(shapes[name].shape):
                    raise CheckpointShapeError(
                        f"optimizer state {key!r} has shape {shape} in {str(path)!r}, the "
                        f"parameter {list(shapes[name].shape)} in this model"
                    )
    return {"load_optimizer": load_optimizer}


def _apply_stage0(
    engine: SlipstreamEngine,
    path: Path,
    manifest: dict[str, Any],
    plan: dict[str, Any],
    options: dict[str, bool],
) -> None:
    model_state = load_file(str(path / "model.safetensors"), device=str(engine.device))
    for alias, source in manifest.get("tied", {}).items():
        model_state[alias] = model_state[source]
    engine.module.load_state_dict(model_state, strict=options["load_module_strict"])
    optimizer_tensors: dict[str, torch.Tensor] | None = None
    if plan["load_optimizer"] or engine.masters is not None:
        # On the CPU: Optimizer.load_state_dict moves state to each parameter's device itself,
        # and keeps Adam's `step` counters on the CPU where the non-fused kernels expect them.
        optimizer_tensors = load_file(str(path / "optimizer.safetensors"), device="cpu")
    if engine.masters is not None:
        assert optimizer_tensors is not None
        _restore_masters(engine, optimizer_tensors, use_saved=not options["load_module_only"])
    if plan["load_optimizer"]:
        assert optimizer_tensors is not None
        _restore_optimizer(engine, manifest["optimizer"], optimizer_tensors)


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
    engine: SlipstreamEngine, saved: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> None:
    assert engine.optimizer is not None
    names = _optimizer_param_names(engine)
    saved_groups = _from_json(saved["param_groups"])
    current_groups = engine.optimizer.state_dict()["param_groups"]
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
