"""Per-GPU launch table of the fused quantized decode GEMVs (``quant_decode_gemv`` / ``_qkv``).

A batch-1 quantized decode GEMV is bound by how fast its packed weight streams, and the launch
that streams it fastest depends on the GPU as much as on the shape. Each launch of
:mod:`.fused_gemv` is looked up, first match wins, in:

1. the user table installed by :func:`use_fused_table` (``init_inference``'s
   ``quant.weight.decode_gemv_table`` key: a JSON file written by
   ``tools/bench/quant_decode_bench.py --table-out``; format in :func:`parse_fused_table`);
2. :data:`BUILTIN_TABLE`, the launches that sweep measured on the GPUs it ran on;
3. the rule (:func:`fused_gemv._default_config`): ``gemv.GEMV_TABLE``'s tile for the shape
   (swept on the unfused kernel), one K range, the built-in grid.

Entries are keyed by the weight format (``int4``, ``int8``, ``fp8_e4m3``), the fusion (what the
launch folds in, :data:`FUSIONS`), the shape ``n`` x ``k`` and the device: an entry matches when
its ``device`` string is contained in the device's name (case-insensitive) and its ``sms`` (when
given) equals the device's multiprocessor count.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = [
    "BUILTIN_TABLE",
    "FUSIONS",
    "FusedEntry",
    "FusedGemvConfig",
    "FusedTableError",
    "fused_table_json",
    "load_fused_table",
    "lookup_fused",
    "parse_fused_table",
    "use_fused_table",
]

TABLE_VERSION = 1
# What a launch folds in (the table's name for it): "qkv" = norm prologue + rotary / KV-cache
# epilogue; "gate_up" = norm prologue + SiLU * up epilogue; "add_norm" = residual add + next
# norm's weight epilogue (output, down projections); "norm" = norm prologue only (a quantized LM
# head, or a QKV without the attention fused); "plain" = neither.
FUSIONS = ("qkv", "gate_up", "add_norm", "norm", "plain")


@dataclasses.dataclass(frozen=True)
class FusedGemvConfig:
    """Launch of ``fused_gemv_kernel``: weight rows per program (``block_n``, a power of two,
    at least 2 for the paired ``qkv`` / ``gate_up`` epilogues), warps (which fix the K step:
    ``gemv.gemv_block_k``), pipeline stages, the f16x2 unpacking (``half2``: NVIDIA, int4 /
    int8 with 16-bit activations; elsewhere the fp32 path runs), the next tile loaded before
    the current one's math (``prefetch``), ``split_k`` K ranges per block (the last to finish
    adds the fp32 sums and runs the epilogue), ``programs_per_sm`` (0: one program per
    block, a persistent grid for an LM head's many blocks; N: a persistent grid of N per SM)
    ``two_step`` (the prefetching loop's variant), ``stats_one_pass`` and ``early_epilogue``
    (where the prologue's and epilogue's small loads are issued), ``late_trigger`` and
    ``l2_prefetch`` (programmatic dependent launch details; see below)."""

    block_n: int = 4
    num_warps: int = 1
    num_stages: int = 2
    half2: bool = True
    prefetch: bool = True
    split_k: int = 1
    programs_per_sm: int = 0
    # With prefetch: two K steps an iteration with the tile pointers computed once per block
    # and the norm's partial sums read in one pass: 19-30% fewer instructions per step (sm_90
    # SASS) but 30-80% more registers (fewer programs resident). On an H100 (call B2) the int8
    # step with it and the table below ran 3.709 ms against 3.785 without (call B1); the int4
    # step with it and that sweep's int4 launches 2.780 against 2.577, so it is off by default.
    two_step: bool = False
    # The norm prologue's partial sums (one per program of the producing GEMV: 1024 for an 8B
    # model's output or down projection at 4 rows a program) read in one load, a single L2
    # round trip after the wait for the producer, instead of passes of 256 one after another
    # (four round trips on the first tile's critical path). two_step implies it.
    stats_one_pass: bool = False
    # The epilogue's inputs (QKV: the rotary tables and the cache slot; add_norm: the residual
    # and the next norm's weight) loaded before the K loop, their latency hidden behind it,
    # instead of after it on the way to the stores.
    early_epilogue: bool = False
    # With prefetch and the f16x2 unpacking: each K step's activations loaded a step ahead
    # with its weight tile, not when the step's math needs them (an L2 round trip on the
    # critical path of every step otherwise; the activations are the previous kernel's output).
    x_ahead: bool = False
    # With programmatic dependent launch: each program lets the next kernel launch only after
    # its wait for the previous one (griddepcontrol.launch_dependents after .wait), not at its
    # start, so the next GEMV's programs (and their L2 prefetch) are not scheduled while this
    # one still waits (e.g. the output projection's, behind decode_attention).
    late_trigger: bool = False
    # With programmatic dependent launch: the L2 prefetch of the weight before the wait (as
    # quant.weight.decode_pdl chooses it); False: none for this launch.
    l2_prefetch: bool = True


class FusedTableError(ValueError):
    """A launch table that cannot be used; the message names where and why."""


@dataclasses.dataclass(frozen=True)
class FusedEntry:
    """One launch: ``format`` weights with ``fusion`` at ``n`` x ``k`` on devices whose name
    contains ``device`` (and with ``sms`` multiprocessors, unless None)."""

    device: str
    sms: int | None
    format: str
    fusion: str
    n: int
    k: int
    config: FusedGemvConfig

    def matches(self, name: str, sms: int, format: str, fusion: str, n: int, k: int) -> bool:
        """Whether this entry is the launch for that weight on that device."""
        return (
            (self.format, self.fusion, self.n, self.k) == (format, fusion, n, k)
            and self.device.lower() in name.lower()
            and (self.sms is None or self.sms == sms)
        )


def _entries(
    device: str, sms: int, launches: Mapping[tuple[str, str, int, int], dict[str, Any]]
) -> list[FusedEntry]:
    return [
        FusedEntry(device, sms, fmt, fusion, n, k, FusedGemvConfig(**launch))
        for (fmt, fusion, n, k), launch in launches.items()
    ]


# Llama-3-8B shapes: qkv 6144x4096, output 4096x4096 (add_norm), gate/up 28672x4096,
# down 4096x14336 (add_norm), LM head 128256x4096 (norm, when quantized). A quantized head, at
# the blocks' width or its own (an int8 head behind int4 blocks: quant.weight.lm_head_bits), has
# no entry yet: it takes the rule, gemv.GEMV_TABLE's tile for its format and shape (the unfused
# sweep's: int4 1 warp, int8 4 warps, 4 rows a program; 0.99 / 1.04 of the copy bandwidth).
# H100 SXM (132 SMs), int8: the launches of call B2 (quant_decode_bench.py --quick, then the 8B
# step with them: 3.709 ms a step against 3.785 with the rule in call B1, 1.58x bf16's 5.876 ms
# in the same process). Stand-alone, against the rule with two_step: qkv 16.26 -> 12.41 us,
# output 8.98 -> 8.53, gate/up 47.87 -> 46.42; down kept the rule's tile (26.68 us, 0.76 of the
# copy bandwidth). No H200 entries: nothing was measured there.
_H100_INT8: dict[tuple[str, str, int, int], dict[str, Any]] = {
    ("int8", "qkv", 6144, 4096): {"block_n": 8, "num_warps": 2, "two_step": True},
    ("int8", "add_norm", 4096, 4096): {"block_n": 8, "num_warps": 2, "two_step": True},
    ("int8", "gate_up", 28672, 4096): {
        "block_n": 8,
        "num_warps": 1,
        "num_stages": 3,
        "prefetch": False,
        "two_step": True,
    },
    ("int8", "add_norm", 4096, 14336): {"block_n": 4, "num_warps": 2, "two_step": True},
}
# H100 SXM, int4: the launches of call B1 of 2026-11-26 11:29 (quant_decode_bench.py --quick,
# then the 8B step with them in tools/bench/quant_decode_variants.py, interleaved rounds in one
# process beside bf16): 2.394 ms a step against 2.635 with the rule (bf16 5.712 ms); each alone
# on top of the rule: QKV 2.533, output 2.575, gate/up 2.610, down 2.545 ms. With the prologue /
# epilogue fields (call B2, 11:57): 2.356 ms against 2.414 without them (bf16 5.709 ms: 2.42x),
# QKV's alone 2.384, output's and down's 2.399, gate/up's 2.414. (Call B2 of the evening before
# had measured an earlier sweep's int4 launches slower, 2.780 against 2.577 ms, from the
# difference of two generate calls in separate runs, which moves by 0.1-0.3 ms from run to run;
# the device-clock timing above repeats to 0.01-0.03 ms.)
# QKV and down re-swept with fp16 scales (quant.weight.scale_dtype's default) in call S4 of
# 2026-11-26 14:31 (branch q6: quant_decode_bench.py --quick --format int4 --fields
# stats_one_pass=true,early_epilogue=true): QKV 10.10 -> 8.19 us a call (block_n 8 / 2 warps ->
# 4 / 1 warp, two_step), down 14.74 -> 13.76 (split_k 4 -> one K range, 4 rows, 2 warps,
# two_step); output and gate/up kept theirs (the sweep's best within 0.4%). The 8B step with the
# two in quant_decode_variants.py (one process, interleaved rounds): 2.342 ms against 2.389 with
# the launches before (bf16 5.714 ms: 2.44x against 2.39x). The output projection's two_step:
# call S5 (one process, on top of those): 2.3417 ms against 2.3478 (best; medians 2.3463 /
# 2.3488), with decode_pdl "auto" then "on".
# QKV's x_ahead (its activations loaded a step ahead: the QKV weight is in L2 from the PDL
# prefetch, so each step's L2 round trip for the activations was the loop's critical path):
# evening call I of 2026-11-26 (quant_decode_variants.py, 3 rounds, one process): 2.2858 ms
# against 2.3199 (bf16 5.6871); call J: 2.2907 against 2.3185 (bf16 5.6862). On the output,
# gate/up and down projections it was slower (call I: 2.3384, 2.3483, 2.4607 ms; all four
# 2.4842), and on int8 neutral (call J: QKV 3.3868, output 3.3837 against 3.3886 ms).
_H100_INT4: dict[tuple[str, str, int, int], dict[str, Any]] = {
    ("int4", "qkv", 6144, 4096): {
        "block_n": 4,
        "num_warps": 1,
        "two_step": True,
        "stats_one_pass": True,
        "early_epilogue": True,
        "x_ahead": True,
    },
    ("int4", "add_norm", 4096, 4096): {
        "block_n": 4,
        "num_warps": 2,
        "two_step": True,
        "early_epilogue": True,
    },
    ("int4", "gate_up", 28672, 4096): {
        "block_n": 16,
        "num_warps": 1,
        "programs_per_sm": 8,
        "stats_one_pass": True,
    },
    ("int4", "add_norm", 4096, 14336): {
        "block_n": 4,
        "num_warps": 2,
        "two_step": True,
        "stats_one_pass": True,
        "early_epilogue": True,
    },
}
BUILTIN_TABLE: tuple[FusedEntry, ...] = tuple(_entries("H100", 132, {**_H100_INT8, **_H100_INT4}))

_user_table: tuple[FusedEntry, ...] = ()


@functools.cache
def _cuda_key(index: int) -> tuple[str, int]:
    props = torch.cuda.get_device_properties(index)
    return torch.cuda.get_device_name(index), int(props.multi_processor_count)


def _device_key(device: torch.device) -> tuple[str, int]:
    if device.type != "cuda":
        return device.type, 8
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_key(index)


def lookup_fused(
    format: str, fusion: str, n: int, k: int, device: torch.device | tuple[str, int]
) -> tuple[FusedGemvConfig, str] | None:
    """The table's launch for ``format`` / ``fusion`` at ``n`` x ``k`` on ``device`` (or a
    ``(name, sms)`` pair) and where it came from (``"user"``, ``"builtin"``); None: no entry
    (the caller's rule applies)."""
    name, sms = device if isinstance(device, tuple) else _device_key(device)
    for source, table in (("user", _user_table), ("builtin", BUILTIN_TABLE)):
        for entry in table:
            if entry.matches(name, sms, format, fusion, n, k):
                return entry.config, source
    return None


def use_fused_table(entries: Iterable[FusedEntry] | None) -> None:
    """Install ``entries`` as the user table, looked up before the built-in one (None or
    empty: none). Process-wide: the last table installed serves every model."""
    global _user_table
    _user_table = tuple(entries or ())


_FIELDS = {field.name: field.type for field in dataclasses.fields(FusedGemvConfig)}


def parse_fused_table(data: Any, where: str = "table") -> list[FusedEntry]:
    """Entries from a table's JSON value: ``{"version": 1, "entries": [{"device": "H200",
    "sms": 132, "format": "int4", "fusion": "gate_up", "n": 28672, "k": 4096, "config":
    {"block_n": 8, "num_warps": 1, ...}}, ...]}`` (``sms`` optional; config fields not given
    take :class:`FusedGemvConfig`'s defaults). Raises :class:`FusedTableError` naming the
    entry and field that is wrong."""
    if not isinstance(data, dict) or data.get("version") != TABLE_VERSION:
        raise FusedTableError(f"{where}: expected an object with version {TABLE_VERSION}")
    raw = data.get("entries")
    if not isinstance(raw, list):
        raise FusedTableError(f"{where}: 'entries' must be a list")
    entries = []
    for index, item in enumerate(raw):
        at = f"{where}: entries[{index}]"
        if not isinstance(item, dict):
            raise FusedTableError(f"{at}: expected an object")
        unknown = set(item) - {"device", "sms", "format", "fusion", "n", "k", "config"}
        if unknown:
            raise FusedTableError(f"{at}: unknown key(s) {sorted(unknown)}")
        if not isinstance(item.get("device"), str) or not item["device"]:
            raise FusedTableError(f"{at}.device: a device name (part) such as 'H200' is needed")
        if item.get("fusion") not in FUSIONS:
            raise FusedTableError(f"{at}.fusion = {item.get('fusion')!r}: one of {FUSIONS}")
        if item.get("format") not in ("int4", "int8", "fp8_e4m3"):
            raise FusedTableError(
                f"{at}.format = {item.get('format')!r}: one of 'int4', 'int8', 'fp8_e4m3'"
            )
        for key in ("n", "k"):
            if not isinstance(item.get(key), int) or item[key] <= 0:
                raise FusedTableError(f"{at}.{key} = {item.get(key)!r}: a positive integer")
        sms = item.get("sms")
        if sms is not None and (not isinstance(sms, int) or sms <= 0):
            raise FusedTableError(f"{at}.sms = {sms!r}: a positive integer or absent")
        launch = item.get("config", {})
        if not isinstance(launch, dict):
            raise FusedTableError(f"{at}.config: expected an object")
        for key, value in launch.items():
            if key not in _FIELDS:
                raise FusedTableError(f"{at}.config.{key}: unknown (known: {sorted(_FIELDS)})")
            want = bool if _FIELDS[key] in ("bool", bool) else int
            if type(value) is not want:
                raise FusedTableError(f"{at}.config.{key} = {value!r}: expected {want.__name__}")
        config = FusedGemvConfig(**launch)
        block_n = config.block_n
        if (
            block_n < 1
            or block_n & (block_n - 1)
            or (item["fusion"] in ("qkv", "gate_up") and block_n < 2)
        ):
            raise FusedTableError(
                f"{at}.config.block_n = {block_n}: a power of two (at least 2 for qkv / gate_up)"
            )
        if config.num_warps not in (1, 2, 4, 8) or config.split_k < 1 or config.num_stages < 1:
            raise FusedTableError(
                f"{at}.config: num_warps in 1, 2, 4, 8; split_k and num_stages at least 1"
            )
        if config.programs_per_sm < 0:
            raise FusedTableError(f"{at}.config.programs_per_sm: 0 or more")
        entries.append(
            FusedEntry(
                item["device"], sms, item["format"], item["fusion"], item["n"], item["k"], config
            )
        )
    return entries


def load_fused_table(path: str) -> list[FusedEntry]:
    """:func:`parse_fused_table` of the JSON file at ``path``."""
    try:
        with open(path) as handle:
            data = json.load(handle)
    except (OSError, json.JSONDecodeError) as error:
        raise FusedTableError(f"{path}: {error}") from error
    return parse_fused_table(data, path)


def fused_table_json(entries: Iterable[FusedEntry]) -> dict[str, Any]:
    """The JSON value :func:`parse_fused_table` reads back as ``entries``."""
    default = FusedGemvConfig()
    return {
        "version": TABLE_VERSION,
        "entries": [
            {
                "device": e.device,
                **({"sms": e.sms} if e.sms is not None else {}),
                "format": e.format,
                "fusion": e.fusion,
                "n": e.n,
                "k": e.k,
                "config": {
                    key: value
                    for key, value in dataclasses.asdict(e.config).items()
                    if value != getattr(default, key) or key in ("block_n", "num_warps")
                },
            }
            for e in entries
        ],
    }
