"""``slipstream.init_inference``: the inference package's, also loading Slipstream training checkpoints."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from slipstream.inference import InferenceConfig, InferenceEngine, load_inference_config

__all__ = ["init_inference", "training_checkpoint"]


def training_checkpoint(path: str | os.PathLike[str]) -> tuple[Path, str | None] | None:
    """``(root, tag)`` when ``path`` is a Slipstream training checkpoint, else None.

    Either the directory given to ``save_checkpoint`` (holding ``latest``: its newest tag is
    read) or one tag's directory inside it (holding ``manifest.json``).
    """
    from slipstream.runtime.checkpoint_store import LATEST, MANIFEST

    directory = Path(path)
    if (directory / MANIFEST).is_file():
        return directory.parent, directory.name
    if (directory / LATEST).is_file():
        return directory, None
    return None


def init_inference(
    model: nn.Module,
    config: str | os.PathLike[str] | Mapping[str, Any] | InferenceConfig | None = None,
    **kwargs: Any,
) -> InferenceEngine:
    """:func:`slipstream.inference.init_inference`, plus ``checkpoint`` = a training checkpoint.

    When ``checkpoint`` (or ``checkpoint_config.checkpoint_dir``) names a checkpoint written by
    ``SlipstreamEngine.save_checkpoint`` (any ZeRO stage, any world size), its fp32 weights are
    consolidated (:func:`slipstream.get_fp32_state_dict_from_zero_checkpoint`) and loaded into
    ``model`` (strictly: every name must match), then the model is served as usual; any other
    ``checkpoint`` is a Hugging Face one, loaded by the inference package.

    >>> engine = slipstream.init_inference(model, dtype=torch.bfloat16,
    ...                                    checkpoint="checkpoints/")  # doctest: +SKIP
    """
    parsed = load_inference_config(config, **kwargs)
    path = parsed.checkpoint_path
    found = training_checkpoint(path) if path else None
    if found is not None:
        from slipstream.runtime.zero_checkpoint import get_fp32_state_dict_from_zero_checkpoint

        root, tag = found
        state = get_fp32_state_dict_from_zero_checkpoint(root, tag)
        buffers = {name for name, _ in model.named_buffers()}
        # The checkpoint holds every buffer, non-persistent ones (rotary tables) too.
        missing, unexpected = model.load_state_dict(state, strict=False)
        unexpected = [name for name in unexpected if name not in buffers]
        if missing or unexpected:
            raise ValueError(
                f"init_inference: the training checkpoint {path} does not match the model: "
                f"missing {sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}; pass the "
                "model class the checkpoint was trained with"
            )
        parsed = dataclasses.replace(
            parsed,
            checkpoint=None,
            checkpoint_config=dataclasses.replace(parsed.checkpoint_config, checkpoint_dir=None),
        )
    return InferenceEngine(model, parsed)
