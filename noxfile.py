"""Every developer task of the Slipstream monorepo: tests per package, lint, typecheck, demo, build.

torch is installed once, not per session: the torch of the interpreter that runs nox (a venv or
the system's: what the README asks you to install first) is shared with every session's venv
through a ``.pth`` file; where that interpreter has none, ``SLIPSTREAM_TORCH_SPEC`` (default
``torch==2.13.0``) is installed once into ``.nox/_shared-torch`` and shared the same way. Session
venvs therefore hold only the small test tools, and are reused between runs (``-R`` is implied).
"""

from __future__ import annotations

import enum
import importlib.util
import os
import sysconfig
from pathlib import Path

import nox

ROOT = Path(__file__).parent
nox.options.reuse_existing_virtualenvs = True
nox.options.default_venv_backend = "venv"
nox.options.sessions = ["lint", "typecheck", "tests", "kernels"]

TORCH_SPEC = os.environ.get("SLIPSTREAM_TORCH_SPEC", "torch==2.13.0")
SHARED_TORCH = ROOT / ".nox" / "_shared-torch"
VENV_PARAMS: list[str] = []
TEST_TOOLS = ["pytest>=8", "pytest-timeout", "hatchling>=1.18", "editables"]
# What a package's tests need beyond the package itself (real HF models for MoE conversion).
TEST_EXTRAS: dict[str, list[str]] = {
    "kernels": [
        "triton>=3.9"
    ],  # the CPU interpreter (TRITON_INTERPRET=1); 3.6's breaks on NumPy 2.4
    "moe": ["transformers>=4.40"],
    # Ulysses: the HF attention helper's parity test (AttentionInterface, masking_utils)
    "comm": ["transformers>=4.53"],
    "data_efficiency": ["triton>=3.9"],  # the token kernels under TRITON_INTERPRET=1
    # inference: HF models for parity; serving: its [serve] extra (ASGI stack) and httpx for tests
    "inference": [
        "triton>=3.9",
        "transformers>=4.45",
        "starlette>=0.37",
        "uvicorn>=0.29",
        "httpx>=0.27",
    ],
    # compression: tiny HF models; its export test serves through inference (installed before it)
    "compression": ["transformers>=4.45"],
    "offload_io": ["aiofiles>=23.1", "xxhash>=3.0"],
    # swap payload and checkpoint checksums (slipstream.offload.checksum)
    "zero": ["xxhash>=3.0"],
    # + the tensorboard monitor's files; transformers: Ulysses training and AutoTP parity on a
    # tiny random Llama
    "slipstream": ["xxhash>=3.0", "tensorboard>=2.14", "transformers>=4.53"],
    # The Trainer, Accelerate and Lightning integrations (docs/integrations.md's tested versions).
    "integration": ["xxhash>=3.0", "transformers>=4.46", "accelerate>=1.1", "lightning>=2.4"],
}


class Package(enum.Enum):
    """Distributions in dependency order: each may import only those before it."""

    kernels = "kernels"
    comm = "packages/comm"
    offload_io = "packages/offload-io"
    zero = "packages/zero"
    pipeline = "packages/pipeline"
    moe = "packages/moe"
    data_efficiency = "packages/data-efficiency"
    inference = "packages/inference"
    compression = "packages/compression"
    slipstream = "packages/slipstream"

    @property
    def path(self) -> Path:
        return ROOT / self.value

    def with_dependencies(self) -> list[Package]:
        members = list(Package)
        return members[: members.index(self) + 1]


def _torch_site(session: nox.Session) -> Path:
    """The folder holding torch for every session: nox's own interpreter's, else a shared one."""
    spec = importlib.util.find_spec("torch")  # this process's interpreter: no probe to run
    if spec is not None and spec.origin is not None:
        return Path(spec.origin).resolve().parents[1]
    marker = SHARED_TORCH / ".installed"
    if not marker.is_file() or marker.read_text() != TORCH_SPEC:
        session.log(f"installing {TORCH_SPEC} once into {SHARED_TORCH} (shared by every session)")
        session.run(
            "python", "-m", "pip", "install", "--quiet", "--upgrade", "--target",
            str(SHARED_TORCH), TORCH_SPEC,
        )  # fmt: skip
        marker.write_text(TORCH_SPEC)
    return SHARED_TORCH


def _install_torch(session: nox.Session) -> None:
    """Make the shared torch importable in the session's venv (a .pth file; nothing copied)."""
    venv = str(session.virtualenv.location)
    site = Path(sysconfig.get_path("purelib", vars={"base": venv, "platbase": venv}))
    # Named to sort after the editable installs' .pth files, so that the src/ folders of this
    # checkout come first on sys.path.
    (site / "zz_slipstream_shared_torch.pth").write_text(f"{_torch_site(session)}\n")


def _install(session: nox.Session, packages: list[Package], *extra: str) -> None:
    """Install torch, the test tools and `packages` (editable) into the session's venv."""
    _install_torch(session)
    session.install(*TEST_TOOLS, "numpy", "safetensors>=0.4", *extra)
    editable: list[str] = []
    for package in packages:
        editable += ["-e", str(package.path)]
    session.install("--no-build-isolation", "--no-deps", *editable)


