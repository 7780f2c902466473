"""`slipstream run`: real single-node runs, exit codes, and multi-node commands (--dry_run)."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import pytest

import slipstream
from slipstream.comm.distributed import free_port
from slipstream.comm.launcher import main
from slipstream.comm.launcher.environment import cpu_cores
from slipstream.comm.launcher.resources import decode_world_info

WORKER_BODY = """
import json, os, sys
out = sys.argv[sys.argv.index("--out") + 1]
record = {
    "rank": int(os.environ["RANK"]),
    "local_rank": int(os.environ["LOCAL_RANK"]),
    "world_size": int(os.environ["WORLD_SIZE"]),
    "omp": os.environ.get("OMP_NUM_THREADS"),
    "from_env_file": os.environ.get("SLIPSTREAM_TEST_VALUE"),
    "argv": sys.argv[1:],
    "name": __name__,
}
with open(os.path.join(out, f"rank{record['rank']}.json"), "w") as handle:
    json.dump(record, handle)
if "--fail_rank" in sys.argv and record["rank"] == int(sys.argv[sys.argv.index("--fail_rank") + 1]):
    # Fail only once every rank has written its record (the agent then stops the others).
    import time
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(os.listdir(out)) < record["world_size"]:
        time.sleep(0.05)
    sys.exit(3)
"""


@pytest.fixture
def worker_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Workers find slipstream (absolute paths) and tmp_path's modules; cwd is a scratch dir."""
    roots = [os.path.dirname(path) for path in slipstream.__path__]
    existing = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    paths = [str(tmp_path), *roots, *(os.path.abspath(p) for p in existing)]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    return workdir


def _records(out: Path, world_size: int) -> list[dict]:
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world_size)]


