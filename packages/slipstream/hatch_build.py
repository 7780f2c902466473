"""Hatchling metadata hook: Slipstream sibling pins resolve to a clone's folders when there is one.

The umbrella pins its siblings exactly (``slipstream-zero==0.1.0``), which an index resolves.
Built from a clone (``pip install ./packages/slipstream``, or ``pip install .`` at the root),
the same pins become direct references to the sibling folders (``slipstream-zero @
file:///.../packages/zero``) so that pip builds them from the checkout instead of asking an index
for versions that may not be published. A release build sets ``SLIPSTREAM_SIBLINGS=index`` (the
``nox -s build`` session does), and a wheel built from the sdist has no siblings next to it:
both keep the plain ``==`` pins an index accepts. See docs/development.md.

Configured under ``[tool.hatch.metadata.hooks.custom]``:

- ``dependencies``: the requirement list, with sibling pins written ``name==version``.
- ``all-members`` (default false): also require every member of the checkout (the root
  ``slipstream-workspace`` project uses it so that ``pip install .`` installs everything).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

from hatchling.metadata.plugin.interface import MetadataHookInterface

if sys.version_info >= (3, 11):
    import tomllib
else:  # hatchling depends on tomli before 3.11
    import tomli as tomllib

MODE_VARIABLE = "SLIPSTREAM_SIBLINGS"
_PIN = re.compile(r"(slipstream(?:-[a-z-]+)?)==(\S+)")


def _checkout_root(start: Path) -> Path | None:
    """The clone's root above `start` (it holds kernels/ and packages/), or None."""
    for folder in [start, *start.parents]:
        if (folder / "kernels" / "pyproject.toml").is_file() and (folder / "packages").is_dir():
            return folder
    return None


def checkout_members(root: Path) -> dict[str, tuple[str, Path]]:
    """Every distribution of the clone at `root`: name -> (version, folder)."""
    members: dict[str, tuple[str, Path]] = {}
    for pyproject in [
        root / "kernels" / "pyproject.toml",
        *sorted(root.glob("packages/*/pyproject.toml")),
    ]:
        project = tomllib.loads(pyproject.read_text())["project"]
        members[project["name"]] = (project["version"], pyproject.parent.resolve())
    return members


class SiblingsFromCheckout(MetadataHookInterface):
    """Fill ``project.dependencies``: sibling pins as checkout paths in a clone, else ``==``."""

    PLUGIN_NAME = "custom"

    def update(self, metadata: dict[str, Any]) -> None:
        requirements = list(self.config.get("dependencies", []))
        mode = os.environ.get(MODE_VARIABLE, "checkout")
        if mode not in ("checkout", "index"):
            raise ValueError(f"{MODE_VARIABLE}={mode!r}: use 'checkout' (the default) or 'index'")
        root = _checkout_root(Path(self.root).resolve()) if mode == "checkout" else None
        members = checkout_members(root) if root is not None else {}
        if self.config.get("all-members", False):
            if root is None:
                raise ValueError("all-members needs a Slipstream clone (kernels/ and packages/)")
            named = {_PIN.fullmatch(r).group(1) for r in requirements if _PIN.fullmatch(r)}  # type: ignore[union-attr]
            requirements += [f"{n}=={v}" for n, (v, _) in members.items() if n not in named]
        metadata["dependencies"] = [self._resolve(r, members) for r in requirements]

    @staticmethod
    def _resolve(requirement: str, members: dict[str, tuple[str, Path]]) -> str:
        pin = _PIN.fullmatch(requirement)
        if pin is None or pin.group(1) not in members:
            return requirement
        name, wanted = pin.groups()
        version, folder = members[name]
        if version != wanted:
            raise ValueError(
                f"{requirement!r}: the checkout's {name} is {version}; "
                "run tools/bump_version.py so that every distribution has one version"
            )
        return f"{name} @ {folder.as_uri()}"
