"""Expansion of SLURM-style compressed host lists such as ``gpu[01-03,07],cpu5``."""

from __future__ import annotations

import itertools

__all__ = ["expand_nodelist"]


def _split_top_level(text: str, separator: str = ",") -> list[str]:
    """Split on `separator` outside of brackets; raise on unbalanced brackets."""
    parts: list[str] = []
    depth = 0
    start = 0
    for index, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError(
                    f"nodelist {text!r} nests '[' at position {index}; "
                    "ranges look like 'node[01-04,07]'"
                )
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"nodelist {text!r} has ']' without '[' at position {index}")
        elif char == separator and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    if depth != 0:
        raise ValueError(f"nodelist {text!r} has an unclosed '['")
    parts.append(text[start:])
    return parts


def _expand_range_set(body: str, nodelist: str) -> list[str]:
    """Expand the inside of one bracket, e.g. ``01-03,07`` -> ``01 02 03 07`` (padding kept)."""
    values: list[str] = []
    for item in body.split(","):
        item = item.strip()
        if not item:
            raise ValueError(f"nodelist {nodelist!r} has an empty item in '[{body}]'")
        low, dash, high = item.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(
                f"nodelist {nodelist!r}: '{item}' in '[{body}]' is not a number or a range "
                "like '01-04'"
            )
        if not dash:
            values.append(low)
            continue
        first, last = int(low), int(high)
        if last < first:
            raise ValueError(
                f"nodelist {nodelist!r}: range '{item}' ends before it starts; write it as "
                f"'{high}-{low}'"
            )
        # SLURM pads every number of a range to the width of its first bound ("01-10").
        width = len(low) if low.startswith("0") else 0
        values.extend(str(number).zfill(width) for number in range(first, last + 1))
    return values


def _expand_one(pattern: str, nodelist: str) -> list[str]:
    """Expand one host pattern, which may hold several bracket groups (a cartesian product)."""
    pieces: list[list[str]] = []
    rest = pattern
    while rest:
        open_at = rest.find("[")
        if open_at < 0:
            pieces.append([rest])
            break
        close_at = rest.find("]", open_at)
        if open_at > 0:
            pieces.append([rest[:open_at]])
        pieces.append(_expand_range_set(rest[open_at + 1 : close_at], nodelist))
        rest = rest[close_at + 1 :]
    return ["".join(combo) for combo in itertools.product(*pieces)]


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM compressed host list into host names, in order.

    Handles comma-separated items, bracketed ranges and lists with zero padding, and several
    bracket groups in one name (their cartesian product, as SLURM does).

    >>> expand_nodelist("gpu[01-03,07],cpu5")
    ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'cpu5']
    >>> expand_nodelist("rack[1-2]-n[1-2]")
    ['rack1-n1', 'rack1-n2', 'rack2-n1', 'rack2-n2']

    Raises:
        ValueError: if the list is empty or malformed (the message names the bad part).
    """
    text = nodelist.strip()
    if not text:
        raise ValueError("nodelist is empty; expected something like 'node[01-04],login1'")
    hosts: list[str] = []
    for item in _split_top_level(text):
        item = item.strip()
        if not item:
            raise ValueError(f"nodelist {nodelist!r} has an empty item between commas")
        hosts.extend(_expand_one(item, nodelist))
    return hosts
