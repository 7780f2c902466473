"""Small top-level blocks: ``optimizer``, ``scheduler`` and ``amd_specific``."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from slipstream.kernels.config_schema import ConfigBlock, config_fail, key_path

__all__ = ["AmdSpecificConfig", "OptimizerConfig", "SchedulerConfig", "parse_stream_priority"]

logger = logging.getLogger(__name__)

#: The stream priority that ``"rocm_stream_priority": true`` asks for: torch's high priority
#: (lower numbers are higher; -1 is the highest that CUDA and HIP both give).
HIGH_STREAM_PRIORITY = -1


def _check_type_name(path: str, name: str) -> None:
    if not name.strip():
        config_fail(key_path(path, "type"), name, 'a non-empty name such as "AdamW"')


@dataclasses.dataclass(kw_only=True)
class OptimizerConfig(ConfigBlock):
    """The ``optimizer`` block: which optimizer to build and its keyword arguments.

    Attributes:
        type: the optimizer name, case-insensitive (``"Adam"``, ``"AdamW"``, ``"Lamb"``, ...).
        params: keyword arguments for its constructor; the optimizer builder validates them.
        legacy_fusion: accepted for older DeepSpeed configs; has no effect.
    """

    type: str
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    legacy_fusion: bool = False

    def validate(self, path: str) -> None:
        """Require a non-empty optimizer name; note that ``legacy_fusion`` does nothing."""
        _check_type_name(path, self.type)
        if self.legacy_fusion:
            logger.info(
                "%s: a legacy DeepSpeed key, accepted and ignored (as DeepSpeed does)",
                key_path(path, "legacy_fusion"),
            )


@dataclasses.dataclass(kw_only=True)
class SchedulerConfig(ConfigBlock):
    """The ``scheduler`` block: a learning-rate schedule and its keyword arguments.

    Attributes:
        type: the schedule name (``"WarmupLR"``, ``"WarmupDecayLR"``, ``"OneCycle"``, ...).
        params: keyword arguments for it; the scheduler builder validates them.
    """

    type: str
    params: dict[str, Any] = dataclasses.field(default_factory=dict)

    def validate(self, path: str) -> None:
        """Require a non-empty scheduler name."""
        _check_type_name(path, self.type)


@dataclasses.dataclass(kw_only=True)
class AmdSpecificConfig(ConfigBlock):
    """ROCm-only settings (``"amd_specific": {...}``; a Slipstream block, not DeepSpeed's).

    Attributes:
        rocm_mem_pool_init: pre-initialise the HIP memory pool at start-up.
        rocm_stream_priority: priority of Slipstream's side streams on ROCm (0 = default;
            lower numbers are higher priority, as in ``torch.cuda.Stream(priority=...)``).
            ``true`` means high priority (-1), ``false`` the default (0), as the AMD guide's
            ``"rocm_stream_priority": true`` reads.
    """

    rocm_mem_pool_init: bool = False
    rocm_stream_priority: int = dataclasses.field(
        default=0, metadata={"parser": lambda value, path: parse_stream_priority(value, path)}
    )


def parse_stream_priority(value: Any, path: str) -> int:
    """A stream priority: an integer, or a boolean (true = high priority, false = default)."""
    if isinstance(value, bool):
        return HIGH_STREAM_PRIORITY if value else 0
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return int(value)
    config_fail(path, value, "an integer (0 = default, negative = higher) or true/false")
