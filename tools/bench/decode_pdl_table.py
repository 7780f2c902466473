"""Write a decode-GEMV launch table for this GPU with ``l2_prefetch`` set on chosen projections.

For measuring ``decode_pdl`` variants in the whole step (``infer_bench.py --decode-pdl on
--decode-gemv-table OUT``): each entry is the launch the library would use today for the 8B
Llama's shapes on this GPU (the built-in table's, else the default rule's), with
``l2_prefetch`` (the weight's first block of rows prefetched into L2 before the PDL wait) on for
the projections named by ``--l2-prefetch``. Runs on a GPU (the device name keys the entries).

    python3 tools/bench/decode_pdl_table.py --l2-prefetch out --out /tmp/table.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from slipstream.kernels.ops.decode_gemv.table import LaunchEntry, lookup_launch, table_json

# 8B Llama decode shapes: projection -> (fusion, out features, in features)
SHAPES = {
    "qkv": ("norm", 6144, 4096),
    "out": ("plain", 4096, 4096),
    "gate_up": ("norm", 28672, 4096),
    "down": ("gated", 4096, 14336),
    "head": ("norm", 128256, 4096),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--l2-prefetch",
        default="out",
        help="comma-separated projections (qkv,out,gate_up,down,head) with l2_prefetch on",
    )
    parser.add_argument("--out", required=True, help="the JSON table to write")
    args = parser.parse_args()
    chosen = {name for name in args.l2_prefetch.split(",") if name}
    unknown = chosen - set(SHAPES)
    if unknown:
        raise SystemExit(
            f"--l2-prefetch: unknown projection(s) {sorted(unknown)}; {sorted(SHAPES)}"
        )
    device = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    entries = []
    for part, (fusion, n, k) in SHAPES.items():
        config, source = lookup_launch(fusion, n, k, device)
        config = dataclasses.replace(config, l2_prefetch=part in chosen)
        entries.append(LaunchEntry(name, sms, fusion, n, k, config))
        print(
            json.dumps(
                {"result": "launch", "part": part, "source": source, **dataclasses.asdict(config)}
            )
        )
    with open(args.out, "w") as handle:
        json.dump(table_json(entries, {"by": "tools/bench/decode_pdl_table.py"}), handle, indent=1)


if __name__ == "__main__":
    main()
