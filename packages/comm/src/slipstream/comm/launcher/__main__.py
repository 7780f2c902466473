"""``python -m slipstream.comm.launcher``: what the per-node commands of a multi-node job run."""

from __future__ import annotations

import sys

from slipstream.comm.launcher.cli import main

if __name__ == "__main__":
    sys.exit(main())
