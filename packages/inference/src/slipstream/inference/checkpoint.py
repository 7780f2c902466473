"""Load a Hugging Face safetensors checkpoint (one file, or shards with an index) into a model."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

__all__ = ["checkpoint_files", "load_hf_checkpoint"]

logger = logging.getLogger(__name__)
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Old Llama checkpoints carry these buffers; models rebuild them from their config.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: a directory, an index JSON or one ``.safetensors``."""
    path = Path(path)
    if path.is_dir():
        if (path / INDEX).exists():
            path = path / INDEX
        elif (path / SINGLE).exists():
            return [path / SINGLE]
        else:
            raise FileNotFoundError(
                f"checkpoint = {str(path)!r}: no {INDEX} or {SINGLE} in that directory (only "
                "Hugging Face safetensors checkpoints are read; .bin files are not)"
            )
    if path.suffix == ".json":
        weight_map: dict[str, str] = json.loads(path.read_text())["weight_map"]
        return [path.parent / name for name in sorted(set(weight_map.values()))]
    if path.suffix == ".safetensors" and path.exists():
        return [path]
    raise FileNotFoundError(
        f"checkpoint = {str(path)!r} is not a directory, a {INDEX} or a .safetensors file"
    )


def _rebuild_meta_rotary(model: nn.Module) -> None:
    """Rotary modules built on the meta device recompute their frequencies from the config."""
    for name, module in list(model.named_modules()):
        inv_freq = getattr(module, "inv_freq", None)
        if isinstance(inv_freq, torch.Tensor) and inv_freq.is_meta:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            config: Any = getattr(module, "config", None) or model.config  # type: ignore[union-attr]
            with torch.device("cpu"):
                setattr(parent, child, type(module)(config=config))


@torch.no_grad()
def load_hf_checkpoint(model: nn.Module, path: str | Path) -> None:
    """Copy every tensor of the checkpoint at ``path`` into ``model`` (matched by name).

    Tensors are read one at a time from memory-mapped files, so the host never holds the whole
    checkpoint twice. A model built on the meta device gets new tensors (``assign``); otherwise
    values are copied into the existing ones (keeping tied weights tied).

    Raises:
        KeyError: naming checkpoint tensors the model lacks, or model weights the checkpoint lacks.
    """
    state = dict(model.state_dict(keep_vars=True))
    seen: set[str] = set()
    unexpected: list[str] = []
    files = checkpoint_files(path)
    for number, file in enumerate(files, 1):
        logger.info("loading checkpoint shard %d/%d: %s", number, len(files), file.name)
        with safe_open(str(file), framework="pt", device="cpu") as shard:
            for key in shard.keys():
                if key.endswith(_IGNORED_SUFFIXES):
                    continue
                target = state.get(key)
                if target is None:
                    unexpected.append(key)
                    continue
                value = shard.get_tensor(key)
                if tuple(value.shape) != tuple(target.shape):
                    raise ValueError(
                        f"checkpoint tensor {key!r} has shape {tuple(value.shape)} but the model "
                        f"expects {tuple(target.shape)}: the checkpoint is for another config"
                    )
                if target.is_meta:
                    owner, _, leaf = key.rpartition(".")
                    module = model.get_submodule(owner) if owner else model
                    tensor = value.to(target.dtype)
                    if isinstance(target, nn.Parameter):
                        setattr(module, leaf, nn.Parameter(tensor, requires_grad=False))
                    else:
                        setattr(module, leaf, tensor)
                else:
                    target.copy_(value)
                seen.add(key)
    if unexpected:
        raise KeyError(
            f"checkpoint {str(path)!r} holds tensors this model does not have: "
            f"{', '.join(unexpected[:8])}{' ...' if len(unexpected) > 8 else ''}"
        )
    if hasattr(model, "tie_weights"):
        # A tied head absent from the checkpoint follows the embedding.
        model.tie_weights()  # type: ignore[operator]
    _rebuild_meta_rotary(model)
    loaded = {tensor.data_ptr() for name, tensor in model.state_dict().items() if name in seen}
    missing = [
        name
        for name, tensor in model.state_dict().items()
        if tensor.is_meta or (name not in seen and tensor.data_ptr() not in loaded)
    ]
    if missing:
        raise KeyError(
            f"checkpoint {str(path)!r} lacks weights of this model: {', '.join(missing[:8])}"
            f"{' ...' if len(missing) > 8 else ''}"
        )
