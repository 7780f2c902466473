"""Load slipstream-compression's packed export (int8/int4/ternary/binary codes) for serving.

The format is the contract between the two packages (this one does not import
``slipstream.compression``): see the note "the compressed checkpoint format" in
``slipstream/compression/export.py`` and docs/compression.md. Every packed weight is
unpacked to its exact values, then ``init_inference`` quantizes the fused blocks with the
export's bits and group size, which reproduces the export's codes: each group's largest
value is ``+-qmax * scale``, so the absmax scale of the kernels is the export's scale.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from slipstream.inference.checkpoint import checkpoint_files, load_hf_checkpoint

__all__ = ["FORMAT_NAME", "is_compressed_checkpoint", "load_checkpoint", "load_compressed"]

logger = logging.getLogger(__name__)

FORMAT_NAME = "slipstream-compressed"
_VERSIONS = ("1",)
# Bits the inference kernels serve each packed format with (ternary/binary via int4).
_SERVED_BITS = {"int8": 8, "int4": 4, "ternary": 4, "binary": 4}


def _metadata(path: str | Path) -> dict[str, str]:
    files = checkpoint_files(path)
    with safe_open(str(files[0]), framework="pt", device="cpu") as handle:
        return handle.metadata() or {}


def is_compressed_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` holds slipstream-compression's packed export."""
    return _metadata(path).get("format") == FORMAT_NAME


