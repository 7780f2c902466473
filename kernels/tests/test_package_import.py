"""``import slipstream.kernels`` stays cheap, and its public names resolve lazily."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import slipstream.kernels as kernels


def test_import_does_not_load_torch() -> None:
    code = "import sys, slipstream.kernels; print('torch' in sys.modules)"
    completed = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert completed.stdout.strip() == "False"


def test_public_names_resolve() -> None:
    from slipstream.kernels.accelerator import get_accelerator
    from slipstream.kernels.registry import get_op

    assert kernels.get_accelerator is get_accelerator
    assert kernels.get_op is get_op
    for name in kernels.__all__:
        assert getattr(kernels, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = kernels.nope
