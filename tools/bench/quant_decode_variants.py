"""Batch-1 quantized (int4 / int8) decode step of the 8B Llama under launch variants, beside bf16.

One model, one quantized engine and (for ``bf16`` variants) one bf16 engine, built once; each
variant changes what the next CUDA-graph capture launches and recaptures (no requantizing), and
the variants run in ``--rounds`` interleaved rounds, so they are compared on the same GPU
seconds apart. The step is timed as ``infer_bench.py`` times it: the decode steps of a
``generate`` of ``--new-tokens`` on the device's clock (prefill excluded), the best and median
of ``--repeats`` calls a round after a warm-up; the older difference measure (``generate`` of
``new`` minus ``generate`` of 1) is printed beside it. A variant is ``NAME=SETTINGS``, with
``SETTINGS`` comma-separated from:

- ``bf16``: the bf16 engine (library defaults; the first such variant is the baseline of the
  speed-ups); with ``attn:pdl`` / ``attn:prefetch`` the dense step's
  ``decode_attention_pdl`` / ``decode_attention_prefetch``;
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
  down) on top of the launch the other settings give it;
- ``attn:FIELD=VALUE``: decode_attention's launch in the quantized step (the bf16 engine's too
  for the module-level ones): ``pdl``, ``trigger``, ``prefetch``, ``preload`` (true/false:
  the fused decoder's ``quant_attention_pdl`` / ``_trigger`` / ``_prefetch`` / ``_preload``;
  ``trigger`` also ``issued`` / ``waited``: where the loop form lets the next kernel launch),
  ``weights`` (``early`` / ``waited``: attention prefetches the output projection's weight
  into L2 before / after its wait; the fused decoder's ``quant_attention_weights``),
  ``block_s``, ``stages``,
  ``warps``, ``d_split`` (the loop form's ``LOOP_BLOCK_S`` / ``LOOP_STAGES`` / ``LOOP_WARPS``
  / ``LOOP_D_SPLIT``), ``loop_max_slots`` (0: the split form) and ``split_block_s`` (the split
  form's chunk).

``--attention-only`` times decode_attention alone instead (no model is built), for every
variant with ``attn:`` settings and the library's launch: a CUDA graph of one call per layer
over that layer's own cache (the preset's shapes, ``--prompt + --new-tokens`` slots, the last
16 masked), replayed, microseconds per call in interleaved rounds. Without the projections
around it, the PDL settings show only how attention calls overlap each other there.

One JSON line per timing and a summary per variant (best and median ms/step, speed-up over the
bf16 variant, change against the first variant)::

    PYTHONPATH=$(ls -d kernels/src packages/*/src | tr '\\n' ':') python3 \\
        tools/bench/quant_decode_variants.py bf16=bf16 int4= l2=pdl=l2_partial,early \\
        wait=attn:pdl=true pf=attn:pdl=true,attn:prefetch=true w8=attn:warps=8
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

from infer_bench import PRESETS, build_model, copy_bandwidth, timed_generate

from slipstream.inference import init_inference
from slipstream.kernels.ops.decode_attention import triton as attention_triton
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
    attention: dict[str, int | bool | str] = dataclasses.field(default_factory=dict)


TRIGGERS = ("start", "issued", "waited")  # attn:trigger's positions besides true / false


# attn:FIELD -> (True: a fused decoder attribute, False: a module-level value of
# decode_attention.triton), its name there
ATTENTION_FIELDS = {
    "pdl": (True, "quant_attention_pdl"),
    "trigger": (True, "quant_attention_trigger"),
    "prefetch": (True, "quant_attention_prefetch"),
    "preload": (True, "quant_attention_preload"),
    "weights": (True, "quant_attention_weights"),
    "block_s": (False, "LOOP_BLOCK_S"),
    "stages": (False, "LOOP_STAGES"),
    "warps": (False, "LOOP_WARPS"),
    "d_split": (False, "LOOP_D_SPLIT"),
    "loop_max_slots": (False, "LOOP_MAX_SLOTS"),
    "split_block_s": (False, "default_block_s"),
}
_ATTENTION_MODULE = {
    attr: getattr(attention_triton, attr)
    for module_level, attr in ATTENTION_FIELDS.values()
    if not module_level
}


def install_attention(variant: Variant) -> None:
    """Set decode_attention's module-level launch values for ``variant`` (the library's
    where it changes none)."""
    for attr, value in _ATTENTION_MODULE.items():
        setattr(attention_triton, attr, value)
    for field, value in variant.attention.items():
        module_level, attr = ATTENTION_FIELDS[field]
        if module_level:
            continue
        if field == "split_block_s":
            setattr(attention_triton, attr, lambda *_, chunk=value: chunk)
        else:
            setattr(attention_triton, attr, value)


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
        elif key.startswith("attn:"):
            field = key.removeprefix("attn:")
            low = value.lower()
            if field not in ATTENTION_FIELDS or not value:
                raise SystemExit(
                    f"variant {text!r}: {setting!r}: attn:FIELD=VALUE takes FIELD in "
                    f"{sorted(ATTENTION_FIELDS)}"
                )
            parsed_attention: int | bool | str = (
                low == "true"
                if low in ("true", "false")
                else int(value)
                if value.isdigit()
                else value
            )
            if field == "weights" and parsed_attention not in ("early", "waited"):
                raise SystemExit(f"variant {text!r}: attn:weights takes early or waited")
            if field == "trigger" and parsed_attention not in (True, False, *TRIGGERS):
                raise SystemExit(f"variant {text!r}: attn:trigger takes true, false or {TRIGGERS}")
            variant.attention[field] = parsed_attention
        else:
            part, _, assignment = setting.partition(":")
            field, _, raw = assignment.partition("=")
            if part not in PARTS or field not in fields or not raw:
                raise SystemExit(
                    f"variant {text!r}: {setting!r} is not bf16, pdl=MODE, early, noearly, "
                    f"attnpdl, noattnpdl, table=PATH, parts=P+Q, rule, scales=DTYPE, "
                    f"attn:FIELD=VALUE or PART:FIELD=VALUE (PART in {sorted(PARTS)}, "
                    f"FIELD in {sorted(fields)})"
                )
            low = raw.lower()
            parsed: Any = low == "true" if low in ("true", "false") else int(raw)
            variant.changes.setdefault(part, {})[field] = parsed
    quant_only = {"trigger", "preload", "weights"} & set(variant.attention)
    if variant.bf16 and quant_only:
        raise SystemExit(
            f"variant {text!r}: the bf16 step takes attn:pdl, attn:prefetch and the launch "
            f"shape, not {sorted(quant_only)}"
        )
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


def attention_flags(variant: Variant, defaults: dict[str, Any]) -> dict[str, Any]:
    """The fused decoder's attention launch flags for ``variant`` (``early`` / ``attnpdl``
    and ``attn:trigger`` / ``attn:pdl`` set the same ones)."""
    flags = dict(defaults)
    if variant.attention_pdl is not None:
        flags["pdl"] = variant.attention_pdl
    if variant.early is not None:
        flags["trigger"] = variant.early
    for field, value in variant.attention.items():
        if ATTENTION_FIELDS[field][0]:
            flags[field] = value if isinstance(value, str) else bool(value)
    if flags.get("weights") is False:  # not set: the decoder's None
        flags["weights"] = None
    return flags


def attention_only(
    variants: list[Variant],
    defaults: dict[str, Any],
    layers: int,
    kv_heads: int,
    rows: int,
    head_dim: int,
    slots: int,
    device: torch.device,
    rounds: int,
) -> None:
    """decode_attention alone: for each variant with ``attn:`` settings (and the library's
    launch), a CUDA graph of ``layers`` calls, each over its own cache, timed over replays in
    ``rounds`` interleaved rounds; one JSON line per variant (best and median us a call)."""
    from slipstream.kernels.ops import decode_attention

    chosen = [Variant("library")] + [v for v in variants if v.attention]
    generator = torch.Generator(device=device).manual_seed(0)
    caches = torch.randn(
        layers, 2, 1, kv_heads, slots, head_dim, device=device, generator=generator
    ).to(torch.bfloat16)
    queries = torch.randn(
        layers, 1, kv_heads, rows, head_dim, device=device, generator=generator
    ).to(torch.bfloat16)
    visible = torch.arange(slots, device=device) < slots - 16  # the last 16 slots not yet valid
    new_slots = torch.tensor([slots - 17], device=device)  # the step's slot, the last valid
    # attn:weights: each layer's own int4 output projection's codes (hidden x hidden / 2 bytes)
    hidden = kv_heads * rows * head_dim
    next_weights = torch.zeros(layers, hidden * hidden // 2, device=device, dtype=torch.uint8)
    mask = torch.zeros(1, 1, rows, slots, device=device, dtype=torch.bfloat16)
    mask.masked_fill_(~visible, float("-inf"))
    scale = head_dim**-0.5
    expected = decode_attention(queries[-1], caches[-1, 0], caches[-1, 1], mask, scale)
    timings: dict[str, list[float]] = {v.name: [] for v in chosen}
    failed: set[str] = set()
    for round_index in range(rounds):
        for variant in chosen[round_index % len(chosen) :] + chosen[: round_index % len(chosen)]:
            if variant.name in failed:
                continue
            install_attention(variant)
            flags = attention_flags(variant, defaults)
            preload = flags.pop("preload", False)
            flags["new_slots"] = new_slots if preload else None
            when = flags.pop("weights", None)
            if when:
                flags["weights_when"] = when

            def calls(flags: dict[str, Any] = flags) -> torch.Tensor:
                out = queries[0]
                for layer in range(layers):  # the output of the last
                    weights = (next_weights[layer],) if "weights_when" in flags else ()
                    out = decode_attention(
                        queries[layer],
                        caches[layer, 0],
                        caches[layer, 1],
                        mask,
                        scale,
                        weights=weights,
                        **flags,
                    )
                return out

            try:
                calls()  # compiles
            except Exception as error:  # e.g. a launch that does not fit: the others still run
                failed.add(variant.name)
                why = f"{type(error).__name__}: {error}"[:400]
                print(json.dumps({"result": "error", "variant": variant.name, "why": why}))
                continue
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = calls()
            graph.replay()
            torch.cuda.synchronize(device)
            exact = bool(torch.equal(out, expected))  # the last layer's, as the library's
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            replays = 50
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            torch.cuda.synchronize(device)
            per_call = start.elapsed_time(end) * 1e3 / replays / layers
            timings[variant.name].append(per_call)
            print(
                json.dumps(
                    {
                        "result": "attention_only",
                        "variant": variant.name,
                        "round": round_index,
                        "us_per_call": round(per_call, 3),
                        "same_as_library": exact,
                    }
                ),
                flush=True,
            )
            del graph
    install_attention(Variant("restore"))
    for variant in chosen:
        if not timings[variant.name]:
            continue
        print(
            json.dumps(
                {
                    "result": "attention_only_summary",
                    "variant": variant.name,
                    "best_us": round(min(timings[variant.name]), 3),
                    "median_us": round(statistics.median(timings[variant.name]), 3),
                    "attention": variant.attention,
                }
            ),
            flush=True,
        )


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
    parser.add_argument(
        "--attention-only",
        action="store_true",
        help="only time decode_attention alone (a graph of one call per layer) per variant",
    )
    args = parser.parse_args()
    variants = [parse_variant(text) for text in args.variants]
    cuda = torch.cuda.is_available()  # the CPU runs the references: a smoke test only
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    bandwidth = copy_bandwidth(device)
    print(json.dumps({"result": "copy_bandwidth", "gb_per_s": round(bandwidth / 1e9, 1)}))
    started = time.perf_counter()
    if args.attention_only:  # the preset's shapes, no model
        shape = PRESETS[args.preset]
        heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
        if not cuda:
            raise SystemExit("--attention-only times CUDA graphs: it needs a GPU")
        attention_only(
            variants,
            {"pdl": False, "trigger": False, "prefetch": False, "preload": False},
            args.layers or shape["num_hidden_layers"],
            kv_heads,
            heads // kv_heads,
            shape["hidden_size"] // heads,
            args.prompt + args.new_tokens,
            device,
            args.rounds,
        )
        print(json.dumps({"result": "done", "seconds": round(time.perf_counter() - started, 1)}))
        return
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
    default_attention: dict[str, Any] = {}
    if False in engines:
        fused = engines[False].fused
        default_attention = {
            field: getattr(fused, attr)
            for field, (module_level, attr) in ATTENTION_FIELDS.items()
            if module_level
        }
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

    failed: set[str] = set()
    for round_index in range(args.rounds):
        order = variants[round_index % len(variants) :] + variants[: round_index % len(variants)]
        for variant in order:
            if variant.name in failed:
                continue
            engine = engines[variant.bf16]
            table = [] if variant.bf16 else install(variant, args.weights, device)
            install_attention(variant)
            if variant.bf16:  # the dense step's attention options
                engine.fused.decode_attention_pdl = bool(variant.attention.get("pdl", False))
                prefetch = bool(variant.attention.get("prefetch", False))
                engine.fused.decode_attention_prefetch = prefetch
            else:
                use_scales(variant.scales)
                engine.fused.quant_pdl = variant.pdl or default_pdl
                for field, value in attention_flags(variant, default_attention).items():
                    setattr(engine.fused, ATTENTION_FIELDS[field][1], value)
            engine._runner.buckets.clear()  # recaptured with this variant's launches
            gc.collect()
            try:
                tokens = generate(engine, args.new_tokens)  # capture, compiles: the warm-up
            except Exception as error:  # e.g. a launch that does not fit: the others still run
                failed.add(variant.name)
                why = f"{type(error).__name__}: {error}"[:400]
                print(json.dumps({"result": "error", "variant": variant.name, "why": why}))
                engine._runner.buckets.clear()
                continue
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
    install_attention(Variant("restore"))
    use_scales(None)
    variants = [v for v in variants if steps[v.name]]
    if not variants:
        raise SystemExit("no variant ran")
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
