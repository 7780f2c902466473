"""The ``slipstream`` console script: ``run`` lives here; other distributions add subcommands.

``slipstream-comm`` owns the launcher, so it owns the command. Distributions installed beside it
register further subcommands (``report``, ``estimate``, ``convert`` from the umbrella) in the
``slipstream.commands`` entry-point group: each entry is a callable ``(argv) -> exit status``.
"""

from __future__ import annotations

import sys
from importlib import metadata

ENTRY_POINT_GROUP = "slipstream.commands"

# Where the subcommands a user may expect come from, for the error when they are missing.
_PROVIDERS = {
    "report": "slipstream",
    "estimate": "slipstream",
    "convert": "slipstream",
    "build-ops": "slipstream",
    "io-bench": "slipstream",
}


def installed_commands() -> dict[str, metadata.EntryPoint]:
    """The subcommands that installed distributions register, by name."""
    return {entry.name: entry for entry in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _usage(commands: dict[str, metadata.EntryPoint]) -> str:
    lines = [
        "usage: slipstream COMMAND [ARGS]",
        "",
        "commands:",
        "  run          launch a training script on one or many nodes (slipstream run --help)",
    ]
    for name, entry in sorted(commands.items()):
        owner = entry.dist.name if entry.dist is not None else "?"
        lines.append(f"  {name:<12} from {owner} (slipstream {name} --help)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``slipstream`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":
        # The launcher owns its whole argument list (script arguments included).
        from slipstream.comm.launcher import main as launcher_main

        return launcher_main(argv[1:])
    commands = installed_commands()
    if argv and argv[0] in commands:
        return int(commands[argv[0]].load()(argv[1:]))
    if argv and argv[0] in ("--version", "-V"):
        print(f"slipstream-comm {metadata.version('slipstream-comm')}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(commands))
        return 0 if argv else 2
    provider = _PROVIDERS.get(argv[0])
    hint = (
        f"it comes with the {provider!r} distribution: pip install {provider}"
        if provider
        else "see `slipstream --help`"
    )
    print(f"slipstream: unknown command {argv[0]!r}; {hint}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
