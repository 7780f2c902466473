"""The environment report behind ``slipstream report``."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from slipstream.kernels.accelerator import ACCELERATOR_ENV
from slipstream.kernels.report import environment_report, format_report, main

pytestmark = pytest.mark.usefixtures("fresh_accelerator")


def test_report_describes_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ACCELERATOR_ENV, "cpu")
    report = environment_report()
    assert report["torch"]["version"] == torch.__version__
    assert report["torch"]["cuda"] == torch.version.cuda
    accelerator = report["accelerator"]
    assert accelerator["name"] == "cpu" and accelerator["device_count"] == 1
    assert accelerator["communication_backend"] == "gloo"
    assert report["distributed"]["gloo"] == torch.distributed.is_gloo_available()
    assert report["cpu"]["logical_cores"] == os.cpu_count()
    ops = {(row["op"], row["backend"]): row for row in report["ops"]}
    for op in ("adam", "cross_entropy", "layer_norm", "rms_norm", "rotary_embedding", "softmax"):
        assert ops[(op, "reference")]["available"] and ops[(op, "reference")]["selected"]


def test_format_report_is_a_plain_text_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ACCELERATOR_ENV, "cpu")
    text = format_report(environment_report())
    for heading in ("Software", "Accelerator", "torch.distributed", "CPU", "Ops"):
        assert heading in text
    assert torch.__version__ in text
    rms_lines = [line for line in text.splitlines() if line.startswith("rms_norm ")]
    assert {line.split()[1] for line in rms_lines} == {"reference", "triton"}


def test_compiler_versions_are_read_from_the_tools(tmp_path, monkeypatch) -> None:
    fake_nvcc = tmp_path / "nvcc"
    fake_nvcc.write_text(
        "#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
        "echo 'Cuda compilation tools, release 12.4, V12.4.131'\n"
    )
    fake_hipcc = tmp_path / "hipcc"
    fake_hipcc.write_text("#!/bin/sh\necho 'HIP version: 6.2.41133-dd7f95766'\n")
    for tool in (fake_nvcc, fake_hipcc):
        tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    compilers = environment_report()["compilers"]
    assert compilers["nvcc"] == {"path": str(fake_nvcc), "version": "12.4"}
    assert compilers["hipcc"] == {"path": str(fake_hipcc), "version": "6.2.41133-dd7f95766"}


def test_bad_accelerator_override_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ACCELERATOR_ENV, "tpu")
    report = environment_report()
    assert "tpu" in report["accelerator"]["error"]
    assert "error" in format_report(report)


def test_main_prints_the_report(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv(ACCELERATOR_ENV, "cpu")
    assert main() == 0
    assert "rotary_embedding" in capsys.readouterr().out
