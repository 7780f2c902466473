"""Hostfiles, --include/--exclude, .slipstream_env files, OMP thread choice, worker argv."""

from __future__ import annotations

from pathlib import Path

import pytest

from slipstream.comm.launcher.environment import (
    collect_exports,
    default_omp_threads,
    parse_env_file,
)
from slipstream.comm.launcher.resources import (
    decode_world_info,
    encode_world_info,
    filter_resources,
    limit_resources,
    parse_hostfile,
    parse_node_specs,
)
from slipstream.comm.launcher.worker_shim import worker_argv

POOL = {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3], "worker-2": [0, 1]}


def test_parse_hostfile_with_comments_and_blank_lines() -> None:
    text = "# cluster\nworker-0 slots=4\n\n  worker-1   slots=2   # trailing comment\n"
    assert parse_hostfile(text) == {"worker-0": 4, "worker-1": 2}
    assert list(parse_hostfile("b slots=1\na slots=1\n")) == ["b", "a"]  # file order is rank order


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("worker-0\n", r"hf:1: 'worker-0' is not 'hostname slots=N'"),
        ("worker-0 slots=four\n", "is not 'hostname slots=N'"),
        ("worker-0 slots=2 extra\n", "is not 'hostname slots=N'"),
        ("a slots=1\nb slots=2\na slots=3\n", "hf:3: host 'a' is listed twice"),
        ("a slots=0\n", "slots=0; need >= 1"),
        ("# nothing\n\n", "lists no hosts"),
    ],
)
def test_parse_hostfile_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_hostfile(text, source="hf")


def test_parse_node_specs() -> None:
    assert parse_node_specs("worker-0:0,2@worker-1") == {"worker-0": [0, 2], "worker-1": []}
    assert parse_node_specs("a:3,1@a:1") == {"a": [1, 3]}
    for bad, message in [("a:x", "slot 'x'"), ("@a", "empty node name"), ("a@a:1", "both whole")]:
        with pytest.raises(ValueError, match=message):
            parse_node_specs(bad)


def test_include_keeps_named_hosts_and_slots_in_pool_order() -> None:
    got = filter_resources(POOL, include="worker-2@worker-0:1,3")
    assert got == {"worker-0": [1, 3], "worker-2": [0, 1]}
    assert list(got) == ["worker-0", "worker-2"]


def test_exclude_drops_slots_and_whole_hosts() -> None:
    got = filter_resources(POOL, exclude="worker-0:0,3@worker-2")
    assert got == {"worker-0": [1, 2], "worker-1": [0, 1, 2, 3]}
    assert filter_resources(POOL, exclude="worker-2:0,1") == {
        k: POOL[k] for k in ("worker-0", "worker-1")
    }


@pytest.mark.parametrize(
    ("include", "exclude", "message"),
    [
        ("worker-0", "worker-1", "mutually exclusive"),
        ("worker-9", "", "host 'worker-9', which is not among"),
        ("worker-2:5", "", r"no slot\(s\) \[5\]"),
        ("", "worker-0@worker-1@worker-2", "leaves no hosts"),
    ],
)
def test_filter_errors(include: str, exclude: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        filter_resources(POOL, include, exclude)


def test_limit_resources() -> None:
    assert limit_resources(POOL, num_nodes=2) == {k: POOL[k] for k in ("worker-0", "worker-1")}
    assert limit_resources(POOL, procs_per_node=1) == {k: [0] for k in POOL}
    with pytest.raises(ValueError, match="more nodes than the 3 available"):
        limit_resources(POOL, num_nodes=4)
    with pytest.raises(ValueError, match="positive"):
        limit_resources(POOL, procs_per_node=0)


def test_world_info_round_trip_keeps_order() -> None:
    layout = {"z": [1, 3], "a": [0]}
    decoded = decode_world_info(encode_world_info(layout))
    assert decoded == layout and list(decoded) == ["z", "a"]
    with pytest.raises(ValueError, match="not a layout"):
        decode_world_info("not-base64!")


def test_env_file_and_passthrough(tmp_path: Path) -> None:
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    (home / ".slipstream_env").write_text("A=home\nB=home\n")
    (cwd / ".slipstream_env").write_text("# comment\n\nexport B='cwd value'\nC=x=y\n")
    environ = {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/p", "TORCH_NVLS_ENABLE": "0", "HOME": "/h"}
    got = collect_exports(environ, [home, cwd])
    assert got == {
        "NCCL_DEBUG": "INFO",
        "PYTHONPATH": "/p",
        "TORCH_NVLS_ENABLE": "0",
        "A": "home",
        "B": "cwd value",
        "C": "x=y",
    }


def test_env_file_bad_line(tmp_path: Path) -> None:
    path = tmp_path / ".slipstream_env"
    path.write_text("GOOD=1\nthis is not an assignment\n")
    with pytest.raises(ValueError, match=r"\.slipstream_env:2: 'this is not an assignment'"):
        parse_env_file(path)


def test_default_omp_threads() -> None:
    assert default_omp_threads(4, {}, cores=16) == 4
    assert default_omp_threads(3, {}, cores=8) == 2
    assert default_omp_threads(8, {}, cores=2) == 1
    assert default_omp_threads(2, {"OMP_NUM_THREADS": "7"}, cores=16) is None


def test_worker_argv_puts_local_rank_first_like_deepspeed() -> None:
    assert worker_argv("train.py", ["--lr", "1"], 3, True) == [
        "train.py",
        "--local_rank=3",
        "--lr",
        "1",
    ]
    assert worker_argv("train.py", ["--lr", "1"], 3, False) == ["train.py", "--lr", "1"]
