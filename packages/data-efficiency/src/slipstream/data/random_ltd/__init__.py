"""Random layerwise token dropping (random-LTD): layer wrapper, schedule, token ops, LR decay."""

from __future__ import annotations

from slipstream.data.random_ltd.attach import attach_random_ltd
from slipstream.data.random_ltd.layer import (
    RandomLayerTokenDrop,
    convert_to_random_ltd,
    remove_random_ltd_state_dict,
    sample_tokens,
)
from slipstream.data.random_ltd.lr_schedule import LayerTokenLR, layer_token_lr
from slipstream.data.random_ltd.scheduler import RandomLTDScheduler
from slipstream.data.random_ltd.token_ops import (
    gather_tokens,
    gather_tokens_reference,
    scatter_tokens,
    scatter_tokens_reference,
)

__all__ = [
    "LayerTokenLR",
    "RandomLTDScheduler",
    "RandomLayerTokenDrop",
    "attach_random_ltd",
    "convert_to_random_ltd",
    "gather_tokens",
    "gather_tokens_reference",
    "layer_token_lr",
    "remove_random_ltd_state_dict",
    "sample_tokens",
    "scatter_tokens",
    "scatter_tokens_reference",
]
