"""``"auto"`` placeholders of a DeepSpeed config, filled from the trainer's own settings.

Hugging Face configs write ``"auto"`` where the value should come from ``TrainingArguments``
(the learning rate, the batch sizes, ...). Transformers fills them for DeepSpeed; the
integrations here fill the same keys the same way, then hand the config to Slipstream, which
rejects any ``"auto"`` still left (naming its key).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from slipstream.config.loading import read_config_source

__all__ = ["AUTO", "fill_auto", "hidden_size_values", "read_config"]

AUTO = "auto"


def read_config(source: Any) -> dict[str, Any]:
    """A mutable copy of a config given as a dict, a path or JSON text."""
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source))
    raw, _ = read_config_source(source)
    return copy.deepcopy(raw)


def _node(config: dict[str, Any], dotted: str) -> tuple[dict[str, Any] | None, str]:
    *parents, leaf = dotted.split(".")
    node: Any = config
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            return None, leaf
    return (node if isinstance(node, dict) else None), leaf


def fill_auto(config: dict[str, Any], values: Mapping[str, Any]) -> list[str]:
    """Replace ``"auto"`` at each dotted key of ``values`` (``"optimizer.params.lr"``) in place.

    Keys whose value is not ``"auto"`` are left as written; a ``None`` in ``values`` means
    "not known yet" and leaves the placeholder for a later call. Returns the keys filled.
    """
    filled = []
    for dotted, value in values.items():
        node, leaf = _node(config, dotted)
        if node is None or node.get(leaf) != AUTO or value is None:
            continue
        node[leaf] = value
        filled.append(dotted)
    return filled


def hidden_size_values(model: Any) -> dict[str, Any]:
    """ZeRO bucket sizes from the model's hidden size, as Transformers derives them.

    ``reduce_bucket_size`` = hidden², ``stage3_prefetch_bucket_size`` = 0.9·hidden²,
    ``stage3_param_persistence_threshold`` = 10·hidden; nothing when the model's config has
    no ``hidden_size`` (or ``hidden_sizes``).
    """
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None)
    sizes = getattr(config, "hidden_sizes", None)
    if hidden is None and sizes:
        hidden = max(sizes)
    if not isinstance(hidden, int):
        return {}
    return {
        "zero_optimization.reduce_bucket_size": hidden * hidden,
        "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
        "zero_optimization.stage3_param_persistence_threshold": 10 * hidden,
    }
