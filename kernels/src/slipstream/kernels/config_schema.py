"""The one config mechanism: typed dataclass blocks that parse, validate and dump JSON config."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NoReturn, TypeVar, Union

__all__ = [
    "AutoValueError",
    "ConfigBlock",
    "ConfigError",
    "NotImplementedFeatureError",
    "config_fail",
    "field_default",
    "find_auto_values",
    "key_path",
    "not_implemented",
    "show_value",
    "unknown_keys_error",
]

_Block = TypeVar("_Block", bound="ConfigBlock")
_NoneType = type(None)

# Field metadata understood by ConfigBlock (all optional):
#   "aliases":    other names accepted for the key (older DeepSpeed spellings).
#   "ge"/"gt"/"le"/"lt": numeric bounds checked after conversion.
#   "parser":     callable(value, path) -> parsed value, replacing the type-driven conversion.
#   "serializer": callable(parsed) -> JSON value, the inverse of "parser" for to_dict().
#   "allow_auto": do not treat the string "auto" inside this value as an unfilled placeholder
#                 (for free-form blocks where DeepSpeed itself gives "auto" a meaning).
_BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}

AUTO_EXPLANATION = (
    '"auto" is a placeholder that the Hugging Face Trainer/Accelerate DeepSpeed integration '
    "replaces with concrete values before the config reaches DeepSpeed; Slipstream reads the "
    "config as written. Set a concrete value for each of these keys (or let that integration "
    "fill the config in first and pass the result)."
)


class ConfigError(ValueError):
    """A config value is missing, misspelt, of the wrong type or out of range.

    The message names the full key path (``fp16.loss_scale_window``), the value given and
    what is allowed instead; ``path`` holds the key path when one applies.
    """

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class NotImplementedFeatureError(ConfigError):
    """The config asks for a known DeepSpeed feature that this release does not implement yet."""


class AutoValueError(ConfigError):
    """The config still holds ``"auto"`` placeholders meant for the Hugging Face integration."""

    def __init__(self, paths: Sequence[str]) -> None:
        self.paths = list(paths)
        listed = ", ".join(self.paths)
        noun = "key is" if len(self.paths) == 1 else "keys are"
        super().__init__(
            f'config {noun} set to "auto": {listed}. {AUTO_EXPLANATION}',
            self.paths[0] if self.paths else None,
        )


def key_path(path: str, key: str | int) -> str:
    """Join a parent key path and a child key: ``key_path("fp16", "enabled") == "fp16.enabled"``."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def show_value(value: Any) -> str:
    """Render a config value the way the user wrote it in JSON (``true``, ``null``, ``"cpu"``)."""
    try:
        text = json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, Mapping):
        return "object"
    if isinstance(value, (list, tuple)):
        return "array"
    return type(value).__name__


def config_fail(path: str, value: Any, allowed: str) -> NoReturn:
    """Raise a :class:`ConfigError` naming the key, the value given and what is allowed.

    >>> try:
    ...     config_fail("fp16.hysteresis", 0, "an integer >= 1")
    ... except ConfigError as error:
    ...     print(error)
    fp16.hysteresis = 0 (integer) is not valid: expected an integer >= 1
    """
    raise ConfigError(
        f"{path or '<config>'} = {show_value(value)} ({_json_type(value)}) is not valid: "
        f"expected {allowed}",
        path,
    )


def not_implemented(path: str, value: Any, feature: str, provider: str, hint: str = "") -> NoReturn:
    """Raise a :class:`NotImplementedFeatureError` for a recognised but unimplemented feature.

    ``feature`` names what the key switches on, ``provider`` the package or release that will
    bring it, ``hint`` what to do meanwhile.
    """
    message = (
        f"{path} = {show_value(value)} asks for {feature}: recognised, but not implemented "
        f"yet in this release of Slipstream; it will come with {provider}."
    )
    raise NotImplementedFeatureError(f"{message} {hint}".strip(), path)


