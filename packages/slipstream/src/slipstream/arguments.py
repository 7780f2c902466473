"""``add_config_arguments``: DeepSpeed's command-line flags for the config, plus Slipstream's alias."""

from __future__ import annotations

import argparse

__all__ = ["add_config_arguments"]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the config flags of ``deepspeed.add_config_arguments`` to ``parser`` and return it.

    - ``--deepspeed``: a flag for user code to branch on (Slipstream does not read it).
    - ``--deepspeed_config PATH`` or its alias ``--slipstream_config PATH``: the config file,
      both stored in ``args.deepspeed_config``.
    - ``--deepscale`` / ``--deepscale_config PATH``: DeepSpeed's deprecated spellings, kept in
      their own attributes as DeepSpeed does (``initialize`` reads ``deepscale_config`` too).
    - ``--deepspeed_mpi``: ask for MPI discovery of the rank and world size.

    >>> parser = add_config_arguments(argparse.ArgumentParser())
    >>> parser.parse_args(["--slipstream_config", "ds.json"]).deepspeed_config
    'ds.json'
    """
    group = parser.add_argument_group(
        "Slipstream", "Slipstream (DeepSpeed-compatible) configuration"
    )
    group.add_argument(
        "--deepspeed",
        default=False,
        action="store_true",
        help="enable Slipstream/DeepSpeed (a flag for user code; the engine does not read it)",
    )
    group.add_argument(
        "--deepspeed_config",
        "--slipstream_config",
        dest="deepspeed_config",
        default=None,
        type=str,
        metavar="PATH",
        help="the JSON config file (DeepSpeed's schema; // comments allowed)",
    )
    group.add_argument(
        "--deepscale",
        default=False,
        action="store_true",
        help="deprecated DeepSpeed spelling of --deepspeed",
    )
    group.add_argument(
        "--deepscale_config",
        default=None,
        type=str,
        metavar="PATH",
        help="deprecated DeepSpeed spelling of --deepspeed_config",
    )
    group.add_argument(
        "--deepspeed_mpi",
        default=False,
        action="store_true",
        help="discover the rank and world size from the MPI environment",
    )
    return parser
