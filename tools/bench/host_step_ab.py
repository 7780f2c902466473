"""The C++ CPU Adam's memory paths side by side, as CPU offload runs them, in one set of processes.

CPU offload's step is bound by the host's memory bandwidth, which the ranks of one host share.
This starts ``--processes`` processes (ranks); each allocates its own fp32 params and Adam
states, a second set for the out-of-place (speculative) step, and bf16 gradients, all pinned
where a GPU is present (as training allocates them), ``--params`` elements each. Then, for
``--rounds`` rounds, every variant runs once on every rank at the same moment (the order rotates
from round to round), first with rank 0 alone and then with all ranks at once. A variant is
``KIND/PLACE[/modifiers]``:

- ``adam``: the C++ Adam step (26 host bytes per element: 14 read, 12 written);
- ``read``, ``write``, ``copy``: :func:`slipstream.kernels.ops.cpu_optim.memory_probe`, Adam's
  traffic without its arithmetic: read 14 B, write 12 B with non-temporal stores, or both
  (26 B): what the host's memory gives a step of this shape;
- ``PLACE``: ``oop`` (out of place into the second set, the speculative step of training),
  ``ip`` (in place);
- modifiers: ``old`` (the earlier kernel: ``stores="mixed"``), ``ntB`` (``stores="stream"`` with B-byte
  non-temporal stores, 0 = the widest), ``stream_out`` (``stores="stream_out"``, CPU offload's
  default), ``pfN`` (prefetch N elements ahead), ``dyn``
  (dynamic schedule), ``tN`` (N OpenMP threads instead of ``--threads``).

    PYTHONPATH=kernels/src python3 tools/bench/host_step_ab.py --processes 2 --threads 16 \\
        --params 3e8 --rounds 7

Prints one JSON line per (ranks, variant): the median over rounds of the slowest rank's time,
ns per element (that time over one rank's elements) and the host GB/s of all ranks together
(counted bytes per element times elements times ranks over that time); then a compact table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from host_workers import run_host_workers

DEFAULT_VARIANTS = (
    "adam/oop/old",
    "adam/oop/old/dyn",
    "adam/oop/stream_out/dyn",
    "adam/oop/nt16/dyn",
    "adam/oop/nt64/pf1024/dyn",
    "adam/ip/old",
    "adam/ip/old/dyn",
    "adam/ip/stream_out/dyn",
    "adam/ip/nt64/dyn",
    "read/ip",
    "write/oop/nt64",
    "copy/oop/nt64",
)
BYTES = {"adam": 26, "read": 14, "write": 12, "copy": 26}


def _parse(variant: str, threads: int) -> dict[str, Any]:
    kind, place, *mods = variant.split("/")
    if kind not in BYTES or place not in ("oop", "ip"):
        raise SystemExit(f"bad variant {variant!r}: KIND/PLACE[/mods], KIND in {sorted(BYTES)}")
    spec: dict[str, Any] = {
        "kind": kind,
        "oop": place == "oop",
        "stores": "mixed" if kind == "adam" else "stream",
        "store_bytes": 0,
        "prefetch": 0,
        "schedule": "static",
        "threads": threads,
    }
    for mod in mods:
        if mod == "old":
            spec["stores"] = "mixed"
        elif mod == "stream_out":
            spec["stores"] = mod
        elif mod.startswith("nt"):
            spec["stores"], spec["store_bytes"] = "stream", int(mod[2:])
        elif mod.startswith("pf"):
            spec["prefetch"] = int(mod[2:])
        elif mod == "dyn":
            spec["schedule"] = "dynamic"
        elif mod.startswith("t"):
            spec["threads"] = int(mod[1:])
        else:
            raise SystemExit(f"bad modifier {mod!r} in {variant!r}")
    return spec


def _worker(rank: int, args: argparse.Namespace, barrier: Any, results: Any) -> None:
    import torch

    from slipstream.kernels.ops import cpu_optim

    pin = torch.cuda.is_available()
    numel = int(args.params)
    chunk = 1 << 26  # model-like tensors of 64 Mi elements
    sizes = [chunk] * (numel // chunk) + ([numel % chunk] if numel % chunk else [])

    def tensors(value: float, dtype: Any = torch.float32) -> list[Any]:
        out = [torch.empty(n, dtype=dtype, pin_memory=pin) for n in sizes]
        for t in out:
            t.fill_(value)  # every page faulted in before the timing
        return out

    params, exp_avgs, exp_avg_sqs = tensors(0.5), tensors(0.01), tensors(0.001)
    outs = (tensors(0.0), tensors(0.0), tensors(0.0))
    grads = tensors(0.02, torch.bfloat16)
    specs = {v: _parse(v, args.threads) for v in args.variants}
    step = 0

    def run(spec: dict[str, Any]) -> None:
        nonlocal step
        cpu_optim.set_num_threads(spec["threads"])
        out = outs if spec["oop"] else None
        if spec["kind"] == "adam":
            step += 1
            cpu_optim.adam(
                params, grads, exp_avgs, exp_avg_sqs, lr=1e-4, beta1=0.9, beta2=0.95,
                eps=1e-8, weight_decay=0.1, adam_w_mode=True, bias_correction=True,
                step=step, out=out, schedule=spec["schedule"], stores=spec["stores"],
                store_bytes=spec["store_bytes"], prefetch=spec["prefetch"],
            )  # fmt: skip
        else:
            cpu_optim.memory_probe(
                spec["kind"], params, grads, exp_avgs, exp_avg_sqs, out=out,
                store_bytes=spec["store_bytes"], schedule=spec["schedule"],
            )  # fmt: skip

    names = list(specs)
    for name in names:  # warm-up: every path once (page tables, the OpenMP team)
        run(specs[name])
    times: dict[str, dict[int, list[float]]] = {n: {1: [], args.processes: []} for n in names}
    phases = [1, args.processes] if args.processes > 1 else [1]
    for ranks in phases:
        for round_ in range(args.rounds):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                barrier.wait()
                if rank < ranks:
                    start = time.perf_counter()
                    run(specs[name])
                    times[name][ranks].append(time.perf_counter() - start)
                barrier.wait()
    results.put((rank, times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--params", type=float, default=3e8, help="elements per rank")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    args = parser.parse_args()
    args.variants = [v for v in args.variants.split(",") if v]
    for v in args.variants:
        _parse(v, args.threads)
    gathered = dict(run_host_workers(_worker, args, args.processes))
    numel = int(args.params)
    rows = []
    for ranks in sorted({1, args.processes}):
        for name in args.variants:
            per_rank = [gathered[r][name][ranks] for r in range(ranks)]
            slowest = [max(ts) for ts in zip(*per_rank)]
            med = statistics.median(slowest)
            kind = name.split("/")[0]
            row = {
                "ranks": ranks,
                "variant": name,
                "ms": round(med * 1e3, 2),
                "ns_per_elem": round(med * 1e9 / numel, 3),
                "gb_per_s": round(ranks * numel * BYTES[kind] / med / 1e9, 1),
                "bytes_per_elem": BYTES[kind],
                "min_ms": round(min(slowest) * 1e3, 2),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{args.processes} process(es) x {args.threads} threads, {numel:,} elements per rank")
    print("| ranks | variant | ms | ns/elem | GB/s |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['ranks']} | {row['variant']} | {row['ms']} | {row['ns_per_elem']} "
            f"| {row['gb_per_s']} |"
        )


if __name__ == "__main__":
    main()