def _unpack(codes: torch.Tensor, scales: torch.Tensor, entry: dict[str, Any]) -> torch.Tensor:
    """The fp32 values of a packed weight (the format note's layouts)."""
    fmt, group_size = entry["format"], int(entry["group_size"])
    shape = torch.Size(entry["shape"])
    if fmt == "int4":
        packed = codes.to(torch.int16)
        low = ((packed & 0xF) ^ 8) - 8
        high = (((packed >> 4) & 0xF) ^ 8) - 8
        values = torch.stack((low, high), dim=-1).reshape(codes.shape[0], -1)
    elif fmt in ("ternary", "binary"):
        width = 2 if fmt == "ternary" else 1
        lanes = [(codes >> (width * j)) & ((1 << width) - 1) for j in range(8 // width)]
        raw = torch.stack(lanes, dim=-1).reshape(codes.shape[0], -1).to(torch.int16)
        values = ((raw ^ 2) - 2) if fmt == "ternary" else raw * 2 - 1
    elif fmt.startswith("int"):
        values = codes.to(torch.int16)
    else:
        raise ValueError(f"compressed checkpoint: unknown packed format {fmt!r}")
    out = values[:, :group_size].float() * scales[:, None].float()
    return out.reshape(-1)[: shape.numel()].reshape(shape)


@torch.no_grad()
def load_compressed(model: nn.Module, path: str | Path) -> dict[str, Any]:
    """Copy the export at ``path`` into ``model`` (unpacked); returns its quantization.

    The model must have the export's shapes (build it from the export's ``config.json``:
    pruned sizes are there). Returns ``{"bits": ..., "group_size": ..., "head_bits": ...}`` for
    serving, with None where the export has no packed weight (``head_bits``: the LM head's
    width where it differs from the blocks', else None), or raises ValueError when its packed
    weights other than the head do not share one serving bit width, or not one group size.
    """
    metadata = _metadata(path)
    if metadata.get("version") not in _VERSIONS:
        raise ValueError(
            f"checkpoint {str(path)!r} is {FORMAT_NAME} version {metadata.get('version')!r}; "
            f"this release reads versions {', '.join(_VERSIONS)}"
        )
    header: dict[str, dict[str, Any]] = json.loads(metadata.get("quantized", "{}"))
    state = dict(model.state_dict(keep_vars=True))
    loaded: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            names = set(handle.keys())
            for name in names:
                if name.endswith((".codes", ".scales")) and name.rsplit(".", 1)[0] in header:
                    continue
                if name not in state:
                    unexpected.append(name)
                    continue
                loaded[name] = handle.get_tensor(name)
            for name, entry in header.items():
                if f"{name}.codes" in names:
                    loaded[name] = _unpack(
                        handle.get_tensor(f"{name}.codes"),
                        handle.get_tensor(f"{name}.scales"),
                        entry,
                    )
    if unexpected:
        raise KeyError(
            f"compressed checkpoint {str(path)!r} holds tensors this model does not have: "
            f"{', '.join(sorted(unexpected)[:8])} (build the model from the export's config.json)"
        )
    for name, value in loaded.items():
        target = state[name]
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(
                f"compressed checkpoint tensor {name!r} has shape {tuple(value.shape)} but the "
                f"model expects {tuple(target.shape)}: build the model from the export's "
                "config.json (pruning changed its sizes)"
            )
        target.copy_(value)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # type: ignore[operator]
    done = {state[name].data_ptr() for name in loaded}
    missing = [n for n, t in model.state_dict().items() if t.data_ptr() not in done]
    if missing:
        raise KeyError(
            f"compressed checkpoint {str(path)!r} lacks weights of this model: "
            f"{', '.join(missing[:8])}"
        )
    # The LM head may have its own width (quant.weight.lm_head_bits); every other packed
    # weight shares one, and all one group size.
    head_key = _head_key(model)
    head = header.get(head_key) if head_key is not None else None
    bits = {_SERVED_BITS.get(e["format"]) for name, e in header.items() if name != head_key}
    head_bits = None if head is None else _SERVED_BITS.get(head["format"])
    sizes = {int(entry["group_size"]) for entry in header.values()}
    if None in bits or len(bits) > 1 or len(sizes) > 1 or (head and head_bits is None):
        raise ValueError(
            f"compressed checkpoint {str(path)!r} mixes packed formats/group sizes "
            f"{sorted({(e['format'], e['group_size']) for e in header.values()})}; the "
            "inference kernels serve one bit width (int8, or int4 for int4/ternary/binary) "
            "for the blocks, the LM head's own (int8 or int4), and one group size per model"
        )
    body_bits = next(iter(bits), None)
    if body_bits is None or head_bits == body_bits:
        # a head alone, or at the blocks' width: served dense with its exact values
        head_bits = None
    return {"bits": body_bits, "group_size": next(iter(sizes), None), "head_bits": head_bits}


def _head_key(model: nn.Module) -> str | None:
    """The state-dict name of ``model``'s output embedding weight (None: none found)."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if head is None:
        return None
    for name, module in model.named_modules():
        if module is head:
            return f"{name}.weight" if name else "weight"
    return None


def load_checkpoint(model: nn.Module, config: Any) -> None:
    """Load ``config.checkpoint_path``: Hugging Face safetensors, or the compressed export.

    For a compressed export, ``config`` is set to serve the export's weights quantized:
    ``dtype`` int8 with ``quant.weight.num_bits``/``group_size`` from the export, its fp32
    scales (``quant.weight.scale_dtype`` fp32: the export's exact values) and the compute dtype
    of the configured ``dtype``; an LM head packed at another width than the blocks is served
    quantized at its own (``quant.weight.lm_head`` true, ``lm_head_bits`` the export's). A
    config that asks for other bits raises.
    """
    path = config.checkpoint_path
    if not is_compressed_checkpoint(path):
        load_hf_checkpoint(model, path)
        return
    served = load_compressed(model, path)
    bits, group_size = served["bits"], served["group_size"]
    if bits is None:
        return  # pruned or layer-reduced only: served in the configured dtype
    weight = config.quant.weight
    if config.weight_bits is not None and config.weight_bits != bits:
        raise ValueError(
            f"init_inference: quant.weight.num_bits = {config.weight_bits} but the compressed "
            f"checkpoint {str(path)!r} holds {bits}-bit weights; drop the quant block (the "
            "export's bits are used) or export with other bits"
        )
    if config.weight_bits is None:
        weight.compute_dtype = config.dtype if config.dtype in ("fp16", "bf16", "fp32") else "fp16"
        config.dtype = "int8"
        config.quant.enabled = weight.enabled = True
    weight.num_bits = bits
    weight.group_size = group_size
    head_bits = served["head_bits"]
    if head_bits is not None:
        # the export's head at its own width: served quantized at it (exact, as the blocks)
        if weight.lm_head_bits not in (None, head_bits) or weight.format != "int":
            raise ValueError(
                f"init_inference: the compressed checkpoint {str(path)!r} holds a {head_bits}-bit "
                f"LM head behind {bits}-bit blocks, but quant.weight asks for "
                f"lm_head_bits = {weight.lm_head_bits}, format = {weight.format!r}; drop "
                "those keys (the export's widths are used)"
            )
        weight.lm_head, weight.lm_head_bits = True, head_bits
    # the export's scales are fp32: re-quantizing with them reproduces its codes exactly, a
    # 16-bit scale would move the trained values by up to a scale rounding
    weight.scale_dtype = "fp32"
    logger.info(
        "serving the compressed checkpoint %s with %d-bit weights%s in groups of %d (fp32 "
        "scales, the export's)",
        path,
        bits,
        "" if head_bits is None else f" and a {head_bits}-bit LM head",
        group_size,
    )