def unknown_keys_error(path: str, unknown: Sequence[str], valid: Sequence[str]) -> ConfigError:
    """Build the error for keys that a block does not have, suggesting the closest valid key."""
    by_lower = {name.lower(): name for name in valid}
    parts = []
    suggested_any = False
    for key in unknown:
        close = difflib.get_close_matches(key.lower(), list(by_lower), n=1, cutoff=0.6)
        if close:
            suggested_any = True
            parts.append(
                f"unknown config key '{key_path(path, key)}'; did you mean "
                f"'{key_path(path, by_lower[close[0]])}'?"
            )
        else:
            parts.append(f"unknown config key '{key_path(path, key)}'")
    message = "; ".join(parts)
    where = f"'{path}'" if path else "the top level"
    if not suggested_any:
        if len(valid) <= 40:
            message += f". Valid keys at {where}: {', '.join(sorted(valid))}"
        else:
            message += f". See docs/config.md for every key accepted at {where}"
    return ConfigError(message, key_path(path, unknown[0]))


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def find_auto_values(value: Any, path: str) -> list[str]:
    """Key paths under ``value`` (recursively) whose value is the placeholder string ``"auto"``."""
    if _is_auto(value):
        return [path]
    found: list[str] = []
    if isinstance(value, Mapping):
        for key, item in value.items():
            found += find_auto_values(item, key_path(path, str(key)))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            found += find_auto_values(item, key_path(path, index))
    return found


@dataclasses.dataclass(frozen=True)
class _FieldSpec:
    name: str
    type: Any
    field: dataclasses.Field[Any]
    aliases: tuple[str, ...]


_SPECS: dict[type, tuple[_FieldSpec, ...]] = {}


def _field_specs(cls: type) -> tuple[_FieldSpec, ...]:
    """The config fields of a block class, type hints resolved (computed once per class)."""
    cached = _SPECS.get(cls)
    if cached is None:
        cached = _SPECS[cls] = _compute_field_specs(cls)
    return cached


def _compute_field_specs(cls: type) -> tuple[_FieldSpec, ...]:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} must be a @dataclass(kw_only=True) to be a ConfigBlock")
    hints = typing.get_type_hints(cls)
    specs = []
    for item in dataclasses.fields(cls):
        if not item.init:
            continue  # runtime state (e.g. the raw user dict), never read from or written to JSON
        specs.append(
            _FieldSpec(item.name, hints[item.name], item, tuple(item.metadata.get("aliases", ())))
        )
    return tuple(specs)


