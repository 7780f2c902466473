"""Engine checkpoints: safetensors files plus a JSON manifest, written atomically.

Layout of ``save_dir``::

    latest                          the newest tag (written last, atomically)
    <tag>/manifest.json             format, versions, world size, stage, parameters, files
    <tag>/model.safetensors         module state (the module's dtype); tied tensors stored once
    <tag>/optimizer.safetensors     optimizer state tensors, keyed by parameter name (+ fp32 masters)
    <tag>/rng.rank<R>.safetensors   each rank's torch RNG states (+ Python/NumPy state in metadata)
    <tag>/client_state.json|.pt     what the caller passed as client_state

Every file's size and checksum are in the manifest. A tag is assembled in a hidden staging
directory and switched into place in one atomic step after every file is written and fsync'ed;
``latest`` is replaced only after that. Loading verifies every file and checks the checkpoint
against the engine on every rank, and agrees, before it copies anything. The directory protocol
shared with ZeRO checkpoints (errors, agreement, manifest verifier, tag switch, recovery) is in
checkpoint_store.py; the guarantees are stated in docs/reliability.md.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import slipstream
from slipstream import comm
from slipstream.offload.checksum import ALGORITHM as CHECKSUM_ALGORITHM
from slipstream.runtime.checkpoint_manager import (
    CheckpointParts,
    engine_parts,
    gradient_path_state,
)
from slipstream.runtime.checkpoint_store import (
    FORMAT,
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    CheckpointDiskFullError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    CheckpointShapeError,
    CorruptCheckpointError,
    NonFiniteCheckpointError,
    _attempt,
    _check_tag,
    _commit,
    _distributed,
    _fsync_dir,
    _fsync_file,
    _header,
    _prepare_staging,
    _resolve,
    _write_text_atomic,
    agree,
    available_tags,
    file_entry,
    latest_tag,
    read_manifest,
    recover_leftovers,
)

if TYPE_CHECKING:
    from slipstream.runtime.engine import SlipstreamEngine

logger = logging.getLogger(__name__)

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "LATEST",
    "MANIFEST",
    "CheckpointDiskFullError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "CheckpointShapeError",
    "CorruptCheckpointError",
    "NonFiniteCheckpointError",
    "agree",
    "available_tags",
    "check_optimizer_fits",
    "check_tensor_fits",
    "file_entry",
    "first_non_finite",
    "latest_tag",
    "load",
    "read_manifest",
    "recover_leftovers",
    "save",
    "saved_param_groups",
]


# ---------------------------------------------------------------------------- file helpers
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


def saved_param_groups(saved: Any, current: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The optimizer parameter groups to load: each of ``current`` (this optimizer's, which
    keeps its own ``params``) with the hyper-parameters of ``saved`` (a manifest's
    ``param_groups``, as JSON).

    JSON has no tuples, so a value saved from a tuple comes back a list; where this optimizer
    holds a tuple (Adam's ``betas``: torch's ``param_groups`` contract), it is a tuple again.
    Every layout's load goes through here.
    """
    groups = []
    for old, new in zip(_from_json(saved), current):
        merged = {**new, **old, "params": new["params"]}
        for key, value in new.items():
            if isinstance(value, tuple) and isinstance(merged.get(key), list):
                merged[key] = tuple(merged[key])
        groups.append(merged)
    return groups


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
    state = gradient_path_state(engine)
    by_id = {id(param): name for name, param in engine.module.named_parameters()}
    if state.masters is not None:
        for (name, _), master in zip(engine.named_trainable_parameters, state.masters.masters):
            by_id[id(master)] = name
    names: list[str] = []
    if state.optimizer is None:
        return names
    for group in state.optimizer.param_groups:
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


def first_non_finite(named: Any) -> str | None:
    """The name of the first floating-point tensor of ``(name, tensor)`` pairs holding NaN/inf.

    One host sync per device, not per tensor (a GPU model has hundreds of them).
    """
    names: list[str] = []
    flags: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for name, tensor in named:
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.numel():
            names.append(str(name))
            flags.setdefault(tensor.device, []).append(
                (len(names) - 1, torch.isfinite(tensor).all())
            )
    bad: list[int] = []
    for items in flags.values():
        finite = torch.stack([flag for _, flag in items]).cpu()  # the one sync of this device
        bad += [items[i][0] for i in (~finite).nonzero().flatten().tolist()]
    return names[min(bad)] if bad else None


