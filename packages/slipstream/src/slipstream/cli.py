"""The `slipstream` command: `run` (launcher) and `report` (environment and ops)."""

from __future__ import annotations

import argparse
import sys
from importlib import metadata

_DISTRIBUTIONS = (
    "slipstream",
    "slipstream-kernels",
    "slipstream-comm",
    "slipstream-zero",
    "slipstream-offload-io",
    "slipstream-pipeline",
    "slipstream-moe",
    "slipstream-inference",
    "slipstream-compression",
    "slipstream-data-efficiency",
)


def _installed_distributions() -> list[tuple[str, str]]:
    rows = []
    for name in _DISTRIBUTIONS:
        try:
            rows.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            continue
    return rows


def _report(_: argparse.Namespace) -> int:
    from slipstream.kernels.report import environment_report, format_report

    print(format_report(environment_report()))
    rows = _installed_distributions()
    print("\nSlipstream distributions installed:")
    if not rows:
        print("  none found by pip metadata (running from source folders?)")
    for name, version in rows:
        print(f"  {name:<28} {version}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `slipstream` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":
        # The launcher owns its whole argument list (script arguments included).
        from slipstream.comm.launcher import main as launcher_main

        return launcher_main(argv[1:])

    parser = argparse.ArgumentParser(
        prog="slipstream",
        description="Slipstream: DeepSpeed-compatible training of large models on PyTorch.",
    )
    parser.add_argument("--version", action="version", version=_version_line())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser(
        "run",
        help="launch a training script on one or many nodes (see `slipstream run --help`)",
        add_help=False,
    )
    report = sub.add_parser(
        "report", help="show torch, accelerators, backends and each op's kernels"
    )
    report.set_defaults(handler=_report)
    args = parser.parse_args(argv)
    if getattr(args, "handler", None) is None:
        parser.print_help()
        return 2
    return int(args.handler(args))


def _version_line() -> str:
    import slipstream

    return f"slipstream {slipstream.__version__}"


if __name__ == "__main__":
    sys.exit(main())
