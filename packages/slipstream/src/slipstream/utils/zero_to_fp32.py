"""DeepSpeed's ``deepspeed.utils.zero_to_fp32``: fp32 weights out of a (ZeRO) checkpoint.

>>> from slipstream.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from slipstream.runtime.zero_checkpoint import get_fp32_state_dict_from_zero_checkpoint

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
]


def load_state_dict_from_zero_checkpoint(
    model: torch.nn.Module, checkpoint_dir: str | Path, tag: str | None = None
) -> torch.nn.Module:
    """Load the checkpoint's fp32 weights into ``model`` (on the CPU, strict) and return it.

    As in DeepSpeed, ``model`` is a plain module (not the engine), and it is moved to the CPU.
    """
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=tag)
    model = model.cpu()
    model.load_state_dict(state_dict, strict=True)
    return model


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | Path, output_file: str | Path, tag: str | None = None, **kwargs: Any
) -> None:
    """Write the checkpoint's consolidated fp32 weights to ``output_file`` (torch.save format;
    ``.safetensors`` names are written as safetensors). DeepSpeed's sharding options
    (``max_shard_size``, ``safe_serialization``) are not taken: use ``slipstream convert``."""
    if kwargs:
        raise TypeError(
            f"convert_zero_checkpoint_to_fp32_state_dict does not take {sorted(kwargs)}; for "
            "sharded or Hugging Face-style output use `slipstream convert`"
        )
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=tag)
    output = Path(output_file)
    output.parent.mkdir(parents=True, exist_ok=True)
    if output.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state_dict.items()}, str(output))
    else:
        torch.save(state_dict, output)
