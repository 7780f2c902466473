"""Set one version on every distribution of the release train (and their exact sibling pins).

python tools/bump_version.py 0.2.0
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECTS = [
    ROOT / "pyproject.toml",  # slipstream-workspace (pip install . of the clone)
    ROOT / "kernels" / "pyproject.toml",
    *sorted((ROOT / "packages").glob("*/pyproject.toml")),
]
UMBRELLA_INIT = ROOT / "packages" / "slipstream" / "src" / "slipstream" / "__init__.py"


def bump(version: str) -> list[Path]:
    """Rewrite versions and `slipstream-*==` pins; return the files changed."""
    if not re.fullmatch(r"\d+\.\d+\.\d+(?:(?:a|b|rc)\d+)?", version):
        raise SystemExit(f"{version!r} is not a release version like 1.2.3 or 1.2.3rc1")
    changed = []
    for path in [*PYPROJECTS, UMBRELLA_INIT, ROOT / "VERSION"]:
        text = path.read_text()
        new = re.sub(r'(?m)^version = "[^"]+"', f'version = "{version}"', text)
        new = re.sub(r'"(slipstream(?:-[a-z-]+)?)==[^"]+"', rf'"\1=={version}"', new)
        new = re.sub(r'(?m)^__version__ = "[^"]+"', f'__version__ = "{version}"', new)
        if path.name == "VERSION":
            new = version + "\n"
        if new != text:
            path.write_text(new)
            changed.append(path)
    return changed


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    for path in bump(sys.argv[1]):
        print(f"updated {path.relative_to(ROOT)}")
