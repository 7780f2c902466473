"""Per-GPU launch table of the decode GEMVs: (device, fusion, N, K) -> :class:`DecodeGemvConfig`.

A decode GEMV is bound by how fast its weight streams, and the launch that streams it fastest
depends on the GPU (bandwidth, SM count, latency) as much as on the shape. Each launch is looked
up, first match wins, in:

1. the user table installed by :func:`use_launch_table` (``init_inference``'s
   ``decode_gemv_table`` key: a JSON file written by ``tools/bench/bf16_gemv_bench.py
   --table-out``, see :func:`load_launch_table` for the format);
2. :data:`BUILTIN_TABLE`, the launches measured by that sweep on the GPUs it ran on;
3. :func:`default_rule`, for every other GPU (ROCm included) and shape: the fewest output
   features per program (16 down to 2) that still give every SM four programs, a 512-wide
   K step, 4 warps, 3 stages, one program per block, no split-K.

An entry matches a device when its ``device`` string is contained in the device's name
(case-insensitive: ``"H200"`` matches ``"NVIDIA H200"`` and ``"NVIDIA H200 NVL"``) and its
``sms`` (when given) equals the device's multiprocessor count.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "BUILTIN_TABLE",
    "FUSIONS",
    "DecodeGemvConfig",
    "DeviceKey",
    "LaunchEntry",
    "LaunchTableError",
    "default_rule",
    "device_key",
    "load_launch_table",
    "lookup_launch",
    "parse_launch_table",
    "table_json",
    "use_launch_table",
]

TABLE_VERSION = 1
# The prologue each fusion runs (decode_gemv.triton's PLAIN, NORM, GATED), by its table name:
# "plain" = decode_gemv (output projection), "norm" = norm_gemv (residual add + RMSNorm: QKV,
# gate/up, LM head), "gated" = gated_gemv (SiLU * up: down projection).
FUSIONS = {"plain": 0, "norm": 1, "gated": 2}


@dataclasses.dataclass(frozen=True)
class DecodeGemvConfig:
    """Launch shape of one decode GEMV: output features per block, K step, warps, stages,
    programs per SM (0: one program per block; else a persistent grid of that many per SM),
    whether each step prefetches the next weight tile, K splits (>1: each block's K range
    is cut in ``split_k`` parts whose fp32 sums the last part to finish adds up), and whether
    it launches as a programmatic dependent launch (``pdl``)."""

    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 3  # Triton's default on NVIDIA GPUs
    programs_per_sm: int = 0
    prefetch: bool = False
    split_k: int = 1
    # Programmatic dependent launch (NVIDIA sm_90+; elsewhere a plain launch): the first weight
    # tile loads before waiting for the previous kernel, and the next kernel may start early.
    pdl: bool = False
    # With pdl: let the next kernel launch only when the program has streamed its weights
    # (else right after the wait, so its programs may hold SM slots while this one streams).
    late_trigger: bool = False
    # Load the first weight tile before the prologue (norm_gemv: while the row's RMS is
    # computed). Implied by pdl.
    early: bool = False
    # With pdl on sm_90: each program prefetches the whole rows of its first block into L2
    # before it waits for the previous kernel (the whole weight unless the grid is persistent),
    # so that a small weight after a latency-bound kernel (the output projection after
    # attention) streams while that kernel runs.
    l2_prefetch: bool = False
    # With l2_prefetch: at most this many of each program's blocks prefetched (0: all of them;
    # 1 on a persistent grid: the first block of every program, part of a large weight).
    l2_prefetch_blocks: int = 0
    # norm_gemv without split-K: no pass over the input row before the weights stream; the
    # row's sum of squares is taken in the K loop and 1 / rms scales the sum at the end (the
    # normalised input is then not rounded to the activation dtype first).
    defer_norm: bool = False
    # norm_gemv_rotary (the QKV projection at decode): rotary_kv_write's work in this launch's
    # epilogue (one kernel; needs block_n <= head_dim); else a second kernel does it.
    fold_rotary: bool = False


class LaunchTableError(ValueError):
    """A launch table (file or entries) that cannot be used; the message names where and why."""


@dataclasses.dataclass(frozen=True)
class DeviceKey:
    """What a table entry is matched against: the device's name and multiprocessor count."""

    name: str
    sms: int


