"""Pure-torch argmax over the last dimension (the greedy choice of the next token)."""

from __future__ import annotations

import torch


def check_shapes(scores: torch.Tensor) -> None:
    """Validate the argument of :func:`argmax`."""
    if scores.dim() != 2 or scores.shape[-1] == 0:
        raise ValueError(
            f"argmax: scores must be (rows, columns) with columns > 0, got {tuple(scores.shape)}"
        )


def argmax(scores: torch.Tensor) -> torch.Tensor:
    """The index of each row's maximum of ``scores`` ``(rows, columns)``, as ``int64``
    ``(rows,)``: the first one on ties, the first NaN where a row holds one (``torch.argmax``)."""
    check_shapes(scores)
    return scores.argmax(dim=-1)
