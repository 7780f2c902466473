"""Knowledge distillation for compression: logit KD (XTC) and layer-by-layer KD (ZeroQuant's LKD)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["distill", "distillation_loss", "layerwise_distillation", "logits_of"]

logger = logging.getLogger(__name__)

Batch = Any  # a tensor of token ids or a dict of model inputs


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a model output (a Hugging Face output's ``.logits``, or the tensor)."""
    logits = getattr(output, "logits", output)
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    assert isinstance(logits, torch.Tensor)
    return logits


def _call(model: nn.Module, batch: Batch) -> Any:
    if isinstance(batch, dict):
        return model(**batch)
    return model(batch)


def distillation_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """KL(teacher || student) of the softened distributions, times ``temperature**2``."""
    t = temperature
    student = F.log_softmax(student_logits.float() / t, dim=-1).flatten(0, -2)
    teacher = F.log_softmax(teacher_logits.float() / t, dim=-1).flatten(0, -2)
    return F.kl_div(student, teacher, log_target=True, reduction="batchmean") * t * t


def distill(
    student: nn.Module,
    teacher: nn.Module,
    batches: Sequence[Batch],
    steps: int,
    lr: float = 1e-4,
    temperature: float = 1.0,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Train ``student`` to match ``teacher``'s logits on ``batches`` (cycled) for ``steps``.

    ``on_step(step, loss)`` runs after each optimizer step (give it the compression
    scheduler's ``step`` to quantize or prune during distillation). Returns the losses.
    """
    teacher.eval()
    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    losses: list[float] = []
    student.train()
    for step in range(steps):
        batch = batches[step % len(batches)]
        with torch.no_grad():
            target = logits_of(_call(teacher, batch))
        loss = distillation_loss(logits_of(_call(student, batch)), target, temperature)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())  # one host sync per step: offline work, not a hot loop
        if on_step is not None:
            on_step(step, losses[-1])
        if (step + 1) % max(1, steps // 10) == 0 or step + 1 == steps:
            logger.info("distillation step %d/%d: loss %.5f", step + 1, steps, losses[-1])
    student.eval()
    return losses


class _Captured(Exception):
    """Raised by the capture hook to stop the teacher's forward after the layer of interest."""


def _capture_layer_io(
    teacher: nn.Module, layer: nn.Module, batch: Batch
) -> tuple[tuple[Any, ...], dict[str, Any], torch.Tensor]:
    """The inputs (args, kwargs) and the output hidden states of ``layer`` on ``batch``."""
    captured: dict[str, Any] = {}

    def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        captured["args"], captured["kwargs"] = args, kwargs
        captured["output"] = output[0] if isinstance(output, (tuple, list)) else output
        raise _Captured

    handle = layer.register_forward_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            _call(teacher, batch)
    except _Captured:
        pass
    finally:
        handle.remove()
    if "output" not in captured:
        raise RuntimeError("layerwise_distillation: the teacher's forward never reached the layer")
    kwargs = dict(captured["kwargs"])
    # A KV cache would grow (and keep autograd graphs) across the steps that reuse these inputs.
    for key in ("cache", "past_key_value", "past_key_values", "layer_past"):
        if key in kwargs:
            kwargs[key] = None
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    return captured["args"], kwargs, captured["output"]


def layerwise_distillation(
    student: nn.Module,
    teacher: nn.Module,
    layers: str,
    calibration: Iterable[Batch],
    steps_per_layer: int = 50,
    lr: float = 1e-4,
) -> list[tuple[float, float]]:
    """ZeroQuant's LKD: fit each quantized layer to its full-precision twin, one at a time.

    Layer ``k`` of ``student`` (the ModuleList at ``layers``, e.g. ``model.layers``) gets
    the teacher layer ``k``'s inputs on the calibration batches, and is trained to give the
    teacher layer's outputs (mean squared error) with its quantizers in the loop (STE). Only
    that layer's parameters change; no labels and no original training data are needed.
    Returns each layer's (first, last) loss.
    """
    batches = list(calibration)
    if not batches:
        raise ValueError("layerwise_distillation: the calibration set is empty")
    student_layers = student.get_submodule(layers)
    teacher_layers = teacher.get_submodule(layers)
    assert isinstance(student_layers, nn.ModuleList) and isinstance(teacher_layers, nn.ModuleList)
    teacher.eval()
    history: list[tuple[float, float]] = []
    for index, (layer, twin) in enumerate(zip(student_layers, teacher_layers)):
        cached = [_capture_layer_io(teacher, twin, batch) for batch in batches]
        optimizer = torch.optim.AdamW(layer.parameters(), lr=lr, weight_decay=0.0)
        first = last = 0.0
        for step in range(steps_per_layer):
            args, kwargs, target = cached[step % len(cached)]
            output = layer(*args, **kwargs)
            output = output[0] if isinstance(output, (tuple, list)) else output
            loss = F.mse_loss(output.float(), target.float())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            last = loss.item()
            first = last if step == 0 else first
        history.append((first, last))
        logger.info(
            "LKD layer %d/%d: mse %.3g -> %.3g", index + 1, len(student_layers), first, last
        )
    return history
