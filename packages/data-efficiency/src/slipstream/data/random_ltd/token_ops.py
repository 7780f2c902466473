"""Token gather/scatter for random-LTD: pure-torch references, Triton kernels, autograd wrappers.

All functions take batch-first activations ``(batch, seq, hidden)`` and sorted kept-token
indices ``(batch, kept)`` (unique within a row); seq-first activations are handled by the layer
wrapper with a transposed view.

[Note: random-LTD token op backends]
``"torch"`` (the default under ``"auto"``) views the activations as ``(batch * seq, hidden)``
rows and moves whole rows with ``index_select`` / ``index_copy_`` at flat row indices
``b * seq + indices[b, k]``: one C++ launch per op and per direction, no compilation per
shape, and, because the kept indices are unique, a backward that is a copy too (no atomic
``scatter_add``, as ``torch.gather``'s backward would use). The layer wrapper computes the
flat indices once per forward for every random-LTD layer. ``"triton"`` runs the Triton
kernels (one program per kept row), kept for builds that prefer them; both give the same
bits (they only copy).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch

from slipstream.kernels.triton_support import interpreting, triton_probe

__all__ = [
    "TokenBackend",
    "flat_token_indices",
    "gather_tokens",
    "gather_tokens_reference",
    "scatter_tokens",
    "scatter_tokens_reference",
    "triton_available",
]

TokenBackend = Literal["auto", "torch", "triton"]

logger = logging.getLogger(__name__)


def gather_tokens_reference(hidden: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``out[b, k] = hidden[b, indices[b, k]]``: the kept tokens of each row."""
    index = indices.long().unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
    return torch.gather(hidden, 1, index)


def scatter_tokens_reference(
    hidden: torch.Tensor, part: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    """A copy of ``hidden`` whose kept tokens are replaced by ``part`` (others pass through)."""
    index = indices.long().unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
    return hidden.scatter(1, index, part.to(hidden.dtype))


def flat_token_indices(indices: torch.Tensor, seq: int) -> torch.Tensor:
    """Row indices ``b * seq + indices[..., b, k]`` into ``hidden.reshape(-1, width)``.

    ``indices`` is ``(batch, kept)`` or ``(layers, batch, kept)``; the result flattens the
    last two dims (int64).
    """
    batch = indices.shape[-2]
    offsets = torch.arange(batch, device=indices.device, dtype=torch.int64).mul_(seq)
    return (indices.long() + offsets.unsqueeze(-1)).flatten(-2)


class _RowGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        batch, seq, width = hidden.shape
        ctx.save_for_backward(rows)
        ctx.shape = (batch, seq, width)
        flat = hidden.reshape(batch * seq, width)
        return flat.index_select(0, rows).view(batch, -1, width)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (rows,) = ctx.saved_tensors
        batch, seq, width = ctx.shape
        out = grad.new_zeros(batch * seq, width)
        # Rows are unique, so a copy into zeros is the scatter-add (no atomics).
        out.index_copy_(0, rows, grad.reshape(-1, width))
        return out.view(batch, seq, width), None


class _RowScatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, part: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        batch, seq, width = hidden.shape
        ctx.save_for_backward(rows)
        out = hidden.reshape(batch * seq, width).clone()
        out.index_copy_(0, rows, part.reshape(-1, width).to(hidden.dtype))
        return out.view(batch, seq, width)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (rows,) = ctx.saved_tensors
        batch, seq, width = grad.shape
        flat = grad.reshape(batch * seq, width)
        part_grad = flat.index_select(0, rows).view(batch, -1, width)
        # Overwritten rows do not reach the output: their gradient is zero.
        passthrough = flat.clone().index_fill_(0, rows, 0)
        return passthrough.view(batch, seq, width), part_grad, None


def triton_available(device: torch.device) -> bool:
    """Whether the Triton kernels can run on ``device`` (a GPU, or the CPU interpreter)."""
    ok, _ = triton_probe()
    return ok and (device.type == "cuda" or interpreting())


def _use_triton(backend: TokenBackend, device: torch.device) -> bool:
    if backend == "torch":
        return False
    if backend == "triton":
        if not triton_available(device):
            raise RuntimeError(
                f"random-LTD token ops: backend 'triton' asked for on {device}, where Triton "
                "cannot run (needs a CUDA/ROCm GPU, or TRITON_INTERPRET=1 on the CPU); use "
                "backend 'torch' or 'auto'"
            )
        return True
    return False  # "auto": the row-index ops (see the note above); Triton only by name


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        from slipstream.data.random_ltd import token_triton

        ctx.save_for_backward(indices)
        ctx.seq = hidden.shape[1]
        return token_triton.gather(hidden, indices)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        from slipstream.data.random_ltd import token_triton

        (indices,) = ctx.saved_tensors
        batch, _, width = grad.shape
        zeros = grad.new_zeros(batch, ctx.seq, width)
        # Indices are unique within a row, so a scatter into zeros is the scatter-add.
        return token_triton.scatter(zeros, grad.contiguous(), indices), None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, part: torch.Tensor, indices: torch.Tensor
    ) -> torch.Tensor:
        from slipstream.data.random_ltd import token_triton

        ctx.save_for_backward(indices)
        return token_triton.scatter(hidden.clone(), part.to(hidden.dtype), indices)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        from slipstream.data.random_ltd import token_triton

        (indices,) = ctx.saved_tensors
        grad = grad.contiguous()
        part_grad = token_triton.gather(grad, indices)
        # Overwritten tokens do not reach the output: their gradient is zero.
        passthrough = token_triton.scatter(grad.clone(), torch.zeros_like(part_grad), indices)
        return passthrough, part_grad, None


def gather_tokens(
    hidden: torch.Tensor,
    indices: torch.Tensor,
    backend: TokenBackend = "auto",
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kept tokens ``(batch, kept, hidden)`` of batch-first ``hidden`` (differentiable).

    ``rows``: :func:`flat_token_indices` of ``indices``, when the caller has them already.
    """
    if _use_triton(backend, hidden.device):
        return _Gather.apply(hidden.contiguous(), indices.contiguous())  # type: ignore[no-any-return]
    if rows is None:
        rows = flat_token_indices(indices, hidden.shape[1])
    return _RowGather.apply(hidden, rows)  # type: ignore[no-any-return]


def scatter_tokens(
    hidden: torch.Tensor,
    part: torch.Tensor,
    indices: torch.Tensor,
    backend: TokenBackend = "auto",
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """``hidden`` with its kept tokens replaced by ``part`` (differentiable, out of place).

    ``rows``: :func:`flat_token_indices` of ``indices``, when the caller has them already.
    """
    if _use_triton(backend, hidden.device):
        return _Scatter.apply(  # type: ignore[no-any-return]
            hidden.contiguous(), part.contiguous(), indices.contiguous()
        )
    if rows is None:
        rows = flat_token_indices(indices, hidden.shape[1])
    return _RowScatter.apply(hidden, part, rows)  # type: ignore[no-any-return]
