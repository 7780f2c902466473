"""Progressive layer drop (PLD): the ``progressive_layer_drop`` block, its theta schedule, a layer-drop helper.

[Note: PLD schedule, as in DeepSpeed]
The global keep probability starts at ``theta(0) = 1`` and decays towards ``theta``::

    theta(t) = (1 - theta) * exp(-gamma * t) + theta

The engine calls :meth:`ProgressiveLayerDrop.update_state` with its ``global_steps`` at each
optimizer step (before the step counter moves), and passes ``progressive_layer_drop=True,
pld_theta=theta(t)`` to the model's forward. What the model does with it is the model's
business; :func:`layer_keep_probability` and :func:`run_layers_with_drop` give the paper's
per-layer form (arXiv 2010.13369, section 4.2): layer ``i`` of ``L`` (0-based) is kept with
probability ``1 - (i + 1) / L * (1 - theta(t))``, deeper layers dropped more often.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from slipstream.kernels.config_schema import ConfigBlock

__all__ = [
    "ProgressiveLayerDrop",
    "ProgressiveLayerDropConfig",
    "layer_keep_probability",
    "run_layers_with_drop",
]


@dataclasses.dataclass(kw_only=True)
class ProgressiveLayerDropConfig(ConfigBlock):
    """The top-level ``progressive_layer_drop`` block (DeepSpeed's keys and defaults).

    Attributes:
        enabled: pass ``progressive_layer_drop``/``pld_theta`` to the model's forward.
        theta: the keep probability theta(t) decays to (lower: faster, less robust).
        gamma: how fast theta(t) decays per optimizer step.
    """

    enabled: bool = False
    theta: float = dataclasses.field(default=0.5, metadata={"ge": 0.0, "le": 1.0})
    gamma: float = dataclasses.field(default=0.001, metadata={"ge": 0.0})


class ProgressiveLayerDrop:
    """The theta(t) schedule the engine keeps (see the note at the top of this module).

    >>> pld = ProgressiveLayerDrop(theta=0.5, gamma=0.1)
    >>> pld.get_theta()
    1.0
    >>> pld.update_state(10)
    >>> round(pld.get_theta(), 4)
    0.6839
    """

    def __init__(self, theta: float = 0.5, gamma: float = 0.001) -> None:
        self.theta = float(theta)
        self.gamma = float(gamma)
        self.current_theta = 1.0

    @classmethod
    def from_config(cls, config: ProgressiveLayerDropConfig) -> ProgressiveLayerDrop | None:
        """The schedule, or None when the block is disabled."""
        return cls(config.theta, config.gamma) if config.enabled else None

    def get_theta(self) -> float:
        """The current global keep probability theta(t)."""
        return self.current_theta

    def get_state(self) -> dict[str, Any]:
        """The keyword arguments the engine adds to the model's forward."""
        return {"progressive_layer_drop": True, "pld_theta": self.get_theta()}

    def update_state(self, global_step: int) -> None:
        """Move to ``theta(global_step)``."""
        self.current_theta = (1.0 - self.theta) * math.exp(-self.gamma * global_step) + self.theta


def layer_keep_probability(layer_index: int, num_layers: int, theta: float) -> float:
    """``1 - (layer_index + 1) / num_layers * (1 - theta)``: the paper's per-layer keep rate."""
    if not 0 <= layer_index < num_layers:
        raise ValueError(f"layer_index {layer_index} is outside 0..{num_layers - 1}")
    return 1.0 - (layer_index + 1) / num_layers * (1.0 - theta)


def run_layers_with_drop(
    layers: Sequence[Callable[..., torch.Tensor]],
    hidden: torch.Tensor,
    *args: Any,
    pld_theta: float | None,
    training: bool,
    generator: torch.Generator | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Run ``layers`` in order on ``hidden``, skipping layer ``i`` (identity) with probability
    ``1 - layer_keep_probability(i, len(layers), pld_theta)`` while training.

    Each layer is called as ``layer(hidden, *args, **kwargs)`` and must return the new hidden
    state (a residual block, so skipping it is the identity). A kept layer's output is used
    as is (no rescaling). Outside training, or with ``pld_theta`` None, every layer runs. The
    draws come from ``generator`` (a CPU generator; seed it alike on every data-parallel rank
    for the same layers to be skipped everywhere), or torch's global CPU RNG.

    >>> import torch
    >>> layers = [lambda h: h + 1 for _ in range(4)]
    >>> run_layers_with_drop(layers, torch.zeros(1), pld_theta=1.0, training=True)
    tensor([4.])
    """
    if not training or pld_theta is None:
        for layer in layers:
            hidden = layer(hidden, *args, **kwargs)
        return hidden
    # One CPU draw per layer: no device work and no host sync to decide.
    draws = torch.rand(len(layers), generator=generator).tolist()
    for index, (layer, draw) in enumerate(zip(layers, draws)):
        if draw < layer_keep_probability(index, len(layers), pld_theta):
            hidden = layer(hidden, *args, **kwargs)
    return hidden
