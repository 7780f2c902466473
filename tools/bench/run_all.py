"""Run several training benchmarks side by side and print a markdown table of the results.

Each spec is ``IMPL[:STAGE[+cpu|+nvme][+param|+nvmeparam][+noclip][+bf16comm][+ratioR][+rbN][+abN][+leaf][+bpN][+pf][+tN][+dyn][+static][+stS][+cpfN][+ovf][+gsX][+siUS][+obN][+mbN][+up16]]@MODEL/MICRO`` (e.g.
``fsdp2@1.3b/4``, ``slipstream:3@7b/2``, ``slipstream:2+cpu@1.3b/4`` for CPU optimizer
offload, ``slipstream:3+cpu+nvmeparam@1.3b/2`` with the parameter shards on NVMe,
``+bf16comm`` for ``communication_data_type`` bf16, DeepSpeed's default under bf16;
``+ratio0.7`` for partial offload, ``offload_optimizer.ratio`` 0.7; ``+rb1e8`` for
``reduce_bucket_size`` 1e8 (default 5e8); ``+ab1e8`` for ``allgather_bucket_size`` 1e8
(default 5e8); ``+leaf`` for stage 3 with each transformer block a ``leaf_module``; ``+bp0`` for ``stage3_reduce_bucket_parts`` 0 (no
stage-3 cap; default 64); ``+pf`` for ``publish_during_forward`` (stages 1-2); ``+ce`` for
``publish_transport`` copy_engine (stages 1-2); ``+tail5e7`` for ``reduce_bucket_tail_size`` 5e7
(stages 1-2); ``+ctas8`` for ``reduce_scatter_max_ctas`` 8 (stages 1-2); ``+avg`` for
``average_in_reduce_scatter`` (stages 1-2); ``+t16`` for ``offload_optimizer.threads`` 16
(formerly ``SLIPSTREAM_OFFLOAD_THREADS=16``), ``+dyn`` / ``+static`` for ``cpu_schedule`` dynamic (the default) / static; ``+stmixed`` / ``+ststream`` / ``+stcached`` / ``+ststream_out`` for
``offload_optimizer.cpu_stores``; ``+cpf2048`` for ``cpu_prefetch`` 2048; ``+ovf`` for
``offload_optimizer.overlap_forward``; ``+gs0.3`` for ``offload_optimizer.gpu_share`` 0.3; ``+si200`` for
``offload_optimizer.gil_switch_interval_us`` 200 (``+si0``: Python's own interval); ``+ob5e7`` for
``offload_optimizer.overlap_bucket_size`` 5e7; ``+mb2e8`` for ``offload_optimizer.merge_bucket_size`` 2e8; ``+up16`` for
``offload_optimizer.upload_model_dtype``; ``deepspeed:2+cpu@7b/2`` runs DeepSpeed, when
installed, on the same config); every
run is a fresh ``torchrun`` of train_bench.py on ``--gpus`` processes, one after the other on
the same machine, so the rows compare like with like.

    python tools/bench/run_all.py --gpus 2 ddp@1.3b/4 fsdp2@1.3b/4 slipstream:2@1.3b/4
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _parse(spec: str) -> list[str]:
    try:
        impl, rest = spec.split("@")
        model, micro = rest.split("/")
    except ValueError:
        raise SystemExit(f"bad spec {spec!r}: expected IMPL[:STAGE]@MODEL/MICRO") from None
    impl, _, stage = impl.partition(":")
    stage, *extras = stage.split("+") if stage else [""]
    args = ["--impl", impl, "--model", model, "--micro", micro]
    for extra in extras:  # slipstream:2+cpu, slipstream:3+nvme+param
        if extra == "param":
            args += ["--offload-param", "cpu"]
        elif extra == "nvmeparam":
            args += ["--offload-param", "nvme"]
        elif extra == "noclip":
            args += ["--clip", "0"]
        elif extra in ("bf16comm", "fp32comm"):
            args += ["--comm-dtype", extra.removesuffix("comm")]
        elif extra == "ovf":
            args += ["--overlap-forward"]
        elif extra == "dyn":
            args += ["--cpu-schedule", "dynamic"]
        elif extra == "up16":
            args += ["--upload-model-dtype"]
        elif extra.startswith("mb"):
            args += ["--merge-bucket-size", extra.removeprefix("mb")]
        elif extra == "static":
            args += ["--cpu-schedule", "static"]
        elif extra in ("ststream_out", "stmixed", "ststream", "stcached"):
            args += ["--cpu-stores", extra.removeprefix("st")]
        elif extra.startswith("cpf"):
            args += ["--cpu-prefetch", extra.removeprefix("cpf")]
        elif extra.startswith("ob"):
            args += ["--overlap-bucket-size", extra.removeprefix("ob")]
        elif extra.startswith("si"):
            args += ["--gil-switch-us", extra.removeprefix("si")]
        elif extra[:1] == "t" and extra[1:].isdigit():
            args += ["--offload-threads", extra[1:]]
        elif extra == "leaf":
            args += ["--leaf-blocks"]
        elif extra == "pf":
            args += ["--publish-during-forward"]
        elif extra == "ce":
            args += ["--copy-engine"]
        elif extra == "avg":
            args += ["--avg-in-rs"]
        elif extra.startswith("ctas"):
            args += ["--max-ctas", extra.removeprefix("ctas")]
        elif extra.startswith("tail"):
            args += ["--reduce-bucket-tail", extra.removeprefix("tail")]
        elif extra.startswith("bp"):
            args += ["--stage3-bucket-parts", extra.removeprefix("bp")]
        elif extra.startswith("ab"):
            args += ["--allgather-bucket-size", extra.removeprefix("ab")]
        elif extra.startswith("rb"):
            args += ["--reduce-bucket-size", extra.removeprefix("rb")]
        elif extra.startswith("ratio"):
            args += ["--offload-ratio", extra.removeprefix("ratio")]
        elif extra.startswith("gs"):
            args += ["--offload-gpu-share", extra.removeprefix("gs")]
        else:
            args += ["--offload", extra]
    return args + (["--stage", stage] if stage else [])


def peak_column(result: dict) -> str:
    """The peak memory cell: the caching allocator's peak, plus (labelled) the copy-engine
    publish's symmetric buffer that it does not count, e.g. ``"12.1 = 9.6 + 2.5 symm"``."""
    symmetric = result.get("symmetric_gib") or 0.0
    if not symmetric:
        return f"{result['peak_alloc_gib']}"
    total = result.get("peak_with_symmetric_gib", result["peak_alloc_gib"] + symmetric)
    return f"{total} = {result['peak_alloc_gib']} + {symmetric} symm"


