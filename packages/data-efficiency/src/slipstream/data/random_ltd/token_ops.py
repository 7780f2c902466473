"""Token gather/scatter for random-LTD: pure-torch references, Triton kernels, autograd wrappers.

All functions take batch-first activations ``(batch, seq, hidden)`` and sorted kept-token
indices ``(batch, kept)`` (unique within a row); seq-first activations are handled by the layer
wrapper with a transposed view.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch

from slipstream.kernels.triton_support import interpreting, triton_probe

__all__ = [
    "TokenBackend",
    "gather_tokens",
    "gather_tokens_reference",
    "scatter_tokens",
    "scatter_tokens_reference",
    "triton_available",
]

TokenBackend = Literal["auto", "torch", "triton"]

logger = logging.getLogger(__name__)
# Set when a Triton kernel failed under backend "auto": the references are used from then on.
_TRITON_FAILED: list[str] = []


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
    return not _TRITON_FAILED and device.type == "cuda" and triton_available(device)


def _fall_back(backend: TokenBackend, error: Exception) -> None:
    """Under "auto", a failing kernel (a compiler problem) falls back once, with a warning."""
    if backend != "auto":
        raise error
    _TRITON_FAILED.append(f"{type(error).__name__}: {error}")
    logger.warning(
        "random-LTD Triton token kernels failed (%s); using the pure-torch gather/scatter",
        _TRITON_FAILED[0],
    )


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
    hidden: torch.Tensor, indices: torch.Tensor, backend: TokenBackend = "auto"
) -> torch.Tensor:
    """The kept tokens ``(batch, kept, hidden)`` of batch-first ``hidden`` (differentiable)."""
    if _use_triton(backend, hidden.device):
        try:
            return _Gather.apply(hidden.contiguous(), indices.contiguous())  # type: ignore[no-any-return]
        except Exception as error:  # compiler/driver errors vary by release
            _fall_back(backend, error)
    return gather_tokens_reference(hidden, indices)


def scatter_tokens(
    hidden: torch.Tensor,
    part: torch.Tensor,
    indices: torch.Tensor,
    backend: TokenBackend = "auto",
) -> torch.Tensor:
    """``hidden`` with its kept tokens replaced by ``part`` (differentiable, out of place)."""
    if _use_triton(backend, hidden.device):
        try:
            return _Scatter.apply(  # type: ignore[no-any-return]
                hidden.contiguous(), part.contiguous(), indices.contiguous()
            )
        except Exception as error:  # compiler/driver errors vary by release
            _fall_back(backend, error)
    return scatter_tokens_reference(hidden, part, indices)
