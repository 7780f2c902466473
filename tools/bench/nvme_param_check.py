"""NVMe parameter offload against CPU parameter offload, step by step, on whatever device is here.

Two ZeRO-3 engines are built side by side from the same seed (the benchmark's Llama under
``zero.Init``, bf16, AdamW, clipping 1.0, optimizer offload as ``--optimizer``): the reference
keeps the parameter shards in host memory (``offload_param.device: "cpu"``), the other swaps
them to files (``"nvme"``) with the settings of each ``--variant``. Each step feeds both the same
batch and compares the losses and then every parameter shard bit for bit; the first step and
parameter that differ are printed. Exits 1 if any variant differs.

    python tools/bench/nvme_param_check.py --model tiny --steps 4 --variant all
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama import SHAPES, Llama

# name -> offload_param overrides of the NVMe engine (max_in_cpu 0: every shard swapped)
VARIANTS: dict[str, dict[str, Any]] = {
    "swap-all": {"max_in_cpu": 0},
    "swap-all-unpinned": {"max_in_cpu": 0, "pin_memory": False},
    "swap-all-no-read-ahead": {"max_in_cpu": 0, "buffer_count": 1, "buffer_size": 1},
    "keep-all": {"max_in_cpu": 10**12},
    "default": {},
}


def _config(args: argparse.Namespace, offload_param: dict[str, Any]) -> dict[str, Any]:
    zero: dict[str, Any] = {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e8,
        "allgather_bucket_size": 5e8,
        "offload_param": offload_param,
    }
    if args.persistence is not None:
        zero["stage3_param_persistence_threshold"] = args.persistence
    if args.optimizer != "none":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "zero_optimization": zero,
    }


def _engine(args: argparse.Namespace, offload_param: dict[str, Any]) -> Any:
    import slipstream
    import slipstream.zero as zero

    config = _config(args, offload_param)
    torch.manual_seed(1234)
    init = zero.Init(config_dict_or_path=config) if args.zero_init else contextlib.nullcontext()
    with init:
        model = Llama(SHAPES[args.model])
    engine, *_ = slipstream.initialize(model=model, config=config)
    return engine


def _shards(engine: Any) -> list[tuple[str, torch.Tensor]]:
    stage3 = engine._stage3
    with stage3.shards_resident(dirty=False):
        return [(name, s.shard.detach().clone()) for name, s in stage3.named_sharded()]


def _compare(args: argparse.Namespace, name: str, nvme_path: Path, device: torch.device) -> dict:
    reference = _engine(args, {"device": "cpu", "pin_memory": True})
    nvme = {"device": "nvme", "nvme_path": str(nvme_path), "pin_memory": True}
    nvme.update(VARIANTS[name])
    candidate = _engine(args, nvme)
    store = candidate._stage3.store
    swapped = sum(store.is_swapped(t) for t in store.tensors())
    result: dict[str, Any] = {"variant": name, "swapped": swapped, "of": len(store.tensors())}
    vocab, seq = SHAPES[args.model].vocab, args.seq
    first_bad: dict[str, Any] | None = None
    losses = []
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(0, vocab, (args.micro, seq), generator=gen).to(device)
        pair = []
        for engine in (reference, candidate):
            loss = engine(ids, ids)
            engine.backward(loss)
            engine.step()
            pair.append(float(loss))
        losses.append(pair)
        if first_bad is None:
            if pair[0] != pair[1]:
                first_bad = {"step": step, "what": "loss", "values": pair}
            else:
                for (n, a), (_, b) in zip(_shards(reference), _shards(candidate)):
                    if not torch.equal(a, b):
                        diff = (a.float() - b.float()).abs()
                        first_bad = {
                            "step": step,
                            "what": n,
                            "max_abs": float(diff.max()),
                            "differing": int((diff > 0).sum()),
                            "numel": a.numel(),
                            "zero_in_candidate": int((b == 0).sum()),
                        }
                        break
    result["losses"] = losses
    result["first_difference"] = first_bad
    result["ok"] = first_bad is None
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=sorted(SHAPES))
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--persistence", type=float, default=None, help="persistence threshold")
    parser.add_argument("--optimizer", choices=["cpu", "none"], default="cpu")
    parser.add_argument("--no-zero-init", dest="zero_init", action="store_false")
    parser.add_argument("--variant", action="append", default=[])
    parser.add_argument("--nvme-path", type=Path, default=None)
    args = parser.parse_args()
    names = [v for arg in args.variant or ["all"] for v in arg.split(",")]
    if "all" in names:
        names = list(VARIANTS)
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    bad = False
    with tempfile.TemporaryDirectory(dir=args.nvme_path) as tmp:
        for name in names:
            result = _compare(args, name, Path(tmp), device)
            result.update(model=args.model, optimizer=args.optimizer, zero_init=args.zero_init)
            bad |= not result["ok"]
            if dist.get_rank() == 0:
                print("NVMECHECK " + json.dumps(result), flush=True)
    dist.destroy_process_group()
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
