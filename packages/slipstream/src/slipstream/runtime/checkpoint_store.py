"""Checkpoint directories on disk: the manifest's verifier, the crash-safe tag switch, recovery.

Shared by both layouts (stage 0's replicated files, ZeRO's per-rank shards; see checkpoint.py
and zero_checkpoint.py): the named errors, the agreement of every rank on a phase's outcome
([Note: checkpoint agreement]), each file's manifest record with its checksum, reading and
verifying a manifest, and writing a tag so that it appears complete or not at all
([Note: crash-safe tag switch]). Nothing here knows an engine.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from slipstream import comm
from slipstream.offload.checksum import ChecksumUnavailableError, file_checksum

logger = logging.getLogger("slipstream.runtime.checkpoint")

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


def _header(path: Path) -> dict[str, tuple[list[int], str]]:
    """Each tensor's (shape, dtype name) in a safetensors file, without reading the data."""
    out = {}
    with safe_open(str(path), framework="pt") as handle:
        for key in handle.keys():
            piece = handle.get_slice(key)
            out[key] = (list(piece.get_shape()), str(piece.get_dtype()))
    return out
