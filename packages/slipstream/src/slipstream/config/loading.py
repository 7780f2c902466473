"""Turn a config source (dict, path, JSON text or base64 JSON) into a plain dict."""

from __future__ import annotations

import base64
import binascii
import copy
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeAlias

from slipstream.kernels.config_schema import ConfigError

__all__ = ["ConfigSource", "parse_config_text", "read_config_source", "strip_json_comments"]

ConfigSource: TypeAlias = Mapping[str, Any] | str | os.PathLike | bytes

_BASE64 = re.compile(r"^[A-Za-z0-9+/_=\-\s]+$")


def read_config_source(source: ConfigSource) -> tuple[dict[str, Any], str]:
    """Read ``source`` into a fresh dict; also return where it came from, for messages.

    A Mapping is deep-copied. A string is JSON text when it starts with ``{`` (or ``[``, to report it), else the path
    of an existing file, else base64 of JSON (what DeepSpeed accepts on the command line);
    anything else is reported as a missing file. JSON may hold ``//`` and ``/* */``
    comments and trailing commas.
    """
    if isinstance(source, Mapping):
        return _checked_top_level(copy.deepcopy(dict(source)), "the config dict"), "the config dict"
    if isinstance(source, bytes):
        source = source.decode("utf-8")
    if isinstance(source, os.PathLike):
        return _read_file(Path(source))
    if not isinstance(source, str):
        raise ConfigError(
            f"a config must be a dict, a path to a JSON file, JSON text or base64-encoded JSON; "
            f"got {type(source).__name__}"
        )
    text = source.strip()
    if text.startswith(("{", "[")):
        # Parse `source`, not `text`: stripping leading lines would shift error line numbers.
        return parse_config_text(source, "the config JSON text"), "the config JSON text"
    if text and os.path.exists(text):
        return _read_file(Path(text))
    decoded = _decode_base64(text)
    if decoded is not None:
        return parse_config_text(decoded, "the base64-encoded config"), "the base64-encoded config"
    shown = text if len(text) <= 200 else text[:197] + "..."
    raise ConfigError(
        f"config file not found: '{shown}' (resolved to '{Path(text).absolute()}'). Pass the "
        "path of an existing JSON file, a dict, JSON text or base64-encoded JSON."
    )


def _read_file(path: Path) -> tuple[dict[str, Any], str]:
    origin = f"config file '{path}'"
    if not path.exists():
        raise ConfigError(
            f"config file not found: '{path}' (resolved to '{path.absolute()}'). Pass the path "
            "of an existing JSON file, a dict, JSON text or base64-encoded JSON."
        )
    if path.is_dir():
        raise ConfigError(f"config path '{path}' is a directory; pass the JSON file inside it")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read {origin}: {error}") from error
    return parse_config_text(text, origin), origin


def _decode_base64(text: str) -> str | None:
    """The decoded text if ``text`` is base64 (standard or URL-safe) of a JSON object."""
    if not text or not _BASE64.match(text):
        return None
    compact = "".join(text.split())
    compact += "=" * (-len(compact) % 4)
    try:
        if "-" in compact or "_" in compact:
            raw = base64.urlsafe_b64decode(compact)
        else:
            raw = base64.b64decode(compact, validate=True)
        decoded = raw.decode("utf-8")
    except (binascii.Error, ValueError, UnicodeDecodeError):
        return None
    return decoded if decoded.lstrip().startswith("{") else None


def strip_json_comments(text: str, origin: str = "the config") -> str:
    """Blank out ``//`` and ``/* */`` comments and trailing commas outside JSON strings.

    Removed characters become spaces (newlines are kept), so line and column numbers in
    later JSON errors still point into the text the user wrote.
    """
    out = list(text)
    index, length = 0, len(text)
    in_string = False
    pending_comma: int | None = None  # a comma that is trailing if a '}' or ']' comes next
    previous = ""  # the last significant character outside strings and comments
    while index < length:
        char = text[index]
        if in_string:
            if char == "\\":
                index += 2
                continue
            if char == '"':
                in_string = False
            index += 1
            continue
        nxt = text[index + 1] if index + 1 < length else ""
        if char == "/" and nxt == "/":
            end = text.find("\n", index)
            end = length if end < 0 else end
            _blank(out, index, end)
            index = end
            continue
        if char == "/" and nxt == "*":
            end = text.find("*/", index + 2)
            if end < 0:
                line, column = _line_column(text, index)
                raise ConfigError(
                    f"invalid JSON in {origin} at line {line}, column {column}: a '/*' comment "
                    "is never closed with '*/'"
                )
            _blank(out, index, end + 2)
            index = end + 2
            continue
        if char in "}]" and pending_comma is not None:
            out[pending_comma] = " "
        if char == '"':
            in_string = True
        if char == "," and previous not in ("", "[", "{", ","):
            pending_comma = index
        elif not char.isspace():
            pending_comma = None
        if not char.isspace():
            previous = char
        index += 1
    return "".join(out)


def _blank(out: list[str], start: int, end: int) -> None:
    for position in range(start, end):
        if out[position] != "\n":
            out[position] = " "


def _line_column(text: str, index: int) -> tuple[int, int]:
    line = text.count("\n", 0, index) + 1
    return line, index - (text.rfind("\n", 0, index) + 1) + 1


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(
                f"duplicate config key '{key}': it appears twice in the same JSON object; "
                "keep one (JSON keeps only the last, which hides mistakes)"
            )
        out[key] = value
    return out


def parse_config_text(text: str, origin: str = "the config") -> dict[str, Any]:
    """Parse JSON config text (comments and trailing commas allowed) into a dict."""
    cleaned = strip_json_comments(text, origin)
    try:
        data = json.loads(cleaned, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as error:
        lines = text.splitlines() or [""]
        shown = lines[error.lineno - 1] if error.lineno - 1 < len(lines) else ""
        caret = " " * (error.colno - 1) + "^"
        raise ConfigError(
            f"invalid JSON in {origin} at line {error.lineno}, column {error.colno}: "
            f"{error.msg}\n    {shown}\n    {caret}"
        ) from None
    return _checked_top_level(data, origin)


def _checked_top_level(data: Any, origin: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ConfigError(
            f"{origin} must be a JSON object ({{...}}) at the top level, got {type(data).__name__}"
        )
    for key in data:
        if not isinstance(key, str):
            raise ConfigError(f"config keys must be strings; {origin} has the key {key!r}")
    return data
