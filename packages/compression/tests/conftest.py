"""Shared set-up for slipstream-compression tests (helpers live in slipstream.compression.testing)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