class ConfigBlock:
    """Base of every config block: a ``@dataclass(kw_only=True)`` with typed, defaulted fields.

    Field types may be bool, int (JSON numbers with an integral value such as ``5e8`` are
    accepted), float (ints accepted), str, ``Literal[...]``, ``X | None``, ``list[X]``,
    ``dict[str, Any]`` (free-form) and nested ConfigBlock subclasses. Aliases and bounds come
    from field metadata, e.g. ``field(default=0, metadata={"aliases": ("old",), "ge": 0})``.

    >>> import dataclasses
    >>> @dataclasses.dataclass(kw_only=True)
    ... class Scaler(ConfigBlock):
    ...     window: int = 1000
    >>> Scaler.from_dict({"window": 5e2}, "fp16")
    Scaler(window=500)
    >>> try:
    ...     Scaler.from_dict({"windw": 5}, "fp16")
    ... except ConfigError as error:
    ...     print(error)
    unknown config key 'fp16.windw'; did you mean 'fp16.window'?
    """

    @classmethod
    def config_keys(cls) -> list[str]:
        """Every key this block accepts: field names and their aliases."""
        keys = []
        for spec in _field_specs(cls):
            keys += [spec.name, *spec.aliases]
        return keys

    @classmethod
    def from_dict(cls: type[_Block], data: Mapping[str, Any] | None, path: str = "") -> _Block:
        """Parse and validate ``data`` (None means all defaults); ``path`` prefixes key paths."""
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            config_fail(path, data, f"an object with the keys of the {cls.__name__} block")
        specs = _field_specs(cls)
        by_key: dict[str, _FieldSpec] = {}
        for spec in specs:
            for key in (spec.name, *spec.aliases):
                by_key[key] = spec

        unknown = [str(key) for key in data if key not in by_key]
        if unknown:
            raise unknown_keys_error(path, unknown, cls.config_keys())

        given: dict[str, tuple[str, Any]] = {}
        for key, value in data.items():
            spec = by_key[key]
            if spec.name in given:
                first = given[spec.name][0]
                raise ConfigError(
                    f"'{key_path(path, first)}' and '{key_path(path, key)}' set the same "
                    f"option (one is an alias of the other); keep only '{key_path(path, spec.name)}'",
                    key_path(path, key),
                )
            given[spec.name] = (key, value)

        # One error listing every "auto" in this block and below, before any other check.
        auto_paths = _auto_in_block(cls, data, path)
        if auto_paths:
            raise AutoValueError(auto_paths)

        kwargs = {}
        for spec in specs:
            if spec.name in given:
                key, value = given[spec.name]
                kwargs[spec.name] = _convert_field(spec, value, key_path(path, key))
            elif _is_required(spec.field):
                raise ConfigError(
                    f"missing required config key '{key_path(path, spec.name)}' "
                    f"({_describe(spec.type)})",
                    key_path(path, spec.name),
                )
        instance = cls(**kwargs)
        instance.validate(path)
        return instance

    def to_dict(self) -> dict[str, Any]:
        """The block as JSON-ready data under canonical key names; ``from_dict`` reads it back."""
        out = {}
        for spec in _field_specs(type(self)):
            value = getattr(self, spec.name)
            serializer = spec.field.metadata.get("serializer")
            out[spec.name] = serializer(value) if serializer is not None else _dump(value)
        return out

    def validate(self, path: str) -> None:
        """Cross-field and value checks after parsing; raise ConfigError naming the key path."""


def _auto_in_block(cls: type[ConfigBlock], data: Mapping[str, Any], path: str) -> list[str]:
    """Paths of "auto" values in a block's data, skipping fields marked ``allow_auto``."""
    by_key = {key: spec for spec in _field_specs(cls) for key in (spec.name, *spec.aliases)}
    found: list[str] = []
    for key, value in data.items():
        spec = by_key.get(key)
        where = key_path(path, str(key))
        if spec is None:
            found += find_auto_values(value, where)
        elif not spec.field.metadata.get("allow_auto", False):
            found += _auto_in_value(spec.type, value, where)
    return found


def _auto_in_value(tp: Any, value: Any, path: str) -> list[str]:
    if _is_auto(value):
        return [path]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        blocks = [arg for arg in args if isinstance(arg, type) and issubclass(arg, ConfigBlock)]
        if blocks and isinstance(value, Mapping):
            return _auto_in_block(blocks[0], value, path)
    if isinstance(tp, type) and issubclass(tp, ConfigBlock) and isinstance(value, Mapping):
        return _auto_in_block(tp, value, path)
    if origin in (list, Sequence) and args and isinstance(value, (list, tuple)):
        return [
            p
            for i, item in enumerate(value)
            for p in _auto_in_value(args[0], item, key_path(path, i))
        ]
    return find_auto_values(value, path)


def _is_required(item: dataclasses.Field[Any]) -> bool:
    return item.default is dataclasses.MISSING and item.default_factory is dataclasses.MISSING


def field_default(item: dataclasses.Field[Any]) -> Any:
    """The default value of a dataclass field (calling its default factory)."""
    if item.default_factory is not dataclasses.MISSING:
        return item.default_factory()
    return item.default


