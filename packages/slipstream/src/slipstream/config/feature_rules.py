"""Rules that tell an inert value of a recognised DeepSpeed key from one asking for the feature.

Each rule is ``(value, path) -> bool``: it checks the value's shape (raising ConfigError with
the key path) and returns True when the value switches the feature on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from slipstream.kernels.config_schema import config_fail, key_path, unknown_keys_error

__all__ = [
    "ActivePredicate",
    "always",
    "any_nested_enabled",
    "data_types_active",
    "enabled_flag",
    "non_default",
    "present_unless_false",
    "scalar",
]

ActivePredicate = Callable[[Any, str], bool]


def _mapping(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        config_fail(path, value, "an object")
    return value


def enabled_flag(default: bool = False, key: str = "enabled") -> ActivePredicate:
    """Active when the block's ``key`` (``enabled``; absent means ``default``) is true."""

    def is_active(value: Any, path: str) -> bool:
        enabled = _mapping(value, path).get(key, default)
        if not isinstance(enabled, bool):
            config_fail(key_path(path, key), enabled, "a boolean (true or false)")
        return enabled

    return is_active


def _differs(value: Any, default: Any, path: str, strict: bool) -> bool:
    if isinstance(default, Mapping):
        if not isinstance(value, Mapping):
            return True
        unknown = [str(key) for key in value if key not in default]
        if unknown and strict:
            raise unknown_keys_error(path, unknown, list(default))
        if unknown:
            return True
        return any(_differs(value[key], default[key], key_path(path, key), strict) for key in value)
    if isinstance(default, str) and isinstance(value, str):
        return value.strip().lower() != default.lower()
    # `type(...)` keeps 0 from matching false and 1 from matching true.
    return type(value) is not type(default) or value != default


def non_default(defaults: Mapping[str, Any], strict: bool = True) -> ActivePredicate:
    """Active when any key differs from DeepSpeed's default (strings compared case-insensitively).

    With ``strict``, keys outside ``defaults`` are errors (with a suggestion); otherwise they
    count as asking for the feature.
    """

    def is_active(value: Any, path: str) -> bool:
        return _differs(_mapping(value, path), defaults, path, strict)

    return is_active


def scalar(default: Any, kinds: tuple[type, ...], expected: str) -> ActivePredicate:
    """A top-level scalar: type-checked, active when it differs from ``default``."""

    def is_active(value: Any, path: str) -> bool:
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            config_fail(path, value, expected)
        return _differs(value, default, path, strict=True)

    return is_active


def any_nested_enabled(value: Any, path: str) -> bool:
    """Active when any nested block has ``"enabled": true`` (compression_training's layout)."""
    if isinstance(value, Mapping):
        if value.get("enabled") is True:
            return True
        return any(
            any_nested_enabled(item, key_path(path, str(key))) for key, item in value.items()
        )
    if isinstance(value, list):
        return any(any_nested_enabled(item, path) for item in value)
    return False


def always(active: bool) -> ActivePredicate:
    """Active (or inert) whatever the value: the key's presence decides."""

    def is_active(value: Any, path: str) -> bool:
        return active

    return is_active


def present_unless_false(value: Any, path: str) -> bool:
    """DeepSpeed's datastates/casync switches: any value but false (or null) turns them on."""
    return value is not False and value is not None


def data_types_active(value: Any, path: str) -> bool:
    """``data_types``: inert when nothing but fp32 gradient accumulation is asked for."""
    block = _mapping(value, path)
    unknown = [
        key for key in block if key not in ("grad_accum_dtype", "param_dtype", "buffer_dtype")
    ]
    if unknown:
        raise unknown_keys_error(path, unknown, ["grad_accum_dtype", "param_dtype", "buffer_dtype"])
    accum = block.get("grad_accum_dtype")
    # Slipstream already accumulates gradients in fp32 (into the fp32 master gradients).
    accum_inert = accum is None or (isinstance(accum, str) and accum.lower() in ("fp32", "float32"))
    return (
        not accum_inert
        or block.get("param_dtype") is not None
        or block.get("buffer_dtype") is not None
    )
