"""Batch-1 bf16 decode step of the 8B Llama under launch variants, one model, interleaved rounds.

``infer_bench.py`` builds the model per run (a minute of GPU time per variant); this builds it
once and times each variant's CUDA-graph decode step (``generate`` of ``--new-tokens`` minus
``generate`` of 1, as ``infer_bench.py`` does) in ``--rounds`` interleaved rounds, so variants
are compared on the same GPU minutes apart at most. A variant is ``NAME=SETTINGS`` with
``SETTINGS`` comma-separated from:

- ``pdl`` / ``nopdl``: the ``decode_pdl`` config key on / off (default off);
- ``bs32``, ``bs64``, ``bs128``: decode_attention's slots per chunk (default: its own rule);
- ``attnloop`` / ``noloop``: decode_attention's loop form (one program per KV head walking the
  cache, no merge) at every cache size / never (default: the library's rule); ``lbsN``: its
  slots per chunk (default: the library's);
- ``rotlate``: with PDL, rotary_kv_write lets attention start only after its wait (default:
  before, ``rotary_kv_write.triton.TRIGGER_BEFORE_WAIT``);
- ``PART:FIELD=VALUE``: that decode-GEMV launch field changed for PART (qkv, out, gate_up, down,
  head, or ``norm`` for the three norm GEMVs), on top of today's launch for this GPU (the
  built-in table's, else the default rule's), installed as the user launch table.

One JSON line per timing and a summary per variant (best and median ms/step, bandwidth fraction
of the best, and the change against the first variant)::

    PYTHONPATH=$(ls -d kernels/src packages/*/src | tr '\\n' ':') python3 \\
        tools/bench/bf16_decode_variants.py base=nopdl pdl=pdl l2=pdl,out:l2_prefetch=true
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from infer_bench import best_time, build_model, copy_bandwidth

from slipstream.inference import init_inference
from slipstream.kernels.ops.decode_attention import triton as attention_triton
from slipstream.kernels.ops.decode_gemv import table as gemv_table
from slipstream.kernels.ops.rotary_kv_write import triton as rotary_triton

# 8B Llama decode shapes: projection -> (fusion, out features, in features)
SHAPES = {
    "qkv": ("norm", 6144, 4096),
    "out": ("plain", 4096, 4096),
    "gate_up": ("norm", 28672, 4096),
    "down": ("gated", 4096, 14336),
    "head": ("norm", 128256, 4096),
}
NORM_PARTS = ("qkv", "gate_up", "head")


@dataclasses.dataclass
class Variant:
    """One launch variant of the decode step."""

    name: str
    pdl: bool = False
    block_s: int = 0
    rotary_trigger_first: bool = True
    attention_loop: bool | None = None
    loop_block_s: int = 0
    changes: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)


def parse_variant(text: str) -> Variant:
    """``NAME=SETTINGS`` (see the module docstring)."""
    name, _, settings = text.partition("=")
    variant = Variant(name or text)
    fields = {field.name for field in dataclasses.fields(gemv_table.DecodeGemvConfig)}
    for setting in filter(None, settings.split(",")):
        if setting in ("pdl", "nopdl"):
            variant.pdl = setting == "pdl"
        elif setting in ("attnloop", "noloop"):
            variant.attention_loop = setting == "attnloop"
        elif setting.startswith("lbs") and setting[3:].isdigit():
            variant.loop_block_s = int(setting[3:])
        elif setting == "rotlate":
            variant.rotary_trigger_first = False
        elif setting.startswith("bs") and setting[2:].isdigit():
            variant.block_s = int(setting[2:])
        else:
            part, _, assignment = setting.partition(":")
            field, _, raw = assignment.partition("=")
            parts = NORM_PARTS if part == "norm" else (part,)
            if any(p not in SHAPES for p in parts) or field not in fields or not raw:
                raise SystemExit(
                    f"variant {text!r}: {setting!r} is not pdl, nopdl, bsN or PART:FIELD=VALUE "
                    f"(PART in {sorted(SHAPES)} or 'norm'; FIELD in {sorted(fields)})"
                )
            low = raw.lower()
            value: Any = low == "true" if low in ("true", "false") else int(raw)
            for p in parts:
                variant.changes.setdefault(p, {})[field] = value
    return variant


def install(variant: Variant, device: torch.device) -> None:
    """Make ``variant``'s launches the ones the next capture uses."""
    original = _ORIGINAL_BLOCK_S
    attention_triton.default_block_s = (  # type: ignore[assignment]
        (lambda *_: variant.block_s) if variant.block_s else original
    )
    rotary_triton.TRIGGER_BEFORE_WAIT = variant.rotary_trigger_first
    attention_triton.LOOP_MAX_SLOTS = (
        _ORIGINAL_LOOP[0]
        if variant.attention_loop is None
        else (1 << 30 if variant.attention_loop else 0)
    )
    attention_triton.LOOP_BLOCK_S = variant.loop_block_s or _ORIGINAL_LOOP[1]
    gemv_table.use_launch_table(None)
    if not variant.changes:
        return
    key = gemv_table.device_key(device)
    entries = []
    for part, (fusion, n, k) in SHAPES.items():
        config = gemv_table.lookup_launch(fusion, n, k, device)[0]
        config = dataclasses.replace(config, **variant.changes.get(part, {}))
        entries.append(gemv_table.LaunchEntry(key.name, key.sms, fusion, n, k, config))
    gemv_table.use_launch_table(entries)


