"""The bandwidth tool, on a few MiB."""

from __future__ import annotations

import json

import pytest

from slipstream.offload import io_bench
from slipstream.offload.aio.config import AioSettings


def test_parse_size() -> None:
    assert io_bench.parse_size("1GiB") == 1 << 30
    assert io_bench.parse_size("4MiB") == 4 << 20
    assert io_bench.parse_size("4M") == 4_000_000
    assert io_bench.parse_size("4096") == 4096
    assert io_bench.parse_size(123) == 123
    with pytest.raises(ValueError, match="cannot parse"):
        io_bench.parse_size("lots")


@pytest.mark.parametrize("o_direct", [True, False], ids=["direct", "buffered"])
def test_run_bench(tmp_path, backend, o_direct) -> None:
    result = io_bench.run_bench(
        tmp_path, size="4MiB", block_size="256KiB", backend=backend, o_direct=o_direct
    )
    (run,) = result["runs"]
    assert run["backend"] == backend and run["block_size"] == 256 * 1024
    assert run["write_gbps"] > 0 and run["read_gbps"] > 0
    assert result["size"] == 4 << 20
    assert AioSettings.from_dict(result["aio"]).block_size == 256 * 1024
    assert result["raw"]["available"] is False or result["raw"]["write_gbps"] > 0
    assert list(tmp_path.iterdir()) == []  # its files are removed


def test_sweep_and_cli(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(io_bench, "SWEEP_BLOCKS", (64 * 1024, 256 * 1024))
    monkeypatch.setattr(io_bench, "SWEEP_DEPTHS", (2,))
    monkeypatch.setattr(io_bench, "SWEEP_THREADS", (1, 2))
    out_json = tmp_path / "out" / "bench.json"
    out_json.parent.mkdir()
    bench_dir = tmp_path / "bench"
    bench_dir.mkdir()
    argv = ["--path", str(bench_dir), "--size", "2MiB", "--sweep", "--json", str(out_json)]
    assert io_bench.main(argv) == 0
    captured = capsys.readouterr()
    assert captured.err.count("] block_size=") == 4  # one progress line per run
    assert '"aio": {' in captured.out
    block = captured.out.split('"aio": ', 1)[1]
    settings = AioSettings.from_dict(json.loads(block))
    data = json.loads(out_json.read_text())
    assert len(data["runs"]) == 4
    assert settings.block_size == data["best"]["block_size"]
    best_total = data["best"]["write_gbps"] + data["best"]["read_gbps"]
    assert best_total == max(r["write_gbps"] + r["read_gbps"] for r in data["runs"])


def test_cli_errors(tmp_path, capsys) -> None:
    assert io_bench.main(["--path", str(tmp_path / "missing"), "--size", "1MiB"]) == 1
    assert "not an existing folder" in capsys.readouterr().err
    assert io_bench.main(["--path", str(tmp_path), "--size", "1000"]) == 1