@dataclasses.dataclass(frozen=True)
class LaunchEntry:
    """One launch: for ``fusion`` (a :data:`FUSIONS` name) at ``n`` x ``k`` on devices whose
    name contains ``device`` (and with ``sms`` multiprocessors, unless None)."""

    device: str
    sms: int | None
    fusion: str
    n: int
    k: int
    config: DecodeGemvConfig

    def matches(self, key: DeviceKey, fusion: str, n: int, k: int) -> bool:
        """Whether this entry is the launch for ``fusion`` at ``n`` x ``k`` on ``key``."""
        return (
            self.fusion == fusion
            and self.n == n
            and self.k == k
            and self.device.lower() in key.name.lower()
            and (self.sms is None or self.sms == key.sms)
        )


def _entries(device: str, sms: int, launches: Mapping[tuple[str, int, int], dict[str, Any]]):
    return [
        LaunchEntry(device, sms, fusion, n, k, DecodeGemvConfig(**launch))
        for (fusion, n, k), launch in launches.items()
    ]


# Llama-3-8B decode shapes: qkv 6144x4096 (norm), o 4096x4096 (plain), gate/up 28672x4096
# (norm), down 4096x14336 (gated), LM head 128256x4096 (norm).
# H100 SXM (132 SMs): the launches default_rule gives, with which decode_fusion measured 85.2%
# of the bandwidth limit on the 8B model (5.932 ms a step, tools/bench/infer_bench.py).
_H100 = {
    # fold_rotary: rotary_kv_write in QKV's epilogue, 32 kernels fewer a step: 5.782 against
    # 5.808 ms a step (GPU call B1, tools/bench/bf16_decode_variants.py)
    ("norm", 6144, 4096): {"block_n": 8, "fold_rotary": True},
    ("plain", 4096, 4096): {"block_n": 4},
    ("norm", 28672, 4096): {"block_n": 16},
    ("gated", 4096, 14336): {"block_n": 4},
    ("norm", 128256, 4096): {"block_n": 16},
}
# H200 (132 SMs): bf16_gemv_bench.py's sweep (GPU call B1, copy bandwidth 4.25 TB/s; 40-50
# launches a shape): QKV 19.81 -> 18.16 us, gate/up 70.29 -> 62.92, head 286.9 -> 265.9; for the
# output and down projections nothing beat the default launch by more than 0.2% (kept). The
# whole 8B step went from 206.6 to 219.4 tokens/s (76.8% -> 79.8% of the bandwidth limit).
_H200: dict[tuple[str, int, int], dict[str, Any]] = {
    # fold_rotary as on the H100 (one kernel fewer per block; same math)
    ("norm", 6144, 4096): {"block_n": 32, "block_k": 512, "num_warps": 4, "fold_rotary": True},
    ("plain", 4096, 4096): {"block_n": 4, "block_k": 512, "num_warps": 4},
    ("norm", 28672, 4096): {"block_n": 8, "programs_per_sm": 4, "prefetch": True},
    ("gated", 4096, 14336): {"block_n": 4, "block_k": 512, "num_warps": 4},
    ("norm", 128256, 4096): {"block_n": 32, "block_k": 256, "num_warps": 4},
}

# Tensor-parallel shards of the 8B model at TP=2 (per rank: QKV 3072x4096, output 4096x2048,
# gate/up 14336x4096, down 4096x7168, head 64128x4096). H100: bf16_gemv_bench.py's sweep
# (GPU call B1, copy bandwidth 3.0 TB/s): the fastest tiles, in us against the default rule's
# QKV 10.8 (12.04), output 6.51 (7.73), gate/up 42.02 (45.05), down 21.41 (22.34), head 172.6
# (178.89). The sweep's best four were pdl launches, timed back to back with themselves; pdl
# is left to decode_pdl here (the whole TP=1 step was 9% slower with it on an H100).
_H100_TP2: dict[tuple[str, int, int], dict[str, Any]] = {
    # (QKV also folds the rotary, as at TP=1: one kernel fewer per block)
    ("norm", 3072, 4096): {"block_n": 8, "block_k": 512, "prefetch": True, "fold_rotary": True},
    ("plain", 4096, 2048): {"block_n": 8, "block_k": 512, "num_stages": 4, "prefetch": True},
    ("norm", 14336, 4096): {"block_n": 4, "block_k": 1024},
    ("gated", 4096, 7168): {"block_n": 8, "block_k": 512, "prefetch": True},
    ("norm", 64128, 4096): {"block_n": 4, "block_k": 1024, "num_stages": 4},
}

