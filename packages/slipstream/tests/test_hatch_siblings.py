"""The umbrella's hatchling hook: sibling pins become checkout paths in a clone, else stay ==."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("hatchling")

UMBRELLA = Path(__file__).resolve().parents[1]
ROOT = UMBRELLA.parents[1]


def _hook_class() -> type:
    spec = importlib.util.spec_from_file_location(
        "slipstream_hatch_build", UMBRELLA / "hatch_build.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SiblingsFromCheckout


def _dependencies(
    root: Path, config: dict, monkeypatch: pytest.MonkeyPatch, mode: str | None
) -> list[str]:
    if mode is None:
        monkeypatch.delenv("SLIPSTREAM_SIBLINGS", raising=False)
    else:
        monkeypatch.setenv("SLIPSTREAM_SIBLINGS", mode)
    metadata: dict = {}
    _hook_class()(str(root), config).update(metadata)
    return metadata["dependencies"]


def test_checkout_paths_in_a_clone_and_pins_for_an_index(monkeypatch: pytest.MonkeyPatch) -> None:
    config = {"dependencies": ["torch>=2.4", "slipstream-zero==0.1.0"]}
    in_clone = _dependencies(UMBRELLA, config, monkeypatch, None)
    assert in_clone == ["torch>=2.4", f"slipstream-zero @ {(ROOT / 'packages' / 'zero').as_uri()}"]
    assert _dependencies(UMBRELLA, config, monkeypatch, "index") == config["dependencies"]


def test_outside_a_clone_pins_stay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = {"dependencies": ["slipstream-zero==0.1.0"]}
    assert _dependencies(tmp_path, config, monkeypatch, None) == ["slipstream-zero==0.1.0"]


def test_all_members_adds_every_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    deps = _dependencies(ROOT, {"dependencies": [], "all-members": True}, monkeypatch, None)
    names = {d.split(" @ ")[0] for d in deps}
    assert {"slipstream", "slipstream-kernels", "slipstream-comm", "slipstream-zero"} <= names


def test_version_mismatch_and_bad_mode_are_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="bump_version"):
        _dependencies(UMBRELLA, {"dependencies": ["slipstream-zero==9.9.9"]}, monkeypatch, None)
    with pytest.raises(ValueError, match="SLIPSTREAM_SIBLINGS='pypi'"):
        _dependencies(UMBRELLA, {"dependencies": []}, monkeypatch, "pypi")
