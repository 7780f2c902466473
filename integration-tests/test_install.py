"""Installs as a user does: release wheels one distribution at a time, and the clone's folders.

One clean virtualenv (no system site-packages) gets torch from the same release as this
interpreter's (``torch==<this version>``: never a CUDA download on a CPU machine), then:

- each distribution's wheel alone (with ``==`` pins resolved from the wheel set), imported in a
  fresh interpreter with warnings shown, and uninstalled again;
- ``pip install ./packages/slipstream`` and ``pip install .`` at the root, from the clone.

About a minute on the 2-core CI machine, most of it installing torch once.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
MEMBERS = {
    tomllib.loads((folder / "pyproject.toml").read_text())["project"]["name"]: folder
    for folder in [
        ROOT / "kernels",
        *sorted(p.parent for p in ROOT.glob("packages/*/pyproject.toml")),
    ]
}
IMPORT_NAMES = {"slipstream-offload-io": "offload", "slipstream-data-efficiency": "data"}

pytestmark = pytest.mark.slow


def _import_name(distribution: str) -> str:
    if distribution == "slipstream":
        return "slipstream"
    return "slipstream." + IMPORT_NAMES.get(distribution, distribution.removeprefix("slipstream-"))


class CleanVenv:
    """A virtualenv that sees nothing of this interpreter's site-packages."""

    def __init__(self, path: Path) -> None:
        venv.EnvBuilder(with_pip=True, system_site_packages=False).create(path)
        self.python = str(path / "bin" / "python")
        self.bin = path / "bin"
        # The pip configuration (find-links, index) stays; PYTHONPATH must not leak the src/ folders.
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [self.python, *args], env=self.env, capture_output=True, text=True, cwd="/"
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"{args} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            )
        return result

    def pip(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.run("-m", "pip", "--disable-pip-version-check", "-q", *args)

    def slipstream_distributions(self) -> set[str]:
        listed = self.run("-m", "pip", "list", "--format=freeze").stdout.split()
        return {line.split("==")[0] for line in listed if line.startswith("slipstream")}

    def remove_slipstream(self) -> None:
        installed = self.slipstream_distributions()
        if installed:
            self.pip("uninstall", "-y", *installed)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The release wheel set, built as `nox -s build` does (sibling pins kept as ``==``)."""
    pytest.importorskip("hatchling")
    out = tmp_path_factory.mktemp("wheels")
    env = {**os.environ, "SLIPSTREAM_SIBLINGS": "index"}
    for folder in MEMBERS.values():
        subprocess.run(
            [sys.executable, "-m", "hatchling", "build", "-t", "wheel", "-d", str(out)],
            cwd=folder,
            env=env,
            check=True,
            capture_output=True,
        )
    return out


@pytest.fixture(scope="module")
def clean_venv(tmp_path_factory: pytest.TempPathFactory) -> CleanVenv:
    import torch

    env = CleanVenv(tmp_path_factory.mktemp("venv") / "env")
    env.pip("install", f"torch=={torch.__version__}")
    return env


def test_release_wheels_pin_siblings_exactly(wheels: Path) -> None:
    for wheel in wheels.glob("*.whl"):
        with zipfile.ZipFile(wheel) as archive:
            meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
            requires = [
                line.removeprefix("Requires-Dist: ")
                for line in archive.read(meta).decode().splitlines()
                if line.startswith("Requires-Dist: slipstream")
            ]
        for requirement in requires:
            assert re.fullmatch(r"slipstream[-a-z]*==[0-9][^ @;]*(; extra == .*)?", requirement), (
                wheel.name,
                requires,
            )


def test_each_wheel_alone_installs_and_imports(wheels: Path, clean_venv: CleanVenv) -> None:
    for distribution in MEMBERS:
        clean_venv.remove_slipstream()
        clean_venv.pip("install", "--find-links", str(wheels), distribution)
        # -W default: torch's "Failed to initialize NumPy" and other import warnings would show.
        result = clean_venv.run("-W", "default", "-c", f"import {_import_name(distribution)}")
        assert result.stderr == "", (distribution, result.stderr)
        installed = clean_venv.slipstream_distributions()
        assert distribution in installed
        if distribution != "slipstream":
            assert "slipstream" not in installed, (distribution, installed)
            # The umbrella's modules are absent: this is the package alone.
            probe = clean_venv.run("-c", "import slipstream.runtime", check=False)
            assert probe.returncode != 0, distribution
        if distribution == "slipstream-comm":
            usage = subprocess.run(
                [str(clean_venv.bin / "slipstream"), "run", "--help"],
                capture_output=True,
                text=True,
            )
            assert usage.returncode == 0 and "slipstream run" in usage.stdout, usage.stderr
            missing = subprocess.run(
                [str(clean_venv.bin / "slipstream"), "report"], capture_output=True, text=True
            )
            assert missing.returncode == 2 and "pip install slipstream" in missing.stderr


def test_clone_installs_resolve_siblings_from_the_checkout(clean_venv: CleanVenv) -> None:
    # Builds without isolation (hatchling installed once) save a build venv per distribution;
    # the hook sees the same clone either way, since pip builds a local folder in place.
    clean_venv.pip("install", "hatchling>=1.18")
    # The umbrella's folder alone: its sibling pins become paths into this clone.
    clean_venv.remove_slipstream()
    clean_venv.pip("install", "--no-build-isolation", str(ROOT / "packages" / "slipstream"))
    assert clean_venv.slipstream_distributions() >= set(MEMBERS) - {"slipstream-workspace"}
    report = subprocess.run(
        [str(clean_venv.bin / "slipstream"), "report"], capture_output=True, text=True
    )
    assert report.returncode == 0 and "slipstream-zero" in report.stdout, report.stderr
    # The root: every distribution of the clone, the umbrella's public names listed.
    clean_venv.remove_slipstream()
    clean_venv.pip("install", "--no-build-isolation", str(ROOT))
    assert clean_venv.slipstream_distributions() == {*MEMBERS, "slipstream-workspace"}
    names = clean_venv.run("-c", "import slipstream; print(dir(slipstream))").stdout
    assert "'initialize'" in names and "'zero'" in names
