"""Hostfiles (``worker-0 slots=8``) and DeepSpeed's ``--include``/``--exclude`` filters."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterable

__all__ = [
    "Resources",
    "decode_world_info",
    "encode_world_info",
    "filter_resources",
    "limit_resources",
    "parse_hostfile",
    "parse_node_specs",
]

# host -> device slot indices used on it, in hostfile order.
Resources = dict[str, list[int]]

_SLOTS = re.compile(r"^slots=(\d+)$")


def parse_hostfile(text: str, source: str = "hostfile") -> dict[str, int]:
    """Parse DeepSpeed/MPI hostfile text into ``{host: slot count}`` (file order kept).

    One host per line: ``hostname slots=N``. Blank lines and ``#`` comments (whole-line or
    trailing) are ignored.

    >>> parse_hostfile("worker-0 slots=4\\n# spare\\nworker-1 slots=2  # older GPUs\\n")
    {'worker-0': 4, 'worker-1': 2}

    Raises:
        ValueError: on a malformed line, a repeated host, zero slots or no hosts at all; the
            message names `source` and the line number.
    """
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        match = _SLOTS.match(fields[1]) if len(fields) == 2 else None
        if match is None:
            raise ValueError(
                f"{source}:{number}: {raw.strip()!r} is not 'hostname slots=N' "
                "(one host per line; '#' starts a comment)"
            )
        host, slots = fields[0], int(match.group(1))
        if host in hosts:
            raise ValueError(f"{source}:{number}: host {host!r} is listed twice; keep one line")
        if slots < 1:
            raise ValueError(f"{source}:{number}: host {host!r} has slots={slots}; need >= 1")
        hosts[host] = slots
    if not hosts:
        raise ValueError(f"{source} lists no hosts; add lines like 'worker-0 slots=8'")
    return hosts


def parse_node_specs(spec: str, option: str = "--include") -> dict[str, list[int]]:
    """Parse ``NODE[:SLOT[,SLOT...]][@NODE...]`` into ``{host: sorted slots}`` ([] = all slots).

    >>> parse_node_specs("worker-0:0,2@worker-1")
    {'worker-0': [0, 2], 'worker-1': []}
    """
    nodes: dict[str, list[int]] = {}
    for item in spec.split("@"):
        host, colon, slot_text = item.strip().partition(":")
        if not host:
            raise ValueError(
                f"{option} {spec!r} has an empty node name; the form is "
                "'worker-0:0,2@worker-1' (node[:slot,slot...] joined by '@')"
            )
        slots: list[int] = []
        if colon:
            for slot in slot_text.split(","):
                if not slot.strip().isdigit():
                    raise ValueError(
                        f"{option} {spec!r}: slot {slot!r} of {host!r} is not a non-negative "
                        "integer; list slots like 'worker-0:0,2'"
                    )
                slots.append(int(slot))
        if host in nodes and (not nodes[host]) != (not slots):
            raise ValueError(
                f"{option} {spec!r} names {host!r} both whole and with slots; use one form"
            )
        nodes[host] = sorted(set(nodes.get(host, []) + slots))
    return nodes


def filter_resources(pool: Resources, include: str = "", exclude: str = "") -> Resources:
    """Apply DeepSpeed's ``--include`` or ``--exclude`` to `pool` (they are exclusive).

    `include` keeps only the named hosts (all their slots, or the listed ones); `exclude`
    drops whole hosts or single slots. Hosts left with no slots disappear. Host order stays
    that of `pool`, since it fixes which ranks land where.

    Raises:
        ValueError: both filters given, an unknown host or slot, or nothing left.
    """
    if include and exclude:
        raise ValueError(
            f"--include {include!r} and --exclude {exclude!r} are mutually exclusive; use one"
        )
    if not include and not exclude:
        return {host: list(slots) for host, slots in pool.items()}
    option = "--include" if include else "--exclude"
    spec = include or exclude
    wanted = parse_node_specs(spec, option)
    for host, slots in wanted.items():
        if host not in pool:
            raise ValueError(
                f"{option} names host {host!r}, which is not among the available hosts "
                f"{sorted(pool)}; check the hostfile"
            )
        missing = sorted(set(slots) - set(pool[host]))
        if missing:
            raise ValueError(
                f"{option}: host {host!r} has no slot(s) {missing}; its slots are {pool[host]}"
            )
    result: Resources = {}
    for host, slots in pool.items():
        if include:
            if host in wanted:
                result[host] = wanted[host] or list(slots)
        elif host not in wanted:
            result[host] = list(slots)
        elif wanted[host]:
            result[host] = [slot for slot in slots if slot not in wanted[host]]
        if host in result and not result[host]:
            del result[host]
    if not result:
        raise ValueError(f"{option} {spec!r} leaves no hosts to run on")
    return result


def limit_resources(pool: Resources, num_nodes: int = -1, procs_per_node: int = -1) -> Resources:
    """Keep the first `num_nodes` hosts and use slots ``0..procs_per_node-1`` on each (-1: all)."""
    if num_nodes == 0 or num_nodes < -1:
        raise ValueError(f"--num_nodes {num_nodes} must be a positive number of nodes")
    if procs_per_node == 0 or procs_per_node < -1:
        raise ValueError(f"--num_procs {procs_per_node} must be a positive number of processes")
    hosts = list(pool)
    if num_nodes > len(hosts):
        raise ValueError(
            f"--num_nodes {num_nodes} asks for more nodes than the {len(hosts)} available "
            f"({hosts}); list more hosts in the hostfile or lower --num_nodes"
        )
    if num_nodes > 0:
        hosts = hosts[:num_nodes]
    return {
        host: list(range(procs_per_node)) if procs_per_node > 0 else list(pool[host])
        for host in hosts
    }


def encode_world_info(resources: Resources) -> str:
    """Pack the host -> slots layout for the per-node launchers' command line."""
    payload = json.dumps([[host, slots] for host, slots in resources.items()])
    return base64.urlsafe_b64encode(payload.encode()).decode()


def decode_world_info(text: str) -> Resources:
    """Inverse of :func:`encode_world_info`."""
    try:
        items: Iterable[list] = json.loads(base64.urlsafe_b64decode(text.encode()))
        return {str(host): [int(slot) for slot in slots] for host, slots in items}
    except (ValueError, TypeError) as error:
        raise ValueError(
            f"--world_info {text!r} is not a layout written by slipstream run"
        ) from error
