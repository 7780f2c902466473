"""StreamedAdam: an Adam step over host-resident tensors, computed on the GPU chunk by chunk.

CPU optimizer offload steps the fp32 masters and Adam states where they live, in host memory,
with the C++ CPU Adam, and that step is bound by the host's memory bandwidth as the CPU cores
can draw it. This class takes a share of those elements off the cores: each chunk of master,
``exp_avg``, ``exp_avg_sq`` and gradient is copied to the device (one CUDA stream), stepped
there with torch's fused Adam/AdamW (another), and copied back into the same host tensors or
into the out-of-place outputs (a third), a few chunks in flight, so the transfers of one chunk
overlap the step of the next. The copy engines move those bytes, not the cores: the CPU steps
the rest of the elements at the same time (``offload_optimizer.gpu_share``, docs/offload.md).

The update is the Adam/AdamW of :func:`slipstream.kernels.ops.cpu_optim.adam` (the gradient
widened to fp32 and multiplied by ``grad_scale`` as it is read, then torch's fused step), equal
to torch's AdamW up to fp32 rounding: the C++ kernel and torch's fused kernel order their
operations differently. Without a GPU (``device`` is the CPU) the same code runs with plain
copies, which is how it is tested on CPU machines.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["StreamedAdam"]

CHUNK_NUMEL = 1 << 22  # elements per chunk: 16 MiB per fp32 tensor
SLOTS = 3  # chunks in flight (device buffers: 3 x (4 fp32 + 1 gradient) x CHUNK_NUMEL)


@dataclass(frozen=True, slots=True)
class AdamHyper:
    """What one Adam/AdamW call applies (as :func:`cpu_optim.adam` takes it)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adam_w_mode: bool
    step: int
    grad_scale: float