def main(argv: list[str] | None = None) -> int:
    """Run each spec in turn; print a table and write raw results to ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="+")
    parser.add_argument("--gpus", type=int, default=2, help="processes per run")
    parser.add_argument("--out", type=Path, default=Path("bench-results.jsonl"))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument(
        "--memory-phases",
        action="store_true",
        help="train_bench.py --memory-phases on every run: the peak by phase, in the table",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="train_bench.py --profile on every run: rank 0's chrome trace of --profile-steps "
        "extra steps to DIR/<spec>.json and every rank's summary printed (profile_steps.py)",
    )
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument(
        "--timeline",
        type=Path,
        default=None,
        help="train_bench.py --timeline on every CPU-offload run: each rank's host timeline of "
        "the last timed step to DIR/<spec>.rank<r>.json, and its summary printed "
        "(offload_timeline.py)",
    )
    parser.add_argument(
        "--profile-stack", action="store_true", help="train_bench.py --profile-stack"
    )
    args = parser.parse_args(argv)

    env = dict(os.environ)
    src = [ROOT / "kernels" / "src", *sorted((ROOT / "packages").glob("*/src"))]
    env["PYTHONPATH"] = os.pathsep.join([*map(str, src), env.get("PYTHONPATH", "")])
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    rows = []
    for spec in args.specs:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={args.gpus}", str(HERE / "train_bench.py"), *_parse(spec),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--seq", str(args.seq),
            "--out", str(args.out), *(["--memory-phases"] if args.memory_phases else []),
        ]  # fmt: skip
        if args.profile is not None:
            name = "".join(c if c.isalnum() or c in "._-" else "_" for c in spec)
            command += [
                "--profile", str(args.profile / f"{name}.json"),
                "--profile-steps", str(args.profile_steps),
                *(["--profile-stack"] if args.profile_stack else []),
            ]  # fmt: skip
        if args.timeline is not None and "+cpu" in spec:
            args.timeline.mkdir(parents=True, exist_ok=True)
            name = "".join(c if c.isalnum() or c in "._-" else "_" for c in spec)
            command += ["--timeline", str(args.timeline / name)]
        print("$", " ".join(command), flush=True)
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("BENCH ")]
        if done.returncode != 0 or not lines:
            tail = (done.stdout + done.stderr)[-3000:]
            print(f"FAILED {spec} (exit {done.returncode}):\n{tail}", flush=True)
            rows.append({"impl": spec, "error": tail.strip().splitlines()[-1] if tail else "?"})
            continue
        profiled = [
            line
            for line in done.stdout.splitlines()
            if line.startswith(("PROFILE", "  ", "TIMELINE"))
        ]
        if profiled:
            print("\n".join(profiled), flush=True)
        result = json.loads(lines[-1][len("BENCH ") :])
        print(json.dumps(result), flush=True)
        rows.append(result)

    device = next((r["device"] for r in rows if "device" in r), "?")
    print(f"\n{datetime.date.today()} · {device} × {args.gpus} · {platform.node()}")
    print(
        "| run | model, micro-batch | TFLOP/s per GPU | tokens/s (all GPUs) | peak GiB per GPU "
        "(alloc [+ symmetric buffer] / reserved) |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['impl']} | failed: {r['error'][:80]} | | | |")
            continue
        memory = r.get("memory_phases")
        where = f" (in {memory['peak_phase']})" if memory else ""
        print(
            f"| {r['impl']} | {r['model']}, {r['micro']} | {r['tflops_per_gpu']} | "
            f"{r['tokens_per_s']:,.0f} | {peak_column(r)} / {r['peak_reserved_gib']}{where} |"
        )
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
