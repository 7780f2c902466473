"""Each distribution works installed alone, shares one version, and pins its siblings exactly."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTIONS = {
    tomllib.loads((folder / "pyproject.toml").read_text())["project"]["name"]: folder
    for folder in [
        ROOT / "kernels",
        *sorted(p.parent for p in ROOT.glob("packages/*/pyproject.toml")),
    ]
}
# Import names that differ from the distribution's suffix (ARCHITECTURE.md's package map).
IMPORT_NAMES = {"slipstream-offload-io": "offload", "slipstream-data-efficiency": "data"}


def _dependencies(project_file: Path) -> list[str]:
    """`project.dependencies`, or the umbrella's list for its hatch hook (hatch_build.py)."""
    document = tomllib.loads(project_file.read_text())
    if "dependencies" in document["project"].get("dynamic", []):
        return document["tool"]["hatch"]["metadata"]["hooks"]["custom"]["dependencies"]
    return document["project"].get("dependencies", [])


def _import_name(distribution: str) -> str:
    return IMPORT_NAMES.get(distribution, distribution.removeprefix("slipstream-"))


def _sibling_requirements(distribution: str) -> list[str]:
    """The Slipstream distributions `distribution` needs, transitively."""
    folder = DISTRIBUTIONS[distribution]
    direct = [
        r.split("==")[0]
        for r in _dependencies(folder / "pyproject.toml")
        if r.startswith("slipstream")
    ]
    needed: list[str] = []
    for name in direct:
        for sub in [*_sibling_requirements(name), name]:
            if sub not in needed:
                needed.append(sub)
    return needed


def _python_with_path(code: str, *src_dirs: Path) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter that sees only ``src_dirs`` of Slipstream.

    ``-S`` skips site-packages and their .pth files, so editable or regular installs of
    Slipstream stay invisible; the site directories of torch, numpy and safetensors are added back by hand.
    """
    import numpy
    import safetensors
    import torch

    site_dirs = {str(Path(m.__file__).resolve().parents[1]) for m in (torch, numpy, safetensors)}
    for site in site_dirs:
        assert not (Path(site) / "slipstream").exists(), (
            f"a non-editable slipstream is installed in {site}"
        )
    paths = [str(d) for d in src_dirs] + sorted(site_dirs)
    probe = f"import sys\nsys.path[:0] = {paths!r}\n" + code
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-S", "-c", probe], env=env, capture_output=True, text=True, cwd="/"
    )


def test_kernels_alone_imports_without_umbrella() -> None:
    result = _python_with_path(
        "import importlib.util\n"
        "import slipstream.kernels as k\n"
        "print(k.get_accelerator().name)\n"
        "print(importlib.util.find_spec('slipstream.comm') is None)\n",
        ROOT / "kernels" / "src",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["cpu", "True"]


def test_comm_with_kernels_only() -> None:
    result = _python_with_path(
        "import slipstream.comm as c\nprint(c.get_world_size())\n",
        ROOT / "kernels" / "src",
        ROOT / "packages" / "comm" / "src",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1"


@pytest.mark.parametrize(
    "distribution", [d for d in DISTRIBUTIONS if d not in ("slipstream", "slipstream-kernels")]
)
def test_each_package_imports_with_only_its_declared_siblings(distribution: str) -> None:
    # What `pip install <distribution>` alone gives: the package and the siblings it pins.
    needed = [*_sibling_requirements(distribution), distribution]
    result = _python_with_path(
        f"import slipstream.{_import_name(distribution)}\n"
        "import importlib.util\n"
        "print(importlib.util.find_spec('slipstream.runtime') is None)\n",
        *(DISTRIBUTIONS[name] / "src" for name in needed),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True"]


def test_umbrella_extends_namespace_across_separate_folders() -> None:
    # The umbrella's __init__ is found first; the siblings live in other folders entirely.
    result = _python_with_path(
        "import slipstream, slipstream.kernels, slipstream.comm\n"
        "print(slipstream.__version__, callable(slipstream.initialize))\n",
        ROOT / "packages" / "slipstream" / "src",
        *(DISTRIBUTIONS[name] / "src" for name in _sibling_requirements("slipstream")),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0.1.0", "True"]


def test_one_version_and_exact_sibling_pins() -> None:
    versions = {}
    for name, folder in DISTRIBUTIONS.items():
        project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
        assert project["name"] == name
        versions[name] = project["version"]
        for requirement in _dependencies(folder / "pyproject.toml"):
            if requirement.startswith("slipstream"):
                match = re.fullmatch(r"(slipstream[-a-z]*)==(.+)", requirement)
                assert match, f"{name}: sibling requirement {requirement!r} is not an exact pin"
                assert match.group(2) == project["version"]
            if requirement.startswith("torch"):
                assert requirement == "torch>=2.4", (
                    "keep torch loose: the GPU image has another torch"
                )
    assert len(set(versions.values())) == 1, versions
    assert (ROOT / "VERSION").read_text().strip() == versions["slipstream"]


@pytest.mark.slow
def test_wheels_ship_the_namespace_correctly(tmp_path: Path) -> None:
    pytest.importorskip("hatchling")
    for folder in DISTRIBUTIONS.values():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--no-deps",
                "--no-build-isolation",
                "-q",
                "-w",
                str(tmp_path),
                str(folder),
            ],
            check=True,
        )
    wheels = {w.name.split("-0")[0]: w for w in tmp_path.glob("*.whl")}
    stems = {name.replace("-", "_"): name for name in DISTRIBUTIONS}
    assert set(wheels) == set(stems), wheels
    for stem, wheel in wheels.items():
        names = zipfile.ZipFile(wheel).namelist()
        has_root_init = "slipstream/__init__.py" in names
        assert has_root_init == (stem == "slipstream"), (
            f"{wheel.name}: root __init__ {has_root_init}"
        )
        if stem != "slipstream":
            package = _import_name(stems[stem])
            assert f"slipstream/{package}/__init__.py" in names
            assert not any(
                n.startswith("slipstream/") and not n.startswith(f"slipstream/{package}/")
                for n in names
            )
    assert "slipstream/examples/gpt_config.json" in zipfile.ZipFile(wheels["slipstream"]).namelist()