_ORIGINAL_BLOCK_S = attention_triton.default_block_s
_ORIGINAL_LOOP = attention_triton.LOOP_MAX_SLOTS, attention_triton.LOOP_BLOCK_S


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("variants", nargs="+", help="NAME=SETTINGS (see the module docstring)")
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per round (best kept)")
    args = parser.parse_args()
    variants = [parse_variant(text) for text in args.variants]
    cuda = torch.cuda.is_available()  # the CPU runs the references: a smoke test only
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    bandwidth = copy_bandwidth(device)
    print(json.dumps({"result": "copy_bandwidth", "gb_per_s": round(bandwidth / 1e9, 1)}))
    started = time.perf_counter()
    model = build_model(args.preset, torch.bfloat16, device)
    ids = torch.randint(3, 500, (1, args.prompt), device=device)
    mask = torch.ones_like(ids)
    times: dict[str, list[float]] = {v.name: [] for v in variants}

    def generate(engine: Any, new: int) -> torch.Tensor:
        return engine.generate(  # type: ignore[no-any-return]
            ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=None
        )

    weight_bytes = kv_bytes = 0
    reference: torch.Tensor | None = None
    for round_index in range(args.rounds):
        order = variants[round_index % len(variants) :] + variants[: round_index % len(variants)]
        for variant in order:
            install(variant, device)
            config = {
                "dtype": "bf16",
                "replace_with_kernel_inject": True,
                "enable_cuda_graph": cuda,
                "max_out_tokens": args.prompt + args.new_tokens,
                "decode_fusion": True,
                "decode_pdl": variant.pdl,
            }
            engine = init_inference(model, config)
            fused: Any = engine.fused
            if not weight_bytes:
                weight_bytes = sum(
                    t.numel() * t.element_size()
                    for key, t in list(fused.named_parameters()) + list(fused.named_buffers())
                    if not key.startswith("embed.")
                )
                spec = fused.spec
                kv_bytes = 2 * spec.num_layers * fused.blocks[0].kv_heads * spec.head_dim * 2
                kv_bytes *= args.prompt + args.new_tokens

            tokens = generate(engine, args.new_tokens)
            if reference is None:
                reference = tokens
            same = bool(torch.equal(tokens, reference))
            full = best_time(lambda e=engine: generate(e, args.new_tokens), device, args.repeats)
            first = best_time(lambda e=engine: generate(e, 1), device, args.repeats)
            step = (full - first) / (args.new_tokens - 1)
            times[variant.name].append(step)
            print(
                json.dumps(
                    {
                        "result": "step",
                        "variant": variant.name,
                        "round": round_index,
                        "ms": round(step * 1e3, 4),
                        "same_tokens_as_first": same,
                        "allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 1)
                        if cuda
                        else 0,
                    }
                ),
                flush=True,
            )
            del engine, fused
            gc.collect()  # the engine's graphs and fused weights (QKV, gate/up: copies) go
            if cuda:
                torch.cuda.empty_cache()
    install(Variant("restore"), device)
    base = min(times[variants[0].name])
    for variant in variants:
        best = min(times[variant.name])
        summary = {
            "result": "variant",
            "variant": variant.name,
            "best_ms": round(best * 1e3, 4),
            "median_ms": round(statistics.median(times[variant.name]) * 1e3, 4),
            "tokens_per_s": round(1 / best, 1),
            "bandwidth_fraction": round((weight_bytes + kv_bytes) / best / bandwidth, 4),
            "vs_first": round(base / best, 4),
            "pdl": variant.pdl,
            "block_s": variant.block_s or "default",
            "rotary_trigger_first": variant.rotary_trigger_first,
            "attention_loop": variant.attention_loop,
            "changes": variant.changes,
            "device": name,
        }
        print(json.dumps(summary), flush=True)
    print(json.dumps({"result": "done", "seconds": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
    main()
