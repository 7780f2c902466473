"""Batch-1 quantized (int4 / int8) decode step of the 8B Llama under launch variants, beside bf16.

One model, one quantized engine and (for ``bf16`` variants) one bf16 engine, built once; each
variant changes what the next CUDA-graph capture launches and recaptures (no requantizing), and
the variants run in ``--rounds`` interleaved rounds, so they are compared on the same GPU
seconds apart. The step is timed as ``infer_bench.py`` times it: the decode steps of a
``generate`` of ``--new-tokens`` on the device's clock (prefill excluded), the best and median
of ``--repeats`` calls a round after a warm-up; the older difference measure (``generate`` of
``new`` minus ``generate`` of 1) is printed beside it. A variant is ``NAME=SETTINGS``, with
``SETTINGS`` comma-separated from:

- ``bf16``: the bf16 engine (library defaults), the baseline of the speed-ups;
- ``pdl=on|l2_partial|off``: ``quant.weight.decode_pdl``'s launch mode (default: the config's);
- ``early`` / ``noearly``: decode_attention lets the next kernel (the output projection)
  launch at once (the fused decoder's ``quant_attention_trigger``; default: the library's);
- ``attnpdl`` / ``noattnpdl``: decode_attention itself launched with programmatic dependent
  launch (the fused decoder's ``quant_attention_pdl``; default: the library's);
- ``table=PATH``: the launch table at PATH (``quant_decode_bench.py --table-out``) as the user
  table; ``parts=qkv+out``: only those parts' entries of it;
- ``rule``: every part at the rule's launch (``fused_gemv._default_config``), ahead of the
  built-in table;
- ``scales=fp32|fp16|bf16``: the quantized linears' group scales cast to that dtype for the
  variant (the engine quantizes with ``--scale-dtype``; a cast from fp16 to fp32 is exact, so
  the tokens stay the same: the variant times the scale bytes alone);
- ``PART:FIELD=VALUE``: that ``FusedGemvConfig`` field changed for PART (qkv, out, gate_up,
  down) on top of the launch the other settings give it.

One JSON line per timing and a summary per variant (best and median ms/step, speed-up over the
bf16 variant, change against the first variant)::

    PYTHONPATH=$(ls -d kernels/src packages/*/src | tr '\\n' ':') python3 \\
        tools/bench/quant_decode_variants.py bf16=bf16 int4= l2=pdl=l2_partial,early
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

from infer_bench import build_model, copy_bandwidth, timed_generate

from slipstream.inference import init_inference
from slipstream.kernels.ops.quant_matmul import fused_gemv, fused_table

# The projections as fused_quant_decode launches them: part -> (fusion, out, in), the shapes
# of the model served (set by main; the 8B Llama's here)
SCALE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
PARTS = {
    "qkv": ("qkv", 6144, 4096),
    "out": ("add_norm", 4096, 4096),
    "gate_up": ("gate_up", 28672, 4096),
    "down": ("add_norm", 4096, 14336),
}


@dataclasses.dataclass
class Variant:
    """One launch variant of the decode step."""

    name: str
    bf16: bool = False
    pdl: str | None = None
    early: bool | None = None
    attention_pdl: bool | None = None
    table: str | None = None
    parts: tuple[str, ...] = tuple(PARTS)
    rule: bool = False
    scales: str | None = None
    changes: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)


def parse_variant(text: str) -> Variant:
    """``NAME=SETTINGS`` (see the module docstring)."""
    name, _, settings = text.partition("=")
    variant = Variant(name or text)
    fields = {field.name for field in dataclasses.fields(fused_table.FusedGemvConfig)}
    for setting in filter(None, settings.split(",")):
        key, _, value = setting.partition("=")
        if setting == "bf16":
            variant.bf16 = True
        elif key == "pdl" and value in fused_gemv.PDL_MODES:
            variant.pdl = value
        elif setting in ("early", "noearly"):
            variant.early = setting == "early"
        elif setting in ("attnpdl", "noattnpdl"):
            variant.attention_pdl = setting == "attnpdl"
        elif key == "table" and value:
            variant.table = value
        elif key == "parts" and value and set(value.split("+")) <= set(PARTS):
            variant.parts = tuple(value.split("+"))
        elif setting == "rule":
            variant.rule = True
        elif key == "scales" and value in SCALE_DTYPES:
            variant.scales = value
        else:
            part, _, assignment = setting.partition(":")
            field, _, raw = assignment.partition("=")
            if part not in PARTS or field not in fields or not raw:
                raise SystemExit(
                    f"variant {text!r}: {setting!r} is not bf16, pdl=MODE, early, noearly, "
                    f"table=PATH, parts=P+Q, rule, scales=DTYPE or PART:FIELD=VALUE (PART in {sorted(PARTS)}, "
                    f"FIELD in {sorted(fields)})"
                )
            low = raw.lower()
            parsed: Any = low == "true" if low in ("true", "false") else int(raw)
            variant.changes.setdefault(part, {})[field] = parsed
    return variant


def install(variant: Variant, fmt: str, device: torch.device) -> list[dict[str, Any]]:
    """Make ``variant``'s launches the ones the next capture uses; returns the user table's
    entries (as JSON) it installed."""
    fused_table.use_fused_table(None)
    entries: list[fused_table.FusedEntry] = []
    if variant.table:
        entries = [
            e
            for e in fused_table.load_fused_table(variant.table)
            if any((e.fusion, e.n, e.k) == PARTS[p] for p in variant.parts)
        ]
    name, sms = fused_table._device_key(device)
    if variant.rule or variant.changes:
        fused_table.use_fused_table(entries)  # the table's launches under the changes
        for part, (fusion, n, k) in PARTS.items():
            if not variant.rule and part not in variant.changes:
                continue
            if variant.rule:
                config = fused_gemv._default_config(fmt, n, k, 128, device, fusion)
            else:
                config = fused_gemv.fused_config(fmt, fusion, n, k, 128, device)
            if config is None:  # the packed loop cannot step through this shape
                continue
            config = dataclasses.replace(config, **variant.changes.get(part, {}))
            entries = [e for e in entries if (e.fusion, e.n, e.k) != (fusion, n, k)]
            entries.append(fused_table.FusedEntry(name, sms, fmt, fusion, n, k, config))
    fused_table.use_fused_table(entries)
    return list(fused_table.fused_table_json(entries)["entries"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("variants", nargs="+", help="NAME=SETTINGS (see the module docstring)")
    parser.add_argument("--weights", choices=["int4", "int8"], default="int4")
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument(
        "--scale-dtype",
        choices=sorted(SCALE_DTYPES),
        default=None,
        help="quant.weight.scale_dtype of the quantized engine (default: the config's)",
    )
    parser.add_argument("--layers", type=int, default=0, help="override the preset's layers")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2, help="timed generates per round")
    args = parser.parse_args()
    variants = [parse_variant(text) for text in args.variants]
    cuda = torch.cuda.is_available()  # the CPU runs the references: a smoke test only
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    bandwidth = copy_bandwidth(device)
    print(json.dumps({"result": "copy_bandwidth", "gb_per_s": round(bandwidth / 1e9, 1)}))
    started = time.perf_counter()
    model = build_model(args.preset, torch.bfloat16, device, args.layers)
    max_len = args.prompt + args.new_tokens
    common = {
        "replace_with_kernel_inject": True,
        "enable_cuda_graph": cuda,
        "max_out_tokens": max_len,
    }
    engines: dict[bool, Any] = {}
    if any(v.bf16 for v in variants):
        engines[True] = init_inference(model, {"dtype": "bf16", **common})
    if not all(v.bf16 for v in variants):
        bits = 4 if args.weights == "int4" else 8
        quant: dict[str, Any] = {
            "weight": {"num_bits": bits, "group_size": 128, "compute_dtype": "bf16"}
        }
        if args.scale_dtype is not None:
            quant["weight"]["scale_dtype"] = args.scale_dtype
        engines[False] = init_inference(model, {"dtype": "int8", "quant": quant, **common})
    default_pdl = engines[False].fused.quant_pdl if False in engines else None
    default_attention = (False, False)
    if False in engines:
        fused = engines[False].fused
        default_attention = (fused.quant_attention_pdl, fused.quant_attention_trigger)
    if False in engines:  # the served model's shapes
        block = engines[False].fused.blocks[0]
        for part, attr in (("qkv", "qkv"), ("out", "out"), ("gate_up", "up"), ("down", "down")):
            linear = getattr(block, attr)
            PARTS[part] = (PARTS[part][0], linear.out_features, linear.in_features)
    for variant in list(variants):
        if variant.table:
            try:
                fused_table.load_fused_table(variant.table)
            except fused_table.FusedTableError as error:
                print(json.dumps({"result": "skipped", "variant": variant.name, "why": str(error)}))
                variants.remove(variant)
    # the quantized linears' scales as quantized (a scales= variant swaps in a cast copy)
    held_scales = {
        module: module.scales
        for module in (engines[False].fused.modules() if False in engines else ())
        if hasattr(module, "codes") and isinstance(getattr(module, "scales", None), torch.Tensor)
    }

    def use_scales(dtype_name: str | None) -> None:
        for module, scales in held_scales.items():
            module.scales = scales if dtype_name is None else scales.to(SCALE_DTYPES[dtype_name])

    def scale_change(variant: Variant) -> int:
        """Bytes the variant's scales= adds to the quantized weights (0: none)."""
        if variant.bf16 or variant.scales is None:
            return 0
        size = torch.empty((), dtype=SCALE_DTYPES[variant.scales]).element_size()
        return sum(s.numel() * (size - s.element_size()) for s in held_scales.values())

    weight_bytes: dict[bool, int] = {}
    for is_bf16, engine in engines.items():
        weight_bytes[is_bf16] = sum(
            t.numel() * t.element_size()
            for key, t in list(engine.fused.named_parameters()) + list(engine.fused.named_buffers())
            if not key.startswith("embed.")
        )
    spec = next(iter(engines.values())).fused.spec
    kv_heads = next(iter(engines.values())).fused.blocks[0].kv_heads
    kv_bytes = 2 * spec.num_layers * kv_heads * spec.head_dim * 2 * max_len
    ids = torch.randint(3, spec.vocab_size, (1, args.prompt), device=device)
    mask = torch.ones_like(ids)
    steps: dict[str, list[float]] = {v.name: [] for v in variants}
    differences: dict[str, list[float]] = {v.name: [] for v in variants}
    reference: dict[bool, torch.Tensor] = {}

    def generate(engine: Any, new: int) -> torch.Tensor:
        return engine.generate(  # type: ignore[no-any-return]
            ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=None
        )

    for round_index in range(args.rounds):
        order = variants[round_index % len(variants) :] + variants[: round_index % len(variants)]
        for variant in order:
            engine = engines[variant.bf16]
            table = [] if variant.bf16 else install(variant, args.weights, device)
            if not variant.bf16:
                use_scales(variant.scales)
                engine.fused.quant_pdl = variant.pdl or default_pdl
                engine.fused.quant_attention_pdl = (
                    default_attention[0] if variant.attention_pdl is None else variant.attention_pdl
                )
                engine.fused.quant_attention_trigger = (
                    default_attention[1] if variant.early is None else variant.early
                )
            engine._runner.buckets.clear()  # recaptured with this variant's launches
            gc.collect()
            tokens = generate(engine, args.new_tokens)  # capture, compiles: the warm-up
            same = bool(torch.equal(tokens, reference.setdefault(variant.bf16, tokens)))
            fulls = [
                timed_generate(engine, lambda e=engine: generate(e, args.new_tokens), device)
                for _ in range(args.repeats)
            ]
            firsts = [
                timed_generate(engine, lambda e=engine: generate(e, 1), device)[0]
                for _ in range(args.repeats)
            ]
            difference = (min(w for w, _ in fulls) - min(firsts)) / (args.new_tokens - 1)
            steps[variant.name] += [per_step for _, per_step in fulls]
            differences[variant.name].append(difference)
            row = {
                "result": "step",
                "variant": variant.name,
                "round": round_index,
                "ms": [round(per_step * 1e3, 4) for _, per_step in fulls],
                "ms_by_difference": round(difference * 1e3, 4),
                "same_tokens_as_first": same,
            }
            if round_index == 0 and table:
                row["user_table"] = table
            print(json.dumps(row), flush=True)
    install(Variant("restore"), args.weights, device)
    use_scales(None)
    baseline = next((min(steps[v.name]) for v in variants if v.bf16), None)
    base = min(steps[variants[0].name])
    for variant in variants:
        best = min(steps[variant.name])
        summary = {
            "result": "variant",
            "variant": variant.name,
            "weights": "bf16" if variant.bf16 else args.weights,
            "best_ms": round(best * 1e3, 4),
            "median_ms": round(statistics.median(steps[variant.name]) * 1e3, 4),
            "best_ms_by_difference": round(min(differences[variant.name]) * 1e3, 4),
            "speedup_vs_bf16": round(baseline / best, 3) if baseline else None,
            "vs_first": round(base / best, 4),
            "bandwidth_fraction": round(
                (weight_bytes[variant.bf16] + scale_change(variant) + kv_bytes) / best / bandwidth,
                4,
            ),
            "settings": {
                key: value
                for key, value in dataclasses.asdict(variant).items()
                if key != "name" and value != getattr(Variant(""), key)
            },
            "device": name,
        }
        print(json.dumps(summary), flush=True)
    print(json.dumps({"result": "done", "seconds": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
    main()
