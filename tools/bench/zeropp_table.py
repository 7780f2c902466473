"""ZeRO++/MiCS beside plain ZeRO-3: one markdown table from train_bench.py's JSON lines.

Each ``--out`` line of ``train_bench.py --comms-log`` (one per run) becomes a row: the run's
ZeRO++ keys, tokens/s and TFLOP/s per GPU (from the unlogged timed steps), and per step the
MB and ms of the parameter all-gathers, the gradient reduce-scatters, qgZ's all-to-alls and
the all-reduces, from the logged steps (every collective timed to completion, one at a time).
The ratio columns divide by the first row without ZeRO++ keys (plain ZeRO-3).

    python3 tools/bench/zeropp_table.py zeropp.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# Comms-logger record names -> column: a name matches the first family it contains.
FAMILIES = (
    ("all-gather", "all_gather"),
    ("reduce-scatter", "reduce_scatter"),
    ("all-to-all", "all_to_all"),
    ("all-reduce", "all_reduce"),
)


def _label(run: dict[str, Any]) -> str:
    keys = run.get("zero_plus_plus") or {}
    names = {
        "zero_quantized_weights": "qwZ",
        "zero_quantized_gradients": "qgZ",
        "mics_shard_size": "MiCS",
        "zero_hpz_partition_size": "hpZ",
    }
    parts = []
    for key, value in keys.items():
        if key == "zero_quantized_gradients_bits":
            parts.append(f"int{value}")
            continue
        name = names.get(key, key)
        parts.append(name if value is True else f"{name}={value}")
    return "ZeRO-3 + " + " + ".join(parts) if parts else "ZeRO-3"


def _families(run: dict[str, Any]) -> dict[str, tuple[float, float]]:
    out = {family: (0.0, 0.0) for family, _ in FAMILIES}
    for name, stats in (run.get("comms_per_step") or {}).items():
        for family, needle in FAMILIES:
            if needle in name:
                mb, ms = out[family]
                out[family] = (mb + float(stats["MB"]), ms + float(stats["ms"]))
                break
    return out


def table(runs: list[dict[str, Any]]) -> str:
    """The markdown table of ``runs`` (train_bench.py result dicts)."""
    header = (
        "| run | tokens/s | TFLOP/s/GPU | all-gather MB / ms | reduce-scatter MB / ms "
        "| all-to-all MB / ms | all-reduce MB / ms | gather bytes vs ZeRO-3 "
        "| gradient bytes vs ZeRO-3 | comm ms vs ZeRO-3 |"
    )
    lines = [header, "|" + "---|" * 10]
    base = next((r for r in runs if not r.get("zero_plus_plus")), None)
    base_f = _families(base) if base is not None else None

    def ratio(value: float, reference: float | None) -> str:
        return f"{value / reference:.2f}×" if reference else "—"

    for run in runs:
        fam = _families(run)
        gather = fam["all-gather"][0]
        grads = fam["reduce-scatter"][0] + fam["all-to-all"][0]
        ms = sum(v[1] for v in fam.values())
        ref_gather = ref_grads = ref_ms = None
        if base_f is not None:
            ref_gather = base_f["all-gather"][0]
            ref_grads = base_f["reduce-scatter"][0] + base_f["all-to-all"][0]
            ref_ms = sum(v[1] for v in base_f.values())
        cells = [
            _label(run),
            f"{run['tokens_per_s']:,.0f}",
            f"{run['tflops_per_gpu']:.1f}",
            *(f"{fam[f][0]:,.1f} / {fam[f][1]:,.1f}" for f, _ in FAMILIES),
            ratio(gather, ref_gather),
            ratio(grads, ref_grads),
            ratio(ms, ref_ms),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the table of the JSON lines in the file given (the last run of each label wins)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    runs: dict[str, dict[str, Any]] = {}
    for line in Path(args[0]).read_text().splitlines():
        if line.strip():
            run = json.loads(line)
            if "error" not in run:
                runs[_label(run)] = run
    print(table(list(runs.values())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
