"""Ahead-of-time Triton builds for sm_80, sm_90, gfx90a, gfx942 and gfx1100, without a GPU.

Marked ``aot`` (``nox -s kernels``): compiling takes about a minute on a 2-core machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the AOT matrix needs `pip install triton`")

SRC = Path(__file__).resolve().parents[1] / "src"


def _run_aot(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # interpreted kernels cannot be compiled
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compile for real, not from cache
    return subprocess.run(
        [sys.executable, "-m", "slipstream.kernels.aot", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )


@pytest.mark.aot
def test_every_kernel_compiles_for_every_target(tmp_path) -> None:
    from slipstream.kernels.aot import TARGETS, all_specs, one_spec_per_kernel

    kernels = len(one_spec_per_kernel(all_specs()))
    completed = _run_aot("--quick", "--out", str(tmp_path / "aot"), tmp_path=tmp_path)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    for target in TARGETS:
        assert f"{kernels:3d}/{kernels:<4d}" in completed.stdout, completed.stdout
        binary = "hsaco" if target.startswith("gfx") else "cubin"
        written = list((tmp_path / "aot" / target).glob(f"*.{binary}"))
        assert len(written) == kernels
        assert all(path.stat().st_size > 0 for path in written)
    assert (tmp_path / "aot" / "report.json").exists()


@pytest.mark.aot
def test_aot_refuses_to_run_under_the_interpreter(tmp_path) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(SRC))
    completed = subprocess.run(
        [sys.executable, "-m", "slipstream.kernels.aot", "--quick", "--targets", "sm_90"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 2
    assert "TRITON_INTERPRET=1 is set" in completed.stderr


CSRC = SRC / "slipstream" / "kernels" / "ops" / "adam" / "csrc"


@pytest.mark.aot
def test_cuda_fused_adam_compiles_with_nvcc_for_sm80_and_sm90(tmp_path) -> None:
    import shutil

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    completed = subprocess.run(
        [nvcc, "-c", str(CSRC / "fused_adam.cu"), "-o", str(tmp_path / "fused_adam.o"),
         "-O3", "-std=c++17", "-gencode", "arch=compute_80,code=sm_80",
         "-gencode", "arch=compute_90,code=sm_90"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    assert (tmp_path / "fused_adam.o").stat().st_size > 0


@pytest.mark.aot
def test_cuda_sources_hipify_cleanly(tmp_path, capsys) -> None:
    import shutil

    from torch.utils.hipify import hipify_python

    source = tmp_path / "csrc"
    shutil.copytree(CSRC, source)
    results = hipify_python.hipify(
        project_directory=str(source),
        output_directory=str(tmp_path / "hip"),
        includes=[str(source / "*")],
        show_detailed=True,
        is_pytorch_extension=True,
    )
    printed = capsys.readouterr().out
    assert "Total number of unsupported CUDA function calls: 0" in printed
    assert {Path(path).name for path in results} >= {
        "fused_adam.cu",
        "fused_adam.h",
        "fused_adam_binding.cpp",
    }
    kernel = (tmp_path / "hip" / "fused_adam.hip").read_text()
    assert "hipLaunchKernelGGL" in kernel and "#include <hip/hip_bf16.h>" in kernel
    assert "cudaStream_t" not in kernel and "<<<" not in kernel
    binding = (tmp_path / "hip" / "fused_adam_binding_hip.cpp").read_text()
    assert "ATen/hip/HIPContext.h" in binding