@nox.session(venv_params=VENV_PARAMS)
@nox.parametrize("package", [*(p.name for p in Package), "integration"])
def tests(session: nox.Session, package: str) -> None:
    """Run one package's unit tests (or the cross-package integration tests) on CPU."""
    extras = TEST_EXTRAS.get(package, [])
    if package == "integration":
        _install(session, list(Package), *extras)
        test_dir = ROOT / "integration-tests"
    else:
        member = Package[package]
        _install(session, member.with_dependencies(), *extras)
        test_dir = member.path / "tests"
    if package in ("kernels", "offload_io"):
        # Build the C++ CPU optimizers once, visibly, instead of inside the first test using them.
        session.run("python", "-m", "slipstream.kernels.build_ops")
    if package == "offload_io":
        session.run("python", "-m", "slipstream.offload.build")  # the NVMe I/O engine
    # One line per test (progress in long sessions) and the ten slowest tests of each package
    # in the log: CI must stay well under 30 minutes.
    args = session.posargs or ["-m", "not gpu and not aot", "-v", "--durations=10"]
    session.run("python", "-m", "pytest", str(test_dir), *args, env={"OMP_NUM_THREADS": "1"})


@nox.session(venv_params=VENV_PARAMS)
def kernels(session: nox.Session) -> None:
    """Ahead-of-time builds without a GPU: every Triton kernel for sm_80, sm_90, gfx90a, gfx942
    and gfx1100, plus the CUDA C++ sources through nvcc and hipify where nvcc is present."""
    _install(session, [Package.kernels], "triton>=3.9")
    session.run("python", "-m", "slipstream.kernels.aot", "--out", str(ROOT / "build" / "aot"))
    session.run("python", "-m", "pytest", str(Package.kernels.path / "tests"), "-m", "aot")


@nox.session(venv_params=VENV_PARAMS)
def gpu(session: nox.Session) -> None:
    """Run every package's tests marked `gpu` (needs a CUDA or ROCm device; never in CI)."""
    _install(session, list(Package))
    dirs = [str(p.path / "tests") for p in Package] + [str(ROOT / "integration-tests")]
    session.run("python", "-m", "pytest", *dirs, "-m", "gpu", *session.posargs)


@nox.session(venv_params=VENV_PARAMS)
def lint(session: nox.Session) -> None:
    """Ruff: lint rules and formatting."""
    session.install("ruff==0.17.6")  # pinned: formatting changes between ruff releases
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(venv_params=VENV_PARAMS)
def typecheck(session: nox.Session) -> None:
    """Mypy over every distribution's sources."""
    _install(session, list(Package), "mypy>=1.10")
    sources = [str(p.path / "src") for p in Package]
    # Sources are checked from their src/ folders (PEP 420 namespace `slipstream`), so that a
    # package's imports of its siblings resolve to their code rather than to `Any`.
    session.run("python", "-m", "mypy", *sources, env={"MYPYPATH": os.pathsep.join(sources)})


@nox.session(venv_params=VENV_PARAMS)
def demo(session: nox.Session) -> None:
    """The README's main job: a small GPT trained on 2 processes, checkpointed and resumed.

    Two processes on the CPU (gloo) or on two GPUs (NCCL/RCCL); one on a single-GPU machine,
    since NCCL does not allow two ranks on one device.
    """
    _install(session, list(Package))
    count = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    gpus = int(str(session.run("python", "-c", count, silent=True)).strip().splitlines()[-1])
    procs = 1 if gpus == 1 else 2
    out = ROOT / "runs" / "demo"
    session.run(
        "slipstream",
        "run",
        "--num_procs",
        str(procs),
        "--module",
        "slipstream.examples.gpt",
        "--out",
        str(out),
        *session.posargs,
    )


@nox.session(venv_params=VENV_PARAMS)
def bench(session: nox.Session) -> None:
    """Training throughput beside DDP and FSDP2 (tools/bench/run_all.py; needs GPUs, never in CI).

    ``nox -s bench -- --gpus 2 ddp@1.3b/4 fsdp2@1.3b/4 slipstream:2@1.3b/4`` runs each spec in turn
    and prints a markdown table for docs/benchmarks.md (with the command, date and machine).
    """
    _install(session, list(Package))
    specs = session.posargs or [
        "--gpus", "2", "ddp@1.3b/4", "fsdp2@1.3b/4", "slipstream:0@1.3b/4",
    ]  # fmt: skip
    session.run("python", str(ROOT / "tools" / "bench" / "run_all.py"), *specs)


@nox.session(venv_params=VENV_PARAMS)
def build(session: nox.Session) -> None:
    """Build a wheel and an sdist of every distribution into dist/, as they are published.

    ``SLIPSTREAM_SIBLINGS=index`` keeps the umbrella's sibling pins as ``==`` (an index resolves
    them); without it, a build from this clone would point them at its folders.
    """
    session.install("build", "hatchling>=1.18")
    for package in Package:
        session.run(
            "python",
            "-m",
            "build",
            "--no-isolation",
            "--outdir",
            str(ROOT / "dist"),
            str(package.path),
            env={"SLIPSTREAM_SIBLINGS": "index"},
        )