class StreamedAdam:
    """Adam/AdamW over host tensors, stepped on ``device`` in chunks (see the module docstring).

    Args:
        device: where the chunks step (a CUDA device; the CPU for tests).
        chunk_numel: elements per chunk.
        slots: chunks in flight.
    """

    def __init__(
        self, device: torch.device, chunk_numel: int = CHUNK_NUMEL, slots: int = SLOTS
    ) -> None:
        self.device = device
        self.chunk_numel = chunk_numel
        self.cuda = device.type == "cuda"
        self._streams: list[Any] = []
        self._slots: list[dict[Any, torch.Tensor]] = [{} for _ in range(slots)]
        self._free: list[Any] = [None] * slots  # event: the slot's last copy back is done
        self._next = 0
        self._step: torch.Tensor | None = None

    def _buffer(self, slot: int, name: Any, dtype: torch.dtype) -> torch.Tensor:
        key = (name, dtype)
        buffers = self._slots[slot]
        if key not in buffers:
            # Allocated on this class's own stream: an allocation on the caller's stream (the
            # training's compute stream, from the worker thread) may get memory that kernels
            # still queued there use, and these buffers are written on other streams at once.
            with self._own_stream(0):
                buffers[key] = torch.empty(self.chunk_numel, dtype=dtype, device=self.device)
        return buffers[key]

    def _own_stream(self, which: int) -> Any:
        """A context making stream ``which`` (0 copies in, 1 steps, 2 copies back) current."""
        return torch.cuda.stream(self._streams[which]) if self._streams else nullcontext()

    @torch.no_grad()
    def enqueue(
        self,
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        exp_avgs: Sequence[torch.Tensor],
        exp_avg_sqs: Sequence[torch.Tensor],
        hyper: AdamHyper,
        out: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor], Sequence[torch.Tensor]]
        | None = None,
        keep_dtype: torch.dtype | None = None,
    ) -> list[torch.Tensor]:
        """Queue the step of every (1-D, contiguous, host) tensor of the lists; with ``out``,
        the new values go there and the inputs stay as they were. A gradient may also be on
        ``device`` already (it is then read there, not from host memory). With ``keep_dtype``,
        returns for each tensor its new values cast to that dtype on ``device``, where they
        were computed (a publish then uploads nothing for those elements; allocated on this
        class's step stream: a consumer on another stream must ``record_stream`` them); else
        an empty list. On a GPU this returns as soon as the work is queued: :meth:`wait`
        before reading the results or touching the inputs."""
        if self.cuda:
            with torch.cuda.device(self.device):
                return self._enqueue(params, grads, exp_avgs, exp_avg_sqs, hyper, out, keep_dtype)
        return self._enqueue(params, grads, exp_avgs, exp_avg_sqs, hyper, out, keep_dtype)

    def _enqueue(
        self,
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        exp_avgs: Sequence[torch.Tensor],
        exp_avg_sqs: Sequence[torch.Tensor],
        hyper: AdamHyper,
        out: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor], Sequence[torch.Tensor]] | None,
        keep_dtype: torch.dtype | None = None,
    ) -> list[torch.Tensor]:
        if self.cuda and not self._streams:
            self._streams = [torch.cuda.Stream(self.device) for _ in range(3)]
        if self._step is None:
            # Written only on the step's stream (fill_ below), and allocated there.
            with self._own_stream(1):
                self._step = torch.empty((), dtype=torch.float32, device=self.device)
        kept_all: list[torch.Tensor] = []
        outs = out if out is not None else (params, exp_avgs, exp_avg_sqs)
        fused = torch._fused_adamw_ if hyper.adam_w_mode else torch._fused_adam_
        for index, param in enumerate(params):
            sources = (param, exp_avgs[index], exp_avg_sqs[index])
            targets = (outs[0][index], outs[1][index], outs[2][index])
            grad = grads[index]
            kept = None
            if keep_dtype is not None:
                with self._own_stream(1):  # written there; see _buffer
                    kept = torch.empty(param.numel(), dtype=keep_dtype, device=self.device)
                kept_all.append(kept)
            for start in range(0, param.numel(), self.chunk_numel):
                n = min(self.chunk_numel, param.numel() - start)
                slot = self._next
                self._next = (self._next + 1) % len(self._slots)
                p, m, v, g = (self._buffer(slot, k, torch.float32)[:n] for k in "pmvg")
                # A gradient already on the device is read where it is (it is complete:
                # the caller waited for it on the host); a host one is copied in first.
                on_device = grad.device.type == self.device.type and (
                    self.device.index is None or grad.device.index == self.device.index
                )
                landed = (
                    grad[start : start + n]
                    if on_device
                    else self._buffer(slot, "landed", grad.dtype)[:n]
                )
                h2d, calc, d2h = self._streams or (None, None, None)
                with torch.cuda.stream(h2d) if h2d is not None else nullcontext():
                    if h2d is not None and self._free[slot] is not None:
                        h2d.wait_event(self._free[slot])
                    for dst, src in zip((p, m, v), sources):
                        dst.copy_(src[start : start + n], non_blocking=True)
                    if not on_device:
                        landed.copy_(grad[start : start + n], non_blocking=True)
                    loaded = _record(h2d)
                with torch.cuda.stream(calc) if calc is not None else nullcontext():
                    if calc is not None:
                        calc.wait_event(loaded)
                    g.copy_(landed)  # widened exactly (bf16/fp16 -> fp32)
                    if hyper.grad_scale != 1.0:
                        g.mul_(hyper.grad_scale)  # one rounding, as the C++ step's load
                    self._step.fill_(hyper.step)  # the step being taken (torch counts it up before)
                    fused(
                        [p], [g], [m], [v], [], [self._step], lr=hyper.lr, beta1=hyper.beta1,
                        beta2=hyper.beta2, weight_decay=hyper.weight_decay, eps=hyper.eps,
                        amsgrad=False, maximize=False,
                    )  # fmt: skip
                    if kept is not None:
                        kept[start : start + n].copy_(p)  # cast as a publish would
                    stepped = _record(calc)
                with torch.cuda.stream(d2h) if d2h is not None else nullcontext():
                    if d2h is not None:
                        d2h.wait_event(stepped)
                    for dst, src in zip(targets, (p, m, v)):
                        dst[start : start + n].copy_(src, non_blocking=True)
                    self._free[slot] = _record(d2h)
        return kept_all

    def wait(self) -> None:
        """Block until every queued chunk is back in host memory."""
        if self._streams:
            self._streams[2].synchronize()  # its copies wait for everything queued before


def _record(stream: Any) -> Any:
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event