def _dump(value: Any) -> Any:
    if isinstance(value, ConfigBlock):
        return value.to_dict()
    if isinstance(value, Mapping):
        return {key: _dump(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_dump(item) for item in value]
    return value


def _convert_field(spec: _FieldSpec, value: Any, path: str) -> Any:
    metadata = spec.field.metadata
    parser: Callable[[Any, str], Any] | None = metadata.get("parser")
    result = parser(value, path) if parser is not None else _convert(spec.type, value, path)
    for bound, symbol in _BOUNDS.items():
        if bound not in metadata or not isinstance(result, (int, float)):
            continue
        limit = metadata[bound]
        ok = {
            "ge": result >= limit,
            "gt": result > limit,
            "le": result <= limit,
            "lt": result < limit,
        }[bound]
        if not ok:
            config_fail(path, value, f"{_describe(spec.type)} {symbol} {limit:g}")
    return result


def _describe(tp: Any) -> str:
    """What a type accepts, in words, for error messages."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        members = [arg for arg in args if arg is not _NoneType]
        text = " or ".join(_describe(arg) for arg in members)
        return f"{text} or null" if len(members) < len(args) else text
    if origin is Literal:
        return "one of " + ", ".join(show_value(arg) for arg in args)
    if origin in (list, Sequence):
        return f"a list of {_plural(args[0]) if args else 'values'}"
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        return "an object"
    if isinstance(tp, type) and issubclass(tp, ConfigBlock):
        return f"an object (the {tp.__name__} block)"
    return {
        bool: "a boolean (true or false)",
        int: "an integer",
        float: "a number",
        str: "a string",
        Any: "any JSON value",
    }.get(tp, repr(tp))


def _plural(tp: Any) -> str:
    return {bool: "booleans", int: "integers", float: "numbers", str: "strings"}.get(
        tp, _describe(tp)
    )


def _convert(tp: Any, value: Any, path: str) -> Any:
    """Check ``value`` against the type ``tp`` and return it in canonical Python form."""
    if tp is Any:
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return _convert_union(tp, args, value, path)
    if origin is Literal:
        for choice in args:
            # `type(...) is` keeps true from matching a Literal[1] and 1 from matching true.
            if type(value) is type(choice) and value == choice:
                return value
        config_fail(path, value, _describe(tp))
    if origin in (list, Sequence):
        if not isinstance(value, (list, tuple)):
            config_fail(path, value, _describe(tp))
        item_type = args[0] if args else Any
        return [
            _convert(item_type, item, key_path(path, index)) for index, item in enumerate(value)
        ]
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        if not isinstance(value, Mapping):
            config_fail(path, value, _describe(tp))
        value_type = args[1] if len(args) == 2 else Any
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                config_fail(key_path(path, str(key)), key, "string keys")
            out[key] = _convert(value_type, item, key_path(path, key))
        return out
    if isinstance(tp, type) and issubclass(tp, ConfigBlock):
        if not isinstance(value, Mapping):
            config_fail(path, value, _describe(tp))
        return tp.from_dict(value, path)
    if tp is bool:
        if not isinstance(value, bool):
            config_fail(path, value, _describe(tp))
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            config_fail(path, value, _describe(tp))
        if isinstance(value, float):
            # DeepSpeed configs write sizes as 5e8, which JSON reads as a float.
            if not (math.isfinite(value) and value.is_integer()):
                config_fail(path, value, "an integer (a number with no fractional part)")
            return int(value)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            config_fail(path, value, _describe(tp))
        if not math.isfinite(value):
            config_fail(path, value, "a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            config_fail(path, value, _describe(tp))
        return value
    raise TypeError(f"unsupported config field type {tp!r} at {path!r}")


def _convert_union(tp: Any, args: tuple[Any, ...], value: Any, path: str) -> Any:
    if value is None:
        if _NoneType in args:
            return None
        config_fail(path, value, _describe(tp))
    members = [arg for arg in args if arg is not _NoneType]
    if len(members) == 1:
        try:
            return _convert(members[0], value, path)
        except ConfigError as error:
            if error.path != path:
                raise  # a problem inside a nested value: keep its own message
            config_fail(path, value, _describe(tp))
    for member in members:
        try:
            return _convert(member, value, path)
        except ConfigError:
            continue
    config_fail(path, value, _describe(tp))
