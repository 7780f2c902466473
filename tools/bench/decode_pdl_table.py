"""Write a decode-GEMV launch table for this GPU: today's 8B launches with chosen fields changed.

For measuring launch variants in the whole step (``infer_bench.py --decode-gemv-table OUT``,
with ``--decode-pdl on`` for ``l2_prefetch``): each entry is the launch the library would use
today for the 8B Llama's shapes on this GPU (the built-in table's, else the default rule's),
with the fields given by ``--set PART:FIELD=VALUE`` changed (PART one of qkv, out, gate_up,
down, head, or ``norm`` for qkv, gate_up and head). Runs on a GPU (its name keys the entries).

    python3 tools/bench/decode_pdl_table.py --set out:l2_prefetch=true --out /tmp/table.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from slipstream.kernels.ops.decode_gemv.table import (
    DecodeGemvConfig,
    LaunchEntry,
    lookup_launch,
    table_json,
)

# 8B Llama decode shapes: projection -> (fusion, out features, in features)
SHAPES = {
    "qkv": ("norm", 6144, 4096),
    "out": ("plain", 4096, 4096),
    "gate_up": ("norm", 28672, 4096),
    "down": ("gated", 4096, 14336),
    "head": ("norm", 128256, 4096),
}


def _changes(settings: list[str]) -> dict[str, dict[str, object]]:
    fields = {field.name: field.type for field in dataclasses.fields(DecodeGemvConfig)}
    changes: dict[str, dict[str, object]] = {part: {} for part in SHAPES}
    for setting in settings:
        part, _, assignment = setting.partition(":")
        field, _, raw = assignment.partition("=")
        parts = ["qkv", "gate_up", "head"] if part == "norm" else [part]
        if any(p not in SHAPES for p in parts) or field not in fields or not raw:
            raise SystemExit(
                f"--set {setting!r}: expected PART:FIELD=VALUE with PART in {sorted(SHAPES)} or "
                f"'norm', FIELD in {sorted(fields)}"
            )
        value: object = raw.lower() == "true" if raw.lower() in ("true", "false") else int(raw)
        for p in parts:
            changes[p][field] = value
    return changes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--set", action="append", default=[], metavar="PART:FIELD=VALUE")
    parser.add_argument("--out", required=True, help="the JSON table to write")
    args = parser.parse_args()
    changes = _changes(args.set)
    device = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    entries = []
    for part, (fusion, n, k) in SHAPES.items():
        config, source = lookup_launch(fusion, n, k, device)
        config = dataclasses.replace(config, **changes[part])  # type: ignore[arg-type]
        entries.append(LaunchEntry(name, sms, fusion, n, k, config))
        launch = dataclasses.asdict(config)
        print(json.dumps({"result": "launch", "part": part, "source": source, **launch}))
    with open(args.out, "w") as handle:
        json.dump(table_json(entries, {"by": "tools/bench/decode_pdl_table.py"}), handle, indent=1)


if __name__ == "__main__":
    main()
