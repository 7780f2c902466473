"""Rank-aware logging for the `slipstream` logger: rank 0 speaks, the others only warn."""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "[slipstream rank{rank}] %(asctime)s %(levelname)s %(message)s"


def setup_logging(rank: int) -> None:
    """Give the `slipstream` logger a stderr handler unless the application configured logging.

    Rank 0 logs at INFO (or ``SLIPSTREAM_LOG_LEVEL``); other ranks log warnings and errors only,
    unless ``SLIPSTREAM_LOG_ALL_RANKS=1``. An application that installs its own handlers (on the
    root or the `slipstream` logger) keeps full control: nothing is added then.
    """
    package_logger = logging.getLogger("slipstream")
    if package_logger.handlers or logging.getLogger().handlers:
        return
    level_name = os.environ.get("SLIPSTREAM_LOG_LEVEL", "INFO").upper()
    level = logging.getLevelName(level_name)
    if not isinstance(level, int):
        raise ValueError(
            f"SLIPSTREAM_LOG_LEVEL={level_name!r} is not a logging level; use DEBUG, INFO, WARNING or ERROR"
        )
    if rank != 0 and os.environ.get("SLIPSTREAM_LOG_ALL_RANKS") != "1":
        level = max(level, logging.WARNING)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT.format(rank=rank), datefmt="%H:%M:%S"))
    package_logger.addHandler(handler)
    package_logger.setLevel(level)
    package_logger.propagate = False
