"""``slipstream serve MODEL``: load a model and serve it over the OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import logging
import os
import signal
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    """The ``slipstream serve`` options (the serving config's keys, spelt as flags)."""
    parser = argparse.ArgumentParser(
        prog="slipstream serve",
        description="Serve a decoder-only model (Hugging Face id or folder) with "
        "continuous batching over a paged KV cache, behind an OpenAI-compatible API.",
    )
    parser.add_argument("model", help="Hugging Face model id or local folder")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks (launch that many processes with `slipstream run`)",
    )
    parser.add_argument("--served-model-name", help="the 'model' clients send (default MODEL)")
    parser.add_argument("--device", help="default: cuda when available, else cpu")
    parser.add_argument(
        "--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto"
    )
    parser.add_argument("--max-model-len", type=int, help="longest prompt + output")
    parser.add_argument("--num-blocks", type=int, help="KV-cache blocks (default: from memory)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="token budget per forward pass"
    )
    parser.add_argument("--max-num-seqs", type=int, default=256, help="most running requests")
    parser.add_argument("--kv-cache-memory-fraction", type=float, default=0.9)
    parser.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    parser.add_argument("--log-level", default="info", help="uvicorn and slipstream log level")
    return parser


def _init_tensor_parallel(tp: int) -> None:
    """Join the process group ``slipstream run`` (or torchrun) set up, one device per rank."""
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))  # the launcher's contract
    if world != tp:
        raise SystemExit(
            f"slipstream serve --tp {tp} needs {tp} processes, one per GPU; this one sees "
            f"WORLD_SIZE={world}. Launch it as `slipstream run --num_gpus {tp} --module "
            f"--no_local_rank slipstream.inference.serving.cli MODEL --tp {tp}`"
        )
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if dist.get_rank() != 0:
        # Rank 0 owns shutdown: on SIGTERM it drains its requests, then releases the workers.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``slipstream serve``; returns once the server has shut down."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    from slipstream.inference.serving.pipeline import serve
    from slipstream.inference.serving.server import build_server

    config = {
        "block_size": args.block_size,
        "num_blocks": args.num_blocks,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len,
        "enable_prefix_caching": not args.no_prefix_caching,
        "dtype": args.dtype,
        "kv_cache_memory_fraction": args.kv_cache_memory_fraction,
    }
    if args.tp > 1:
        _init_tensor_parallel(args.tp)
    deployment = serve(args.model, config=config, device=args.device, tensor_parallel=args.tp)
    if deployment is None:
        return 0  # a tensor-parallel worker rank: rank 0's server has shut down
    deployment.model_name = args.served_model_name or args.model
    server = build_server(deployment, args.host, args.port, log_level=args.log_level)
    server.run()
    deployment.shutdown(drain=True)  # no-op when the app's lifespan already drained it
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
