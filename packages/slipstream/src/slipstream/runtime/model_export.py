"""Consolidated weights out of an engine or a checkpoint: save_16bit_model and `slipstream convert`."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from slipstream import comm
from slipstream.runtime import checkpoint as ckpt
from slipstream.runtime import checkpoint_store
from slipstream.runtime.zero_checkpoint import ShardReader

if TYPE_CHECKING:
    from slipstream.runtime.engine import SlipstreamEngine

logger = logging.getLogger(__name__)

__all__ = ["convert_to_hf_safetensors", "parse_size", "save_16bit_model"]


def save_16bit_model(engine: SlipstreamEngine, save_dir: str | Path, save_filename: str) -> bool:
    """Write the module's weights (its dtype) to ``save_dir/save_filename`` on rank 0.

    Collective at stage 3, where each parameter is gathered in turn (one at a time, so no
    rank but 0 ever holds more than one full parameter); DeepSpeed's rule applies: at
    stage 3 this needs ``stage3_gather_16bit_weights_on_model_save``, else it logs a warning
    and returns False. Tied weights are stored once.
    """
    from slipstream.zero import GatheredParameters

    stage3 = engine.zero_stage == 3
    if stage3 and not engine.config.zero_optimization.stage3_gather_16bit_weights_on_model_save:
        logger.warning(
            "save_16bit_model at ZeRO stage 3 needs zero_optimization."
            "stage3_gather_16bit_weights_on_model_save = true (gathering every parameter is "
            "costly); nothing was saved. Use get_fp32_state_dict_from_zero_checkpoint on a "
            "checkpoint instead, or enable the flag."
        )
        return False
    rank0 = comm.get_rank() == 0
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, param in engine.module.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        with GatheredParameters([param], enabled=stage3):
            if rank0:
                tensors[name] = param.detach().to("cpu", copy=True)
    if rank0:
        for name, buffer in engine.module.named_buffers():
            tensors[name] = buffer.detach().cpu()
        directory = Path(save_dir)
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{save_filename}.tmp"
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        ckpt._fsync_file(tmp)
        tmp.replace(directory / save_filename)
        ckpt._fsync_dir(directory)
    checkpoint_store._barrier()
    return True


_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def parse_size(text: str) -> int:
    """``"5GB"``, ``"500MiB"``, ``"1000000"`` -> bytes."""
    value = text.strip().upper()
    number = value.rstrip("KMGIB")
    unit = value[len(number) :]
    try:
        amount = float(number)
    except ValueError:
        amount = -1.0
    if unit not in _UNITS or amount <= 0:
        raise ValueError(f"size {text!r} is not understood; write e.g. 5GB, 500MB or 2GiB")
    return int(amount * _UNITS[unit])


_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def convert_to_hf_safetensors(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    tag: str | None = None,
    max_shard_bytes: int = 5 * 10**9,
    dtype: str = "fp32",
    progress: bool = True,
    verify_checksums: bool = True,
) -> list[Path]:
    """Consolidate a (ZeRO or stage-0) checkpoint into Hugging Face-style safetensors.

    Streams tensor by tensor: each full tensor is assembled from the shards of the ranks
    that hold it (fp32 masters where present), cast to ``dtype`` and added to the current
    output file, which is written and dropped once the next tensor would push it past
    ``max_shard_bytes``; memory peaks at one output file, never the checkpoint twice. One
    file is ``model.safetensors``; several are ``model-0000i-of-0000n.safetensors`` with a
    ``model.safetensors.index.json`` weight map. Tied parameters are stored once, under
    their first name (the index's ``metadata.tied`` lists the aliases).

    Every checkpoint file is verified against the checksum its manifest records before the
    first output file is written (``verify_checksums=False`` skips that pass).

    Raises:
        CheckpointNotFoundError, CorruptCheckpointError: a missing or damaged checkpoint.
        ValueError: an unknown ``dtype``.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    target = _DTYPES[dtype]
    path = ckpt._resolve(checkpoint_dir, tag)
    manifest = ckpt.read_manifest(path, verify_checksums=False)
    if verify_checksums:
        to_read = sum(int(entry["bytes"]) for entry in manifest.get("files", []))
        verified = [0]

        def advance(count: int) -> None:
            verified[0] += count
            if progress:
                sys.stderr.write(f"\rverifying {verified[0] / 1e6:,.0f} / {to_read / 1e6:,.0f} MB")
                sys.stderr.flush()

        ckpt.read_manifest(path, verify_checksums=True, progress=advance)
        if progress:
            sys.stderr.write("\n")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = list(manifest["parameters"])
    with ShardReader(path, manifest) as reader:
        buffers = dict(reader.buffers())
        sizes: list[tuple[str, int]] = []
        for name in names:
            numel = reader.numel(name)
            sizes.append((name, numel * torch.tensor([], dtype=target).element_size()))
        sizes += [(name, b.numel() * b.element_size()) for name, b in buffers.items()]
        plan: list[list[str]] = [[]]
        used = 0
        for name, nbytes in sizes:
            if plan[-1] and used + nbytes > max_shard_bytes:
                plan.append([])
                used = 0
            plan[-1].append(name)
            used += nbytes
        count = len(plan)
        files = (
            ["model.safetensors"]
            if count == 1
            else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        )
        weight_map: dict[str, str] = {}
        done, total = 0, len(sizes)
        for file, members in zip(files, plan):
            tensors: dict[str, torch.Tensor] = {}
            for name in members:
                if name in buffers:
                    tensors[name] = buffers[name]
                else:
                    kind = "master" if reader.has("master", name) else "model"
                    tensor = reader.read_full(kind, name)
                    tensors[name] = tensor.to(target) if tensor.is_floating_point() else tensor
                weight_map[name] = file
                done += 1
                if progress:
                    _progress(done, total, name)
            save_file(tensors, str(out / file), metadata={"format": "pt"})
            del tensors
    if progress:
        sys.stderr.write("\n")
    written = [out / f for f in files]
    if count > 1:
        index = {
            "metadata": {
                "total_size": sum(nbytes for _, nbytes in sizes),
                "tied": manifest.get("tied", {}),
            },
            "weight_map": weight_map,
        }
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        written.append(out / "model.safetensors.index.json")
    return written


def _progress(done: int, total: int, name: str) -> None:
    width = 30
    filled = int(width * done / max(total, 1))
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {name[:40]:<40}")
    sys.stderr.flush()