def _stage0_path_state(engine: SlipstreamEngine) -> tuple[bool, dict[str, Any]]:
    """Whether stage 0 keeps low-precision masters, and its gradient path's ``state_dict()``
    (``masters`` in trainable-parameter order, the torch ``optimizer`` state by index)."""
    state = gradient_path_state(engine)
    return state.masters is not None, state.path.state_dict()


def _stage0_tensors(engine: SlipstreamEngine) -> Any:
    """What a stage-0 checkpoint stores, for the non-finite check."""
    for name, tensor in engine.module.state_dict().items():
        yield f"model tensor {name}", tensor
    has_masters, saved = _stage0_path_state(engine)
    if has_masters:
        for (name, _), master in zip(engine.named_trainable_parameters, saved["masters"]):
            yield f"master weight {name}", master
    if saved["optimizer"]:
        names = _optimizer_param_names(engine)
        for index, per_param in saved["optimizer"]["state"].items():
            for key, value in per_param.items():
                yield f"optimizer state {names[index]}/{key}", value


def save(
    engine: Any,
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
    layout = _layout_of(engine)
    save_dir = Path(save_dir)
    if allow_non_finite is None:
        allow_non_finite = _checkpoint_config(engine, "allow_non_finite", False)
    chosen = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    what = f"saving checkpoint {str(save_dir / chosen)!r}"

    def check() -> None:
        _check_tag(chosen)
        if allow_non_finite:
            return
        bad = first_non_finite(layout.tensors_to_check(engine))
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
        files, info = layout.write_rank_files(engine, staging)
        return {"files": files, "info": info}

    part, error = _attempt(write, saving=True)
    parts = agree(error, what, part)

    def finish() -> None:
        files = [entry for p in parts for entry in p["files"]]
        specific = layout.manifest_fields(engine, [p["info"] for p in parts])
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


class _Stage0Layout:
    """Stage 0's tensors: rank 0 writes the replicated model and optimizer whole."""

    @staticmethod
    def tensors_to_check(engine: Any) -> Any:
        return _stage0_tensors(engine)

    @staticmethod
    def write_rank_files(engine: Any, staging: Path) -> tuple[list[dict[str, Any]], Any]:
        return _write_stage0_rank_files(engine, staging)

    @staticmethod
    def manifest_fields(engine: Any, infos: list[Any]) -> dict[str, Any]:
        return _stage0_manifest_fields(engine, infos)

    @staticmethod
    def validate(engine: Any, path: Path, manifest: dict[str, Any], options: Any) -> Any:
        return _validate_stage0(engine, path, manifest, options)

    @staticmethod
    def apply(engine: Any, path: Path, manifest: dict[str, Any], plan: Any, options: Any) -> None:
        _apply_stage0(engine, path, manifest, plan, options)


def _layout_of(engine: Any, manifest: dict[str, Any] | None = None) -> Any:
    """The tensor layout writing (or reading ``manifest`` into) ``engine``'s checkpoint.

    One manifest writer, ``save``, for all of them: pipelines, tensor/expert-parallel pieces,
    ZeRO shards or stage 0's replicated files. A load picks the layout of the engine, except
    that a partitioned checkpoint is read by the partitioned layout (into any stage 0-2 engine).
    """
    from slipstream.runtime.pipeline_engine import PipelineEngine

    if isinstance(engine, PipelineEngine):
        from slipstream.runtime import pipeline_checkpoint

        return pipeline_checkpoint
    from slipstream.runtime import partitioned_checkpoint

    saved_partitioned = manifest is not None and manifest.get("layout") == "partitioned"
    if partitioned_checkpoint.is_partitioned(engine.module) or saved_partitioned:
        # Stages 0-3 (ZeRO-3 with expert parallelism; tensor parallelism refuses stage 3).
        return partitioned_checkpoint
    if engine.zero is not None:
        from slipstream.runtime import zero_checkpoint

        return zero_checkpoint
    return _Stage0Layout


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
    has_masters, saved = _stage0_path_state(engine)
    state_dict: dict[str, Any] = saved["optimizer"] or {"state": {}, "param_groups": []}
    opt_tensors: dict[str, torch.Tensor] = {}
    opt_scalars: dict[str, dict[str, Any]] = {}
    for index, per_param in state_dict["state"].items():
        name = names[index]
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                opt_tensors[f"state/{name}/{key}"] = value
            else:
                opt_scalars.setdefault(name, {})[key] = value
    if has_masters:
        for (name, _), master in zip(engine.named_trainable_parameters, saved["masters"]):
            opt_tensors[f"master/{name}"] = master
    _save_tensors(staging / "optimizer.safetensors", opt_tensors)
    files.append(file_entry(staging, "optimizer.safetensors", "optimizer", 0))
    info = {
        "tied": aliases,
        "optimizer": {
            "class": type(gradient_path_state(engine).optimizer).__name__,
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
    engine: Any, staging: Path, client_state: dict[str, Any], files: list[Any]
) -> dict[str, Any]:
    """Rank 0: what every layout records alike, the parts' states and the client state.

    Each part of the run (engine_parts: counters and loss scale, schedule, data sampler)
    is written by the checkpoint manager; ``engine`` repeats the counters for people
    reading the manifest.
    """
    parts = CheckpointParts(engine_parts(engine))
    listed, part_files = parts.write(staging)
    client_file = _dump_object(staging, "client_state", client_state)
    files = list(files)
    for name in (*part_files, client_file):
        files.append(file_entry(staging, name, "object", 0))
    counters = parts.parts["engine"]
    assert counters is not None
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "slipstream_version": slipstream.__version__,
        "torch_version": torch.__version__,
        "checksum_algorithm": CHECKSUM_ALGORITHM,
        "world_size": comm.get_world_size(),
        "dp_world_size": getattr(engine, "dp_world_size", 1),
        "dtype": str(getattr(engine, "compute_dtype", None) or torch.float32).removeprefix(
            "torch."
        ),
        "parts": listed,
        "client_state_file": client_file,
        "engine": counters.state_dict(),
        "config": engine.config.raw,
        "files": files,
    }


def _open_checkpoint(engine: SlipstreamEngine, load_dir: str | Path, tag: str | None) -> Any:
    """Every rank: resolve and verify (each rank checks its share of the files' content)."""
    path = _resolve(load_dir, tag)
    share = (comm.get_rank(), comm.get_world_size()) if _distributed() else None
    verify = _checkpoint_config(engine, "verify_checksums", True)
    return path, read_manifest(path, verify_checksums=verify, share=share)


def load(
    engine: Any,
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
    options = {
        "load_module_strict": load_module_strict,
        "load_optimizer_states": load_optimizer_states,
        "load_lr_scheduler_states": load_lr_scheduler_states,
        "load_module_only": load_module_only,
    }

    def prepare() -> tuple[Path, dict[str, Any], Any, Any, _Extras]:
        path, manifest = _open_checkpoint(engine, load_dir, tag)
        layout = _layout_of(engine, manifest)
        plan = layout.validate(engine, path, manifest, options)
        extras = _read_extras(engine, path, manifest, load_lr_scheduler_states, load_module_only)
        return path, manifest, layout, plan, extras

    prepared, error = _attempt(prepare)
    agree(error, what)
    path, manifest, layout, plan, extras = prepared
    layout.apply(engine, path, manifest, plan, options)
    return path, apply_extras(engine, path, manifest, extras)


# ---------------------------------------------------------------------------- validation
class _Extras:
    """What a load reads besides tensors, read before anything is changed."""

    def __init__(self, parts: CheckpointParts) -> None:
        self.parts = parts
        self.states: dict[str, Any] = {}
        self.client_state: dict[str, Any] = {}
        self.rng: Path | None = None
        self.restore_rng = False


def _read_extras(
    engine: Any,
    path: Path,
    manifest: dict[str, Any],
    load_lr_scheduler_states: bool,
    load_module_only: bool,
) -> _Extras:
    """Every rank: the parts' saved states (by the manager), the client state and RNG file."""
    skip = {"lr_scheduler"} if not load_lr_scheduler_states else set()
    if load_module_only:
        skip |= {"engine", "data"}
    extras = _Extras(CheckpointParts(engine_parts(engine)))
    extras.states = extras.parts.read(path, manifest, frozenset(skip))
    scheduler = extras.parts.parts.get("lr_scheduler")
    saved = extras.states.get("lr_scheduler")
    if scheduler is not None and isinstance(saved, dict):
        current = scheduler.state_dict()
        if isinstance(current, dict) and set(saved) != set(current):
            raise CheckpointMismatchError(
                f"the learning-rate schedule in {str(path)!r} has keys {sorted(saved)}, this "
                f"engine's scheduler ({type(scheduler).__name__}) {sorted(current)}: another "
                "scheduler type. Pass load_lr_scheduler_states=False to keep this one."
            )
    if not load_module_only:
        extras.restore_rng = True
        rng = path / f"rng.rank{comm.get_rank()}.safetensors"
        extras.rng = rng if rng.is_file() else None
        if manifest.get("client_state_file"):
            extras.client_state = _load_object(path, manifest["client_state_file"])
    return extras


def apply_extras(
    engine: Any, path: Path, manifest: dict[str, Any], extras: _Extras
) -> dict[str, Any]:
    """Restore the parts (schedule, counters, loss scale, data) and RNG, read and checked."""
    extras.parts.apply(extras.states)
    if extras.restore_rng:
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


_IMPLEMENTATION_KEYS = frozenset(
    {
        "foreach",
        "fused",
        "maximize",
        "capturable",
        "differentiable",
        "decoupled_weight_decay",
        "initial_lr",
        "params",
    }
)


def check_optimizer_class_and_groups(saved: dict[str, Any], optimizer: Any, path: Path) -> None:
    """The saved optimizer state (a manifest's ``optimizer`` entry) is for this optimizer's
    class and number of parameter groups; every checkpoint layout checks this before loading."""
    current_class = type(optimizer).__name__
    if saved.get("class") != current_class:
        raise CheckpointMismatchError(
            f"the optimizer state in {str(path)!r} is {saved.get('class')}'s, this engine's "
            f"optimizer is {current_class}: its state and hyper-parameters would not fit. "
            f"Configure {saved.get('class')} as the checkpoint's run did, or pass "
            "load_optimizer_states=False to load the weights alone."
        )
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointMismatchError(
            f"the checkpoint has {len(saved['param_groups'])} optimizer parameter groups, this "
            f"optimizer {len(optimizer.param_groups)}"
        )


def check_optimizer_fits(
    engine: SlipstreamEngine, saved: dict[str, Any], names: list[str], path: Path
) -> None:
    """Same optimizer class, parameters, group count and hyper-parameter keys."""
    assert engine.optimizer is not None
    check_optimizer_class_and_groups(saved, engine.optimizer, path)
    current_class = type(engine.optimizer).__name__
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
    for index, (old, new) in enumerate(zip(saved_groups, current_groups)):
        # Implementation switches (foreach, fused, ...) come and go between torch versions and
        # are taken from this optimizer where the checkpoint lacks them; a missing
        # hyper-parameter (momentum, betas, ...) would fail at the next step instead.
        lacking = sorted(set(new) - set(old) - _IMPLEMENTATION_KEYS)
        if lacking:
            raise CheckpointMismatchError(
                f"optimizer parameter group {index} in {str(path)!r} lacks the hyper-parameters "
                f"{lacking} of this {current_class}; it was saved by another optimizer setup. "
                "Pass load_optimizer_states=False to load the weights alone."
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
    has_masters = gradient_path_state(engine).masters is not None
    load_optimizer = options["load_optimizer_states"] and engine.optimizer is not None
    optimizer_header: dict[str, tuple[list[int], str]] = {}
    if load_optimizer or has_masters:
        optimizer_header = _header(path / "optimizer.safetensors")
    if has_masters:
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
    # The masters and the optimizer state go back through the gradient path's
    # load_state_dict (stage 0: ReplicatedGradientPath), which then publishes the masters'
    # values into the model.
    state = gradient_path_state(engine)
    optimizer_tensors: dict[str, torch.Tensor] = {}
    if plan["load_optimizer"] or state.masters is not None:
        # On the CPU: Optimizer.load_state_dict moves state to each parameter's device itself,
        # and keeps Adam's `step` counters on the CPU where the non-fused kernels expect them.
        optimizer_tensors = load_file(str(path / "optimizer.safetensors"), device="cpu")
    masters: list[torch.Tensor] | None = None  # None: refreshed from the loaded model
    if state.masters is not None and not options["load_module_only"]:
        current = engine.named_trainable_parameters
        # A parameter whose master the checkpoint lacks (an fp32 run's) keeps the model's.
        masters = [
            optimizer_tensors.get(f"master/{name}", param.detach()) for name, param in current
        ]
    optimizer_state: dict[str, Any] = {}
    if plan["load_optimizer"]:
        optimizer_state = _saved_optimizer_state(engine, manifest["optimizer"], optimizer_tensors)
    state.path.load_state_dict({"masters": masters, "optimizer": optimizer_state})


def _saved_optimizer_state(
    engine: SlipstreamEngine, saved: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """The torch ``state_dict`` of this engine's optimizer that the checkpoint holds."""
    assert engine.optimizer is not None
    names = _optimizer_param_names(engine)
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
    return {
        "state": state,
        "param_groups": saved_param_groups(saved["param_groups"], current_groups),
    }
