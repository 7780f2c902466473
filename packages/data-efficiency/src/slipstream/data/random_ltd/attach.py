"""attach_random_ltd: give the wrapped layers named by ``random_ltd_layer_id`` their scheduler."""

from __future__ import annotations

from torch import nn

from slipstream.data.config import RandomLTDConfig
from slipstream.data.random_ltd.layer import RandomLayerTokenDrop
from slipstream.data.random_ltd.scheduler import RandomLTDScheduler
from slipstream.data.random_ltd.token_ops import TokenBackend

__all__ = ["attach_random_ltd"]


def _layer_number(name: str) -> int | None:
    """The last integer component of a module path (``blocks.3`` -> 3, ``h.10.attn`` -> 10)."""
    numbers = [int(part) for part in name.split(".") if part.isdigit()]
    return numbers[-1] if numbers else None


def attach_random_ltd(
    model: nn.Module,
    config: RandomLTDConfig,
    scheduler: RandomLTDScheduler,
    backend: TokenBackend = "auto",
) -> list[str]:
    """Attach ``scheduler`` to the RandomLayerTokenDrop wrappers of the configured layer ids.

    A wrapper is matched by the last integer in its module path (``layers.3`` is layer 3);
    returns the matched names, in order. Raises ValueError unless exactly
    ``random_ltd_layer_num`` wrappers match.
    """
    wanted = set(config.random_ltd_layer_id)
    root = getattr(model, "module", model)
    matched: list[str] = []
    for name, module in root.named_modules():
        if isinstance(module, RandomLayerTokenDrop) and _layer_number(name) in wanted:
            module.init_config(config, scheduler, len(matched), backend)
            matched.append(name)
    if len(matched) != config.random_ltd_layer_num:
        wrapped = [n for n, m in root.named_modules() if isinstance(m, RandomLayerTokenDrop)]
        raise ValueError(
            f"data_efficiency.data_routing.random_ltd.random_ltd_layer_num = "
            f"{config.random_ltd_layer_num}, but {len(matched)} wrapped layers match "
            f"random_ltd_layer_id {sorted(wanted)} (wrapped: {wrapped or 'none'}). Wrap the "
            "layers first with slipstream.data.convert_to_random_ltd(model, LayerClass)"
        )
    return matched
