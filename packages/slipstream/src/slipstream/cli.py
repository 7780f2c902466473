"""The `slipstream` command: `run` (launcher), `build-ops`, `report`, `estimate` (memory),
`convert` (checkpoints), `io-bench` (NVMe offload bandwidth) and `serve` (OpenAI-compatible
model server)."""

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


def _estimate(args: argparse.Namespace) -> int:
    from slipstream.runtime.estimate import (
        estimate_activations,
        format_estimate,
        transformer_params,
    )

    shape = (args.hidden, args.layers)
    if args.params is None and None in shape:
        print("slipstream estimate: give --params, or --hidden and --layers", file=sys.stderr)
        return 2
    params = (
        int(float(args.params))
        if args.params is not None
        else transformer_params(
            args.hidden,
            args.layers,
            args.vocab,
            ffn=args.ffn,
            gated=args.swiglu,
            tied=not args.untied,
        )
    )
    activations = None
    if None not in (args.hidden, args.layers, args.seq, args.micro_batch, args.heads):
        activations = estimate_activations(
            args.hidden,
            args.layers,
            args.seq,
            args.micro_batch,
            args.heads,
            bytes_per_value=4 if args.dtype == "fp32" else 2,
        )
    world = args.num_gpus * args.num_nodes
    if not 0.0 <= args.offload_ratio <= 1.0:
        print("slipstream estimate: --offload-ratio must be in [0, 1]", file=sys.stderr)
        return 2
    print(
        format_estimate(
            params,
            world,
            4 if args.dtype == "fp32" else 2,
            activations,
            args.offload_ratio,
            ranks_per_node=args.num_gpus,
        )
    )
    return 0


