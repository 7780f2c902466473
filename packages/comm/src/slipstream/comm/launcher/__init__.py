"""The ``slipstream run`` launcher: one node through torch.distributed.run, many through
pdsh, ssh, SLURM or MPI. See docs/launcher.md."""

from __future__ import annotations

from slipstream.comm.launcher.cli import main

__all__ = ["main"]