BUILTIN_TABLE: tuple[LaunchEntry, ...] = tuple(
    _entries("H100", 132, {**_H100, **_H100_TP2}) + _entries("H200", 132, _H200)
)

_user_table: tuple[LaunchEntry, ...] = ()
# (fusion, N, K, device) -> lookup_launch's answer; emptied when the user table changes.
_found: dict[tuple[str, int, int, DeviceKey], tuple[DecodeGemvConfig, str]] = {}


def default_rule(out_features: int, in_features: int, sms: int) -> DecodeGemvConfig:
    """The launch for a GPU or shape no table lists: output features per block chosen so that
    there are at least four programs per SM (every SM keeps several tiles in flight), a
    512-wide K step (16 KiB of bf16 weight per step at 16 rows), 4 warps, no split."""
    block_n = 16
    while block_n > 2 and -(-out_features // block_n) < 4 * sms:
        block_n //= 2
    return DecodeGemvConfig(block_n=block_n, block_k=512, num_warps=4)


@functools.cache
def _cuda_key(index: int) -> DeviceKey:
    props = torch.cuda.get_device_properties(index)
    return DeviceKey(torch.cuda.get_device_name(index), int(props.multi_processor_count))


def device_key(device: torch.device) -> DeviceKey:
    """``device``'s name and multiprocessor count (the CPU interpreter: ``"cpu"``, 8)."""
    if device.type != "cuda":
        return DeviceKey(device.type, 8)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_key(index)


def lookup_launch(
    fusion: str, out_features: int, in_features: int, device: torch.device | DeviceKey
) -> tuple[DecodeGemvConfig, str]:
    """The launch for ``fusion`` (``"plain"``, ``"norm"``, ``"gated"``) at ``out_features`` x
    ``in_features`` on ``device`` (or a device described by its :class:`DeviceKey`), and where
    it came from (``"user"``, ``"builtin"``, ``"default"``): the user table, then
    :data:`BUILTIN_TABLE`, then :func:`default_rule`."""
    key = device if isinstance(device, DeviceKey) else device_key(device)
    cached = _found.get((fusion, out_features, in_features, key))
    if cached is not None:
        return cached
    found = default_rule(out_features, in_features, key.sms), "default"
    for source, table in (("user", _user_table), ("builtin", BUILTIN_TABLE)):
        match = next((e for e in table if e.matches(key, fusion, out_features, in_features)), None)
        if match is not None:
            found = match.config, source
            break
    _found[(fusion, out_features, in_features, key)] = found
    return found


def use_launch_table(entries: Iterable[LaunchEntry] | None) -> None:
    """Install ``entries`` as the user table, looked up before the built-in one (None or
    empty: none). Process-wide: the last table installed serves every model."""
    global _user_table
    _user_table = tuple(entries or ())
    _found.clear()


_POW2_FIELDS = ("block_n", "block_k", "num_warps")
_ENTRY_KEYS = {"device", "sms", "fusion", "n", "k"}
_LAUNCH_KEYS = {field.name for field in dataclasses.fields(DecodeGemvConfig)}


def _check_int(where: str, name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise LaunchTableError(f"{where}: {name!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _parse_entry(raw: object, where: str) -> LaunchEntry:
    if not isinstance(raw, dict):
        raise LaunchTableError(f"{where}: an entry must be a JSON object, got {raw!r}")
    unknown = sorted(set(raw) - _ENTRY_KEYS - _LAUNCH_KEYS)
    if unknown:
        raise LaunchTableError(
            f"{where}: unknown key(s) {unknown}; an entry has {sorted(_ENTRY_KEYS)} and the "
            f"launch fields {sorted(_LAUNCH_KEYS)}"
        )
    missing = sorted({"device", "fusion", "n", "k", *_POW2_FIELDS} - set(raw))
    if missing:
        raise LaunchTableError(f"{where}: missing key(s) {missing}")
    device = raw["device"]
    if not isinstance(device, str) or not device.strip():
        raise LaunchTableError(f"{where}: 'device' must be a non-empty string, got {device!r}")
    if raw["fusion"] not in FUSIONS:
        raise LaunchTableError(
            f"{where}: 'fusion' must be one of {sorted(FUSIONS)}, got {raw['fusion']!r}"
        )
    sms = raw.get("sms")
    if sms is not None:
        _check_int(where, "sms", sms, 1)
    n, k = _check_int(where, "n", raw["n"], 1), _check_int(where, "k", raw["k"], 1)
    launch = {name: raw[name] for name in _LAUNCH_KEYS if name in raw}
    for name in _POW2_FIELDS:
        value = _check_int(where, name, launch[name], 1)
        if value & (value - 1):
            raise LaunchTableError(f"{where}: {name!r} must be a power of two, got {value}")
    for name, minimum in (
        ("num_stages", 1),
        ("programs_per_sm", 0),
        ("split_k", 1),
        ("l2_prefetch_blocks", 0),
    ):
        if name in launch:
            _check_int(where, name, launch[name], minimum)
    flags = ("prefetch", "pdl", "late_trigger", "early", "l2_prefetch", "defer_norm")
    for name in (*flags, "fold_rotary"):
        if not isinstance(launch.get(name, False), bool):
            raise LaunchTableError(f"{where}: {name!r} must be true or false")
    return LaunchEntry(device.strip(), sms, raw["fusion"], n, k, DecodeGemvConfig(**launch))


def parse_launch_table(data: object, source: str = "launch table") -> list[LaunchEntry]:
    """The entries of a launch table's JSON value ``{"version": 1, "entries": [...]}``, each
    ``{"device": "H200", "sms": 132, "fusion": "norm", "n": 6144, "k": 4096, "block_n": 8,
    "block_k": 512, "num_warps": 4}`` plus optional ``num_stages``, ``programs_per_sm``,
    ``prefetch``, ``split_k``, ``pdl``, ``late_trigger``, ``early``, ``l2_prefetch``,
    ``l2_prefetch_blocks``,
    ``defer_norm``, ``fold_rotary`` (:class:`DecodeGemvConfig`'s defaults otherwise; ``sms`` null or absent:
    any count).
    Raises :class:`LaunchTableError` naming ``source`` and the entry."""
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        raise LaunchTableError(
            f"{source}: expected a JSON object with an 'entries' list "
            f'({{"version": {TABLE_VERSION}, "entries": [...]}}), got {type(data).__name__}'
        )
    version = data.get("version", TABLE_VERSION)
    if version != TABLE_VERSION:
        raise LaunchTableError(f"{source}: version {version!r} is not {TABLE_VERSION}")
    extra = sorted(set(data) - {"version", "entries", "measured"})
    if extra:
        raise LaunchTableError(f"{source}: unknown top-level key(s) {extra}")
    return [_parse_entry(raw, f"{source}: entries[{i}]") for i, raw in enumerate(data["entries"])]


def load_launch_table(path: str | os.PathLike[str]) -> list[LaunchEntry]:
    """Read and check a launch table file (JSON, :func:`parse_launch_table`'s format)."""
    try:
        with open(path) as handle:
            data = json.load(handle)
    except OSError as error:
        raise LaunchTableError(f"decode GEMV launch table {os.fspath(path)!r}: {error}") from error
    except json.JSONDecodeError as error:
        raise LaunchTableError(
            f"decode GEMV launch table {os.fspath(path)!r} is not JSON: {error}"
        ) from error
    return parse_launch_table(data, f"decode GEMV launch table {os.fspath(path)!r}")


def table_json(entries: Sequence[LaunchEntry], measured: object = None) -> dict[str, Any]:
    """The JSON value of a table holding ``entries`` (``measured``: free-form provenance)."""
    rows = []
    for entry in entries:
        row: dict[str, Any] = {
            "device": entry.device,
            "sms": entry.sms,
            "fusion": entry.fusion,
            "n": entry.n,
            "k": entry.k,
        }
        row.update(dataclasses.asdict(entry.config))
        rows.append(row)
    table: dict[str, Any] = {"version": TABLE_VERSION, "entries": rows}
    if measured is not None:
        table["measured"] = measured
    return table