def _convert(args: argparse.Namespace) -> int:
    from slipstream.runtime.checkpoint import CheckpointError
    from slipstream.runtime.model_export import convert_to_hf_safetensors, parse_size

    try:
        written = convert_to_hf_safetensors(
            args.checkpoint_dir,
            args.out_dir,
            tag=args.tag,
            max_shard_bytes=parse_size(args.max_shard_size),
            dtype=args.dtype,
            progress=not args.quiet,
            verify_checksums=not args.no_verify,
        )
    except (CheckpointError, ValueError, OSError) as error:
        # User errors (a missing directory or tag, a damaged file, an unwritable output
        # folder, a bad size): one line, no traceback.
        print(f"slipstream convert: error: {error}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


def _add_tool_commands(sub: argparse._SubParsersAction) -> None:
    estimate = sub.add_parser(
        "estimate",
        help="memory per rank for model states at each ZeRO stage, and activations",
        description="Bytes per rank for parameters, gradients and Adam states at ZeRO stages "
        "0-3 (as this implementation allocates them), and transformer activation memory.",
    )
    estimate.add_argument("--params", help="parameter count (e.g. 1.3e9); default from the shape")
    estimate.add_argument("--hidden", type=int, help="hidden size")
    estimate.add_argument("--layers", type=int, help="transformer layers")
    estimate.add_argument("--heads", type=int, help="attention heads")
    estimate.add_argument("--seq", type=int, help="sequence length")
    estimate.add_argument("--micro-batch", type=int, help="micro-batch per rank")
    estimate.add_argument("--vocab", type=int, default=50304, help="vocabulary (default 50304)")
    estimate.add_argument("--ffn", type=int, help="MLP width (default 4 × hidden)")
    estimate.add_argument("--swiglu", action="store_true", help="gated MLP (3 matrices)")
    estimate.add_argument("--untied", action="store_true", help="separate LM head")
    estimate.add_argument("--num-gpus", type=int, default=1, help="ranks per node")
    estimate.add_argument("--num-nodes", type=int, default=1, help="nodes")
    estimate.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    estimate.add_argument(
        "--offload-ratio",
        type=float,
        default=1.0,
        help="offload_optimizer.ratio: also print what partial CPU offload keeps on the GPU",
    )
    estimate.set_defaults(handler=_estimate)

    convert = sub.add_parser(
        "convert",
        help="consolidate a (ZeRO) checkpoint into Hugging Face-style safetensors",
        description="Stream a Slipstream checkpoint of any world size and stage into "
        "model.safetensors (or model-0000i-of-0000n.safetensors + an index past the size limit).",
    )
    convert.add_argument("checkpoint_dir", help="the save_checkpoint directory")
    convert.add_argument("out_dir", help="where to write the safetensors files")
    convert.add_argument("--tag", help="checkpoint tag (default: the one in 'latest')")
    convert.add_argument("--max-shard-size", default="5GB", help="per output file (default 5GB)")
    convert.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    convert.add_argument("--quiet", action="store_true", help="no progress bar")
    convert.add_argument(
        "--no-verify",
        action="store_true",
        help="skip checking every file against the manifest's checksums (faster, unsafe)",
    )
    convert.set_defaults(handler=_convert)


def main(argv: list[str] | None = None) -> int:
    """Every subcommand, ``run`` included (``python -m slipstream.cli`` from source folders).

    Installed, the ``slipstream`` script is slipstream-comm's, which calls the ``*_command``
    functions below for the subcommands this distribution adds.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":
        # The launcher owns its whole argument list (script arguments included).
        from slipstream.comm.launcher import main as launcher_main

        return launcher_main(argv[1:])
    if argv and argv[0] == "build-ops":
        # Prebuild the C++ ops into the extension cache (slipstream.kernels owns the options),
        # then the NVMe I/O engine of slipstream-offload-io.
        from slipstream.kernels.build_ops import main as build_ops_main
        from slipstream.offload.build import main as build_aio_main

        status = build_ops_main(argv[1:])
        return build_aio_main(argv[1:]) or status
    if argv and argv[0] == "io-bench":
        from slipstream.offload.io_bench import main as io_bench_main

        return io_bench_main(argv[1:])
    if argv and argv[0] == "serve":
        # slipstream-inference owns the serving options (pip install slipstream-inference[serve]).
        from slipstream.inference.serving.cli import main as serve_main

        return serve_main(argv[1:])

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
    sub.add_parser(
        "build-ops",
        help="prebuild the C++ ops into the extension cache (see `slipstream build-ops --help`)",
        add_help=False,
    )
    sub.add_parser(
        "io-bench",
        help="measure NVMe offload read/write GB/s against the raw disk; suggest aio settings "
        "(see `slipstream io-bench --help`)",
        add_help=False,
    )
    sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API (see `slipstream serve --help`)",
        add_help=False,
    )
    report = sub.add_parser(
        "report", help="show torch, accelerators, backends and each op's kernels"
    )
    report.set_defaults(handler=_report)
    _add_tool_commands(sub)
    args = parser.parse_args(argv)
    if getattr(args, "handler", None) is None:
        parser.print_help()
        return 2
    return int(args.handler(args))


# The subcommands this distribution adds to the `slipstream` script of slipstream-comm (the
# "slipstream.commands" entry points in pyproject.toml); each takes the arguments after its name.
def report_command(argv: list[str]) -> int:
    """``slipstream report``."""
    return main(["report", *argv])


def estimate_command(argv: list[str]) -> int:
    """``slipstream estimate``."""
    return main(["estimate", *argv])


def convert_command(argv: list[str]) -> int:
    """``slipstream convert``."""
    return main(["convert", *argv])


def build_ops_command(argv: list[str]) -> int:
    """``slipstream build-ops``."""
    return main(["build-ops", *argv])


def io_bench_command(argv: list[str]) -> int:
    """``slipstream io-bench``."""
    return main(["io-bench", *argv])


def _version_line() -> str:
    import slipstream

    return f"slipstream {slipstream.__version__}"


if __name__ == "__main__":
    sys.exit(main())
