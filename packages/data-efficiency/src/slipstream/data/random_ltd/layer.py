"""RandomLayerTokenDrop: a layer wrapper that runs its layer on a random subset of the tokens."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from slipstream.data.config import RandomLTDConfig
from slipstream.data.random_ltd.scheduler import RandomLTDScheduler
from slipstream.data.random_ltd.token_ops import (
    TokenBackend,
    flat_token_indices,
    gather_tokens,
    scatter_tokens,
)

__all__ = [
    "RandomLayerTokenDrop",
    "convert_to_random_ltd",
    "remove_random_ltd_state_dict",
    "sample_tokens",
]

logger = logging.getLogger(__name__)


def sample_tokens(
    kept: int,
    seq: int,
    batch: int,
    layers: int,
    device: torch.device,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sorted kept-token indices ``(layers, batch, kept)``, uniform without replacement."""
    scores = torch.rand(layers * batch, seq, device=device, generator=generator)
    chosen = scores.argsort(dim=1)[:, :kept]
    return chosen.sort(dim=1).values.reshape(layers, batch, kept)


class RandomLayerTokenDrop(nn.Module):
    """Wraps one transformer layer: in training it runs the layer on the scheduled number of
    randomly kept tokens and passes the others through unchanged (DeepSpeed's random-LTD).

    The first random-LTD layer of a forward draws the indices of every random-LTD layer; the
    others read theirs from the shared scheduler. Outside training, or when the schedule
    keeps the whole sequence, the layer runs on all tokens. A tuple output has its first
    element scattered back; the rest is returned as the layer gave it.
    """

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.random_ltd_layer = layer
        self.scheduler: RandomLTDScheduler | None = None
        self.layer_index = -1
        self.mask_name: str | None = None
        self.model_type = "decoder"
        self.batch_first = True
        self.backend: TokenBackend = "auto"

    def init_config(
        self,
        config: RandomLTDConfig,
        scheduler: RandomLTDScheduler,
        layer_index: int,
        backend: TokenBackend = "auto",
    ) -> None:
        """Attach the shared scheduler; ``layer_index`` is this layer's rank among the wrapped."""
        self.scheduler = scheduler
        self.layer_index = layer_index
        self.mask_name = config.model_mask_name
        self.model_type = config.model_type
        self.batch_first = config.hidden_state_order == "batch_seq_dim"
        self.backend = backend

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped layer on the kept tokens (training) or on all of them."""
        scheduler = self.scheduler
        if scheduler is None or not self.training:
            return self.random_ltd_layer(hidden_states, *args, **kwargs)
        hidden = hidden_states if self.batch_first else hidden_states.transpose(0, 1)
        batch, seq = hidden.shape[0], hidden.shape[1]
        kept = scheduler.get_current_seq()
        if kept >= seq:
            return self.random_ltd_layer(hidden_states, *args, **kwargs)
        mask = kwargs.get(self.mask_name) if self.mask_name is not None else None
        if self.layer_index == 0 or scheduler.sample_indices is None:
            indices = sample_tokens(
                kept, seq, batch, scheduler.get_random_ltd_layer_num(), hidden.device
            )
            scheduler.sample_indices = indices
            # Flat row indices of every layer, once per forward (the token ops' note).
            scheduler.sample_rows = flat_token_indices(indices, seq)
            scheduler.part_attention_mask = self._part_mask(mask, indices, kept)
        indices = scheduler.sample_indices
        part_mask = scheduler.part_attention_mask
        own = indices[self.layer_index]
        rows = None if scheduler.sample_rows is None else scheduler.sample_rows[self.layer_index]
        part = gather_tokens(hidden, own, self.backend, rows)
        if self.mask_name is not None and mask is not None:
            kwargs[self.mask_name] = (
                part_mask[self.layer_index] if self.model_type == "encoder" else part_mask
            )
        layer_in = part if self.batch_first else part.transpose(0, 1)
        outputs = self.random_ltd_layer(layer_in, *args, **kwargs)
        first = outputs[0] if isinstance(outputs, tuple) else outputs
        if not isinstance(first, torch.Tensor):
            raise TypeError(
                f"random-LTD wraps {type(self.random_ltd_layer).__name__}, whose output is "
                f"{type(outputs).__name__}: it needs a tensor or a tuple starting with one"
            )
        first = first if self.batch_first else first.transpose(0, 1)
        merged = scatter_tokens(hidden, first, own, self.backend, rows)
        merged = merged if self.batch_first else merged.transpose(0, 1)
        if isinstance(outputs, tuple):
            return (merged, *outputs[1:])
        return merged

    def _part_mask(self, mask: Any, indices: torch.Tensor, kept: int) -> Any:
        if mask is None:
            return None
        if self.model_type == "decoder":
            # A causal mask over sorted kept tokens is the mask's leading kept x kept block.
            return mask[..., :kept, :kept]
        per_layer = []
        for layer in range(indices.shape[0]):
            rows = []
            for b in range(indices.shape[1]):
                chosen = indices[layer, b]
                rows.append(mask[b : b + 1][..., chosen, :][..., chosen])
            per_layer.append(torch.cat(rows, dim=0))
        return per_layer


def convert_to_random_ltd(
    model: nn.Module, layer_type: type[nn.Module] | tuple[type[nn.Module], ...]
) -> nn.Module:
    """Wrap every ``layer_type`` submodule of ``model`` in :class:`RandomLayerTokenDrop`.

    Pass an engine to have it attach its random-LTD scheduler right away (as DeepSpeed's
    ``convert_to_random_ltd`` does); for a plain module call
    ``engine.random_ltd_initialize()`` (or :func:`attach_random_ltd`) after wrapping.
    """
    root = getattr(model, "module", model)
    targets = [
        (name, module)
        for name, module in root.named_modules()
        if isinstance(module, layer_type) and not isinstance(module, RandomLayerTokenDrop)
    ]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = root.get_submodule(parent_name) if parent_name else root
        setattr(parent, child, RandomLayerTokenDrop(module))
    initialize = getattr(model, "random_ltd_initialize", None)
    if callable(initialize):
        initialize()
    return model


def remove_random_ltd_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A state dict with the wrappers' ``.random_ltd_layer`` removed from the key names."""
    return {key.replace(".random_ltd_layer", ""): value for key, value in state_dict.items()}
