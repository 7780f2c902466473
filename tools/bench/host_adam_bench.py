"""The C++ CPU Adam as CPU offload runs it: several ranks on one host at once, bf16 gradients.

ZeRO-Offload's step is bound by the host's memory bandwidth, which the ranks of one host
share, so a single-process timing (``kernels_bench.py``) overstates what each rank gets. This
starts ``--processes`` processes; each allocates its own fp32 params and Adam states and bf16
gradients (``--params`` elements), waits for the others, and times ``--steps`` in-place AdamW
steps with ``--threads`` OpenMP threads. ``--copy`` chooses what the step writes besides the
param and states:

- ``bf16``: a model-dtype copy into a separate buffer (the staging copy that stages 1-2 wrote
  before the all-gather uploaded the fp32 masters, and still write with NVMe);
- ``none``: nothing (stages 1-2 with CPU offload now);
- ``into-grad``: the copy over the gradient buffer just read.

    PYTHONPATH=kernels/src python tools/bench/host_adam_bench.py --processes 2 --threads 12 \\
        --params 4e8 --copy bf16

Prints one JSON line per process (median and all step times) and a summary line with the
median over processes and the host-memory bytes the steps moved per second, counted as 28
bytes per element (fp32 param and two states read and written, bf16 gradient read) plus 2
for a bf16 copy; read-for-ownership and other traffic are not counted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from host_workers import run_host_workers


def _worker(rank: int, args: argparse.Namespace, barrier: Any, results: Any) -> None:
    import torch

    from slipstream.kernels.ops import cpu_optim

    numel = int(args.params)
    chunk = 1 << 26  # model-like tensors of 64 Mi elements
    sizes = [chunk] * (numel // chunk) + ([numel % chunk] if numel % chunk else [])
    # Filled (not just allocated) so that every page is faulted in before the timing.
    params = [torch.full((n,), 0.5) for n in sizes]
    exp_avgs = [torch.full((n,), 0.01) for n in sizes]
    exp_avg_sqs = [torch.full((n,), 0.001) for n in sizes]
    grads = [torch.full((n,), 0.1, dtype=torch.bfloat16) for n in sizes]
    copies = {
        "bf16": [torch.zeros(n, dtype=torch.bfloat16) for n in sizes],
        "none": None,
        "into-grad": grads,
    }[args.copy]
    cpu_optim.set_num_threads(args.threads)
    times = []
    for step in range(args.steps + 1):  # the first is a warm-up
        barrier.wait()
        start = time.perf_counter()
        cpu_optim.adam(
            params, grads, exp_avgs, exp_avg_sqs, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8,
            weight_decay=0.1, adam_w_mode=True, bias_correction=True, step=step + 1,
            param_copies=copies,
        )  # fmt: skip
        times.append(time.perf_counter() - start)
    results.put((rank, times[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, default=2, help="ranks on the host (2)")
    parser.add_argument("--threads", type=int, default=12, help="OpenMP threads per rank (12)")
    parser.add_argument("--params", type=float, default=4e8, help="elements per rank (4e8)")
    parser.add_argument("--copy", choices=["bf16", "none", "into-grad"], default="bf16")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (5, after 1 warm-up)")
    args = parser.parse_args()
    gathered = dict(run_host_workers(_worker, args, args.processes))
    medians = []
    for rank in sorted(gathered):
        times = gathered[rank]
        medians.append(statistics.median(times))
        print(json.dumps({"rank": rank, "median_ms": round(medians[-1] * 1e3, 1),
                          "times_ms": [round(t * 1e3, 1) for t in times]}))  # fmt: skip
    median = statistics.median(medians)
    per_element = 28 + (2 if args.copy != "none" else 0)
    total = args.processes * int(args.params) * per_element
    print(json.dumps({
        "processes": args.processes, "threads": args.threads, "params": int(args.params),
        "copy": args.copy, "median_step_ms": round(median * 1e3, 1),
        "counted_gb_per_s": round(total / median / 1e9, 1),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