@pytest.mark.slow
def test_two_process_script_run(worker_env: Path, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(WORKER_BODY)
    out = tmp_path / "out"
    out.mkdir()
    (worker_env / ".slipstream_env").write_text("SLIPSTREAM_TEST_VALUE=from file\n")
    status = main(
        [
            "--num_procs",
            "2",
            "--master_port",
            str(free_port()),
            str(script),
            "--out",
            str(out),
            "--flag",
            "a b",
        ]
    )
    assert status == 0
    expected_omp = str(max(1, cpu_cores() // 2))
    for rank, record in enumerate(_records(out, 2)):
        assert (record["rank"], record["local_rank"], record["world_size"]) == (rank, rank, 2)
        assert record["argv"] == [f"--local_rank={rank}", "--out", str(out), "--flag", "a b"]
        assert record["omp"] == expected_omp
        assert record["from_env_file"] == "from file"
        assert record["name"] == "__main__"
    assert "SLIPSTREAM_TEST_VALUE" not in os.environ  # main() restores its caller's environment


@pytest.mark.slow
def test_module_form_and_worst_exit_code(worker_env: Path, tmp_path: Path) -> None:
    package = tmp_path / "launchpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "worker.py").write_text(WORKER_BODY)
    out = tmp_path / "out"
    out.mkdir()
    argv = ["--num_procs", "2", "--master_port", str(free_port()), "--no_local_rank", "--module"]
    status = main([*argv, "launchpkg.worker", "--", "--out", str(out), "--fail_rank", "1"])
    assert status == 3
    records = _records(out, 2)
    assert [r["argv"] for r in records] == [["--out", str(out), "--fail_rank", "1"]] * 2
    assert [r["name"] for r in records] == ["__main__"] * 2


def test_missing_script_and_bad_option_combinations(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--num_procs", "1", "no_such_script.py"]) == 2
    assert "script 'no_such_script.py' not found" in capsys.readouterr().err
    assert main(["--module", "--no_python", "x"]) == 2
    assert "exclude each other" in capsys.readouterr().err
    assert main(["--num_procs", "1", "--include", "localhost:0", "x.py"]) == 2
    assert "cannot be combined" in capsys.readouterr().err
    assert main(["--hostfile", "/no/such/hostfile", "x.py"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["--num_nodes", "2", "x.py"]) == 2
    assert "needs a hostfile" in capsys.readouterr().err


def _dry_run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> list[list[str]]:
    assert main(["--dry_run", *argv]) == 0
    return [shlex.split(line) for line in capsys.readouterr().out.strip().splitlines()]


def _split_env(words: list[str]) -> tuple[dict[str, str], list[str]]:
    env = {}
    while words and "=" in words[0] and not words[0].startswith("-"):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return env, words


def _option(words: list[str], name: str) -> str:
    return next(w.split("=", 1)[1] for w in words if w.startswith(f"--{name}="))


@pytest.fixture
def hostfile(tmp_path: Path) -> Path:
    path = tmp_path / "hostfile"
    path.write_text("# two nodes\nworker-0 slots=2\nworker-1 slots=2\n")
    return path


def test_single_node_dry_run(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    [words] = _dry_run(capsys, ["--num_procs", "2", "train.py", "--lr", "0.1"])
    env, words = _split_env(words)
    assert env["OMP_NUM_THREADS"] == str(max(1, cpu_cores() // 2))
    assert env["SLIPSTREAM_OMP_NUM_THREADS_DEFAULTED"] == env["OMP_NUM_THREADS"]
    assert words[1:3] == ["-m", "torch.distributed.run"]
    assert {
        "--nnodes=1",
        "--nproc_per_node=2",
        "--node_rank=0",
        "--master_addr=127.0.0.1",
        "--master_port=29500",
    } <= set(words)
    assert words[-6:] == [
        "--module",
        "slipstream.comm.launcher.worker_shim",
        "--",
        "train.py",
        "--lr",
        "0.1",
    ]


def test_pdsh_command(capsys: pytest.CaptureFixture[str], hostfile: Path) -> None:
    [words] = _dry_run(capsys, ["--hostfile", str(hostfile), "train.py", "--lr", "0.1"])
    env, words = _split_env(words)
    assert env == {"PDSH_RCMD_TYPE": "ssh"}
    assert words[:6] == ["pdsh", "-S", "-f", "1024", "-w", "worker-0,worker-1"]
    remote = words[6]
    assert f"cd {shlex.quote(os.getcwd())} &&" in remote
    launcher = shlex.split(remote.split(" && ", 1)[1])
    assert launcher[1:4] == ["-u", "-m", "slipstream.comm.launcher"]
    assert _option(launcher, "node_rank") == "%n"
    assert _option(launcher, "master_addr") == "worker-0"
    assert _option(launcher, "master_port") == "29500"
    assert decode_world_info(_option(launcher, "world_info")) == {
        "worker-0": [0, 1],
        "worker-1": [0, 1],
    }
    assert launcher[-4:] == ["--", "train.py", "--lr", "0.1"]


def test_ssh_commands_with_include(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0,eth1")
    path = tmp_path / "hosts"
    path.write_text("a slots=4\nb slots=4\nc slots=4\n")
    argv = [
        "-H",
        str(path),
        "--launcher",
        "ssh",
        "--include",
        "c:1,3@a",
        "--launcher_args",
        "-p 2222",
    ]
    commands = _dry_run(capsys, [*argv, "--master_port", "6000", "--module", "pkg.train"])
    assert [c[:4] for c in commands] == [["ssh", "-p", "2222", "a"], ["ssh", "-p", "2222", "c"]]
    for rank, command in enumerate(commands):
        remote = command[4]
        assert "export NCCL_SOCKET_IFNAME=eth0,eth1;" in remote
        launcher = shlex.split(remote.split(" && ", 1)[1])
        assert _option(launcher, "node_rank") == str(rank)
        assert _option(launcher, "master_addr") == "a"
        assert decode_world_info(_option(launcher, "world_info")) == {
            "a": [0, 1, 2, 3],
            "c": [1, 3],
        }
        assert launcher[-3:] == ["--module", "--", "pkg.train"]


def test_node_local_launcher_pins_its_slots(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What pdsh/ssh run on node 1 of the layout above: 2 workers on devices 1 and 3."""
    from slipstream.comm.launcher.resources import encode_world_info

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    info = encode_world_info({"a": [0, 1, 2, 3], "c": [1, 3]})
    [words] = _dry_run(
        capsys, [f"--world_info={info}", "--node_rank=1", "--master_addr=a", "train.py"]
    )
    env, words = _split_env(words)
    assert env["CUDA_VISIBLE_DEVICES"] == "1,3"
    assert {"--nnodes=2", "--nproc_per_node=2", "--node_rank=1", "--master_addr=a"} <= set(words)


def test_slurm_command(capsys: pytest.CaptureFixture[str], hostfile: Path) -> None:
    [words] = _dry_run(
        capsys, ["-H", str(hostfile), "--launcher", "slurm", "--no_local_rank", "train.py"]
    )
    env, words = _split_env(words)
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("worker-0", "29500")
    assert words[:5] == [
        "srun",
        "--nodes=2",
        "--ntasks-per-node=2",
        "--ntasks=4",
        "--nodelist=worker-0,worker-1",
    ]
    assert words[5:] == [
        sys.executable,
        "-u",
        "-m",
        "slipstream.comm.launcher.worker_shim",
        "--no_local_rank",
        "--",
        "train.py",
    ]


def test_slurm_inside_allocation_without_hostfile(capsys: pytest.CaptureFixture[str]) -> None:
    [words] = _dry_run(
        capsys, ["--launcher", "slurm", "--num_nodes", "3", "--num_procs", "4", "train.py"]
    )
    env, words = _split_env(words)
    assert "MASTER_ADDR" not in env  # workers take it from SLURM_NODELIST
    assert words[:4] == ["srun", "--nodes=3", "--ntasks-per-node=4", "--ntasks=12"]


def test_openmpi_command(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text("n0 slots=4\nn1 slots=2\n")  # uneven: fine for -H host:slots
    [words] = _dry_run(capsys, ["-H", str(path), "--launcher", "openmpi", "train.py", "--x"])
    assert words[:3] == ["mpirun", "-np", "6"]
    assert words[words.index("-H") + 1] == "n0:4,n1:2"
    exported = [words[i + 1] for i, w in enumerate(words) if w == "-x"]
    assert "MASTER_ADDR=n0" in exported and "MASTER_PORT=29500" in exported
    assert words[-4:] == ["slipstream.comm.launcher.worker_shim", "--", "train.py", "--x"]


def test_mpich_command(capsys: pytest.CaptureFixture[str], hostfile: Path) -> None:
    [words] = _dry_run(
        capsys, ["-H", str(hostfile), "--launcher", "mpich", "--master_port", "7000", "train.py"]
    )
    assert words[:7] == ["mpirun", "-n", "4", "-ppn", "2", "-hosts", "worker-0,worker-1"]
    genv = {words[i + 1]: words[i + 2] for i, w in enumerate(words) if w == "-genv"}
    assert (genv["MASTER_ADDR"], genv["MASTER_PORT"]) == ("worker-0", "7000")


def test_mpi_launchers_reject_what_they_cannot_express(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "hosts"
    path.write_text("n0 slots=4\nn1 slots=2\n")
    assert main(["-H", str(path), "--launcher", "slurm", "--dry_run", "t.py"]) == 2
    assert "same number of processes on every node" in capsys.readouterr().err
    assert (
        main(["-H", str(path), "--launcher", "openmpi", "--exclude", "n0:0", "--dry_run", "t.py"])
        == 2
    )
    assert "cannot pin host 'n0' to device slots [1, 2, 3]" in capsys.readouterr().err


def test_one_host_runs_locally_unless_forced(
    capsys: pytest.CaptureFixture[str], hostfile: Path
) -> None:
    [words] = _dry_run(capsys, ["-H", str(hostfile), "--include", "worker-1", "train.py"])
    assert "torch.distributed.run" in words
    [words] = _dry_run(
        capsys, ["-H", str(hostfile), "--include", "worker-1", "--force_multi", "train.py"]
    )
    _, words = _split_env(words)
    assert words[:6] == ["pdsh", "-S", "-f", "1024", "-w", "worker-1"]


def test_slots_index_the_devices_already_visible(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "hosts"
    path.write_text("localhost slots=4\n")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    [words] = _dry_run(capsys, ["-H", str(path), "--include", "localhost:1,3", "train.py"])
    env, words = _split_env(words)
    assert env["CUDA_VISIBLE_DEVICES"] == "5,7" and "--nproc_per_node=2" in words


@pytest.mark.slow
def test_two_node_job_over_ssh(
    worker_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two "nodes" on this machine: a stand-in ssh runs each node's command locally."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_ssh = bin_dir / "ssh"
    fake_ssh.write_text(
        '#!/bin/sh\n# stand-in for ssh HOST COMMAND: run COMMAND here\nshift\nexec /bin/sh -c "$1"\n'
    )
    fake_ssh.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    hosts = tmp_path / "hosts"
    hosts.write_text("node-a slots=1\nnode-b slots=1\n")
    script = tmp_path / "train.py"
    script.write_text(WORKER_BODY)
    out = tmp_path / "out"
    out.mkdir()
    argv = ["-H", str(hosts), "--launcher", "ssh", "--master_addr", "127.0.0.1"]
    argv += ["--master_port", str(free_port()), str(script), "--out", str(out)]
    # (A job where one node fails while the other's workers succeed would leave the healthy
    # node's torch elastic agent in its 300 s exit barrier; exit codes are tested on one node.)
    assert main(argv) == 0
    for rank, record in enumerate(_records(out, 2)):
        assert (record["rank"], record["local_rank"], record["world_size"]) == (rank, 0, 2)
        assert record["argv"][0] == "--local_rank=0"
