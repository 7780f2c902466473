"""Run the README's demo (or any command) N times and count the exit codes.

The demo must exit 0 every time; before slipstream.comm held collective tensors until torch's
threads released them, about 40% of runs ended in SIGABRT (exit code 134) after training had
succeeded. Usage, with the ``src/`` folders on PYTHONPATH or the packages installed::

    python tools/exit_check.py --runs 50
    python tools/exit_check.py --runs 5 -- --steps 20 --save_at 10   # shorter runs

Arguments after ``--`` go to the demo. Exits 0 only when every run exited 0; prints a tally.
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    """Run the demo ``--runs`` times; return 0 when all exited 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50, help="how many runs")
    parser.add_argument("--num_procs", type=int, default=2, help="ranks per run")
    parser.add_argument("--log_dir", type=Path, default=None, help="keep each run's output here")
    parser.add_argument("demo_args", nargs="*", help="arguments for the demo (after --)")
    args = parser.parse_args(argv)
    codes: collections.Counter[int] = collections.Counter()
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="slipstream-exit-check-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    for run in range(1, args.runs + 1):
        out = Path(tempfile.mkdtemp(prefix="demo-", dir=log_dir))
        command = [
            sys.executable,
            "-m",
            "slipstream.cli",
            "run",
            "--num_procs",
            str(args.num_procs),
            "--module",
            "slipstream.examples.gpt",
            "--out",
            str(out),
            *args.demo_args,
        ]
        start = time.monotonic()
        log = log_dir / f"run{run:03d}.log"
        with log.open("w") as handle:
            code = subprocess.call(command, stdout=handle, stderr=subprocess.STDOUT)
        codes[code] += 1
        aborted = "terminate called" in log.read_text(errors="replace")
        print(
            f"run {run}/{args.runs}: exit {code}{' (abort)' if aborted else ''} "
            f"in {time.monotonic() - start:.0f} s",
            flush=True,
        )
    tally = ", ".join(f"exit {code}: {count}" for code, count in sorted(codes.items()))
    print(f"{args.runs} runs: {tally}; logs in {log_dir}")
    return 0 if set(codes) == {0} else 1


if __name__ == "__main__":
    raise SystemExit(main())
