"""The worker shim as srun/mpirun start it: rank variables from SLURM/MPI, then the script."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from slipstream.comm.launcher import worker_shim
from slipstream.comm.launcher.environment import cpu_cores

SCRIPT = """
import json, os, sys
keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "OMP_NUM_THREADS", "SLIPSTREAM_OMP_NUM_THREADS_DEFAULTED"]
with open(sys.argv[sys.argv.index("--out") + 1], "w") as handle:
    json.dump({"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv, "name": __name__}, handle)
"""


@pytest.fixture
def isolated(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Keep the shim's changes to os.environ, sys.argv and sys.path inside the test."""
    for key in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "LOCAL_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "OMP_NUM_THREADS",
        "SLIPSTREAM_OMP_NUM_THREADS_DEFAULTED",
    ):
        monkeypatch.setenv(key, "x")
        monkeypatch.delenv(key)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    return monkeypatch


def test_shim_under_srun(isolated: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for key, value in {
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "1",
        "SLURM_NODELIST": "n[1-2]",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    }.items():
        isolated.setenv(key, value)
    script, out = tmp_path / "train.py", tmp_path / "out.json"
    script.write_text(SCRIPT)
    worker_shim.main(["--", str(script), "--out", str(out)])
    got = json.loads(out.read_text())
    assert got["env"] == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "n1",
        "MASTER_PORT": "29500",
        "OMP_NUM_THREADS": str(max(1, cpu_cores() // 2)),
        # The launcher chose it (CPU offload then applies cpuadam_cores_perc to its own pool).
        "SLIPSTREAM_OMP_NUM_THREADS_DEFAULTED": str(max(1, cpu_cores() // 2)),
    }
    assert got["argv"] == [str(script), "--local_rank=1", "--out", str(out)]
    assert got["name"] == "__main__"


def test_shim_under_openmpi_keeps_exported_rendezvous(
    isolated: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for key, value in {
        "OMPI_COMM_WORLD_RANK": "0",
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "MASTER_ADDR": "head",
        "MASTER_PORT": "6000",
        "OMP_NUM_THREADS": "3",
    }.items():
        isolated.setenv(key, value)
    script, out = tmp_path / "train.py", tmp_path / "out.json"
    script.write_text(SCRIPT)
    worker_shim.main(["--no_local_rank", str(script), "--out", str(out)])
    got = json.loads(out.read_text())
    assert (got["env"]["RANK"], got["env"]["WORLD_SIZE"], got["env"]["LOCAL_RANK"]) == (
        "0",
        "2",
        "0",
    )
    assert (got["env"]["MASTER_ADDR"], got["env"]["MASTER_PORT"]) == ("head", "6000")
    assert got["env"]["OMP_NUM_THREADS"] == "3" and got["env"]["LOCAL_WORLD_SIZE"] is None
    assert got["argv"] == [str(script), "--out", str(out)]


def test_shim_usage_errors() -> None:
    with pytest.raises(SystemExit, match="unknown option '--bogus'"):
        worker_shim.main(["--bogus", "x.py"])
    with pytest.raises(SystemExit, match="no script, module or program"):
        worker_shim.main(["--module"])
