"""Decode and prefill speed of ``slipstream.init_inference`` beside Hugging Face ``generate``.

A Llama-3-8B-shaped model (hidden 4096, 32 layers, 32 heads, 8 KV heads, FFN 14336, vocabulary
128256) with random weights, prompts of ``--prompt`` tokens, ``--new-tokens`` generated greedily
(no EOS, so every run produces the same count), for each ``--batch``. In one process:

- the copy bandwidth of the device (``dst.copy_(src)`` of 1 GiB, read + write bytes / time);
- Slipstream (kernel injection, CUDA-graph decode): decode tokens/s from the decode steps of
  ``generate`` runs of ``new`` tokens, timed on the device's clock from the first decode step
  to the end (the best of ``--repeats`` after a warm-up; the older measure, ``generate`` of
  ``new`` minus ``generate`` of 1 token over ``new - 1`` steps, is reported beside it as
  ``decode_step_ms_by_difference``: it also carries the prefill's call-to-call variation,
  tens of ms for quantized weights), the bandwidth-limit
  fraction (decode steps/s × bytes read per step ÷ copy bandwidth; the bytes are every weight but
  the embedding table, plus the KV cache attended), and prefill TFLOP/s (forward over the prompt);
- Hugging Face ``generate`` eager (dynamic cache) and with a static cache, whose decode steps
  ``generate`` compiles itself (``torch.compile``): end-to-end tokens/s of each.

One JSON line per result. Run on one GPU (the lead's command):

    PYTHONPATH=$(ls -d kernels/src packages/*/src | tr '\\n' ':') python tools/bench/infer_bench.py

CPU smoke run of the harness (tiny model): ``--preset tiny --device cpu --skip-hf-compiled``.
Tensor parallelism (Slipstream only; per-GPU bandwidth fraction of each rank's slice):
``torchrun --nproc_per_node 2 tools/bench/infer_bench.py --batch 1``, or TP=1 and TP=2 side
by side on one 2-GPU machine in one invocation: ``--tp-compare 2 --batch 1``.
Per-kernel breakdown of a decode step: ``--profile 16`` (the GEMVs also per part and shape).
Quantized beside bf16 in one process (one model, each mode served in turn):
``--weights native int4 int8 int4-head int8-head --batch 1`` (``-head``: LM head quantized too;
``int4-head8``: int4 blocks with an 8-bit LM head, ``quant.weight.lm_head_bits`` 8).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from slipstream.inference import init_inference

PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
    },
    "tiny": {
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 256,
        "vocab_size": 512,
        "max_position_embeddings": 1024,
    },
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args() -> argparse.Namespace:
    """Command-line options (defaults: the issue's Llama-3-8B run on one GPU)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--device", choices=["auto", "cpu"], default="auto")
    parser.add_argument(
        "--weights",
        choices=[
            "native",
            "int8",
            "int4",
            "fp8",
            "int8-head",
            "int4-head",
            "fp8-head",
            "int4-head8",
        ],
        nargs="+",
        default=["native"],
        help="weights to serve; several: each in turn from the same model, in one process "
        "(-head: the LM head quantized too, as --lm-head; int4-head8: int4 blocks with an "
        "8-bit head, quant.weight.lm_head_bits 8)",
    )
    parser.add_argument(
        "--group-size", type=int, default=128, help="int8/int4/fp8 weight groups (-1: per row)"
    )
    parser.add_argument("--no-cuda-graph", action="store_true")
    parser.add_argument(
        "--gemv-layout",
        choices=["auto", "on", "off"],
        default="auto",
        help="quant.weight.gemv_layout: quantized weights in the packed decode-GEMV layout "
        "(auto, the config's default: int4 and fp8 packed, int8 not)",
    )
    parser.add_argument(
        "--use-triton",
        action="store_true",
        help="use_triton=True: the blocks' dense linears run the Triton streaming GEMV at decode",
    )
    parser.add_argument(
        "--decode-fusion",
        default="auto",
        help="decode_fusion: batch-1 decode through the fused Triton decode GEMVs (auto, the "
        "config's default on GPUs; on: every part) or the unfused kernels, cuBLAS and SDPA "
        "(off); or a comma list of the parts to fuse (qkv,attention,out,gate_up,down,head)",
    )
    parser.add_argument("--skip-hf-eager", action="store_true")
    parser.add_argument("--skip-hf-compiled", action="store_true")
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs after a warm-up; the best is kept"
    )
    parser.add_argument(
        "--gemv-table",
        default=None,
        metavar="JSON",
        help="decode-GEMV launches per (format, out, in) from quant_gemv_bench.py --table-out, "
        "installed into slipstream.kernels' gemv.GEMV_TABLE before the model is built",
    )
    parser.add_argument(
        "--decode-gemv-table",
        default=None,
        metavar="JSON",
        help="decode_gemv_table: launches of the bf16/fp16 decode GEMVs (decode_fusion) per GPU "
        "and shape, from bf16_gemv_bench.py --table-out, ahead of the built-in table",
    )
    parser.add_argument(
        "--decode-pdl",
        choices=["auto", "on", "off"],
        default="auto",
        help="decode_pdl: the dense fused decode step's kernels launched with programmatic "
        "dependent launch (sm_90+); auto: the library's default",
    )
    parser.add_argument(
        "--attention-block-s",
        type=int,
        default=0,
        metavar="SLOTS",
        help="bench-only: decode_attention's cache slots per chunk (default: its own rule, "
        "32 for short caches), to measure another chunk size in the whole step",
    )
    parser.add_argument(
        "--quant-pdl",
        nargs="?",
        const="on",
        default=None,
        choices=["on", "off", "basic"],
        help="quant.weight.decode_pdl, the fused quantized decode GEMVs' (decode_fusion on "
        'int8/int4) programmatic dependent launch (sm_90+): on ("l2_partial": the weights\' '
        "L2 prefetch, whole or in part), off (false), basic (true: only weights that fit the "
        'L2 budget whole are prefetched); default: the config\'s ("auto")',
    )
    parser.add_argument(
        "--quant-decode-table",
        default=None,
        metavar="JSON",
        help="quant.weight.decode_gemv_table: launches of the fused quantized decode GEMVs per "
        "GPU and shape, from quant_decode_bench.py --table-out, ahead of the built-in table",
    )
    parser.add_argument(
        "--scale-dtype",
        default=None,
        choices=["fp16", "bf16", "fp32"],
        help="quant.weight.scale_dtype: the dtype of the quantized weights' group scales "
        "(default: the config's, fp16)",
    )
    parser.add_argument(
        "--lm-head",
        action="store_true",
        help="quant.weight.lm_head: quantize the LM head too (default: kept in the compute dtype)",
    )
    parser.add_argument(
        "--tp-compare",
        type=int,
        default=0,
        metavar="N",
        help="side by side in one invocation: this bench at TP=1 (one GPU), then at TP=N "
        "(torch.distributed.run, N GPUs of this machine), each in its own process, then one "
        "tp_speedup line per batch (HF baselines skipped)",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="after the timings, profile STEPS decode steps of the first batch with "
        "torch.profiler and print one JSON line per GPU kernel (calls and microseconds per "
        "step, share of the step): the per-kernel breakdown of a decode step",
    )
    parser.add_argument(
        "--offload",
        nargs="?",
        const="cpu",
        choices=["cpu", "nvme"],
        default=None,
        help="ZeRO-Inference: blocks stream from pinned host memory (cpu, the default) or from "
        "swap files under --nvme-path (nvme); no CUDA graph, no HF baselines; slow (PCIe- or "
        "drive-bound), so pair it with --new-tokens 8 --repeats 1",
    )
    parser.add_argument("--nvme-path", default=None, help="swap folder for --offload nvme")
    parser.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=0.0,
        help="cap this process's GPU memory (torch.cuda.set_per_process_memory_fraction) after "
        "the model is built: with --offload, a cap below the weights' size makes the model one "
        "that does not fit the GPU it runs on (stated in the output)",
    )
    parser.add_argument(
        "--layers", type=int, default=0, help="override the preset's layer count (0: keep it)"
    )
    parser.add_argument(
        "--tp-allreduce",
        nargs="+",
        choices=[
            "nccl",
            "symm_mem",
            "symm_mem_or_nccl",
            "symm_mem:torch",
            "symm_mem_or_nccl:torch",
        ],
        default=["symm_mem_or_nccl"],
        help="tensor_parallel.allreduce (':torch': with tensor_parallel.symm_mem_kernel "
        "'torch' instead of 'slipstream'); with --tp-compare, one TP=N run per value",
    )
    parser.add_argument(
        "--tp-decode",
        nargs="+",
        choices=["auto", "unfused", "fused"],
        default=["auto"],
        help="the TP=N decode step: the config's defaults (auto), decode_fusion off (unfused), "
        "decode_fusion on (fused: one sum kernel per sum); with --tp-compare, one "
        "TP=N run per value (and per --tp-allreduce value)",
    )
    return parser.parse_args()


EMIT = True  # False on every tensor-parallel rank but 0


def emit(**row: Any) -> None:
    """One result as a JSON line."""
    if EMIT:
        print(json.dumps(row), flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` calls, after one warm-up call."""
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return min(times)


def _mark(device: torch.device) -> Any:
    """A point on the device's clock: a recorded CUDA event, or the host clock elsewhere."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def timed_generate(
    engine: Any, run: Callable[[], Any], device: torch.device
) -> tuple[float, float]:
    """One call of ``run`` (an ``engine.generate``): its wall seconds, and the seconds per
    decode step on the device's clock, from the start of the first decode step to the end of
    ``generate`` (a CUDA event is recorded as the first decode step is called; each step is
    the CUDA-graph replay and the sampling of the next token), so that the prefill, which
    varies from call to call far more than a decode step (the quantized prefill dequantizes
    every weight), is not in it. 0 without decode steps."""
    runner = engine._runner
    inner = runner.decode
    start: list[Any] = []
    steps = 0

    def decode(*step_args: Any, **step_kwargs: Any) -> Any:
        nonlocal steps
        if not start:
            start.append(_mark(device))
        steps += 1
        return inner(*step_args, **step_kwargs)

    runner.decode = decode  # generate reads the runner's decode at each call
    try:
        sync(device)
        began = time.perf_counter()
        run()
        end = _mark(device)
        sync(device)
        wall = time.perf_counter() - began
    finally:
        del runner.decode  # the class's method again
    if not steps:
        return wall, 0.0
    if device.type == "cuda":
        return wall, start[0].elapsed_time(end) / 1e3 / steps
    return wall, (end - start[0]) / steps


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a device-to-device copy of 1 GiB (64 MiB on CPU), read plus write."""
    size = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = best_time(lambda: dst.copy_(src), device, 5)
    return 2 * size / seconds


def host_to_device_bandwidth(device: torch.device) -> float:
    """Bytes/s of a pinned host -> device copy of 1 GiB (what ZeRO-Inference streams over)."""
    src = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    dst = torch.empty(src.shape, dtype=torch.uint8, device=device)
    return src.numel() / best_time(lambda: dst.copy_(src, non_blocking=True), device, 3)


def nvme_read_bandwidth(path: str) -> float:
    """Bytes/s of reading 1 GiB back from a swap file under ``path`` (slipstream.offload I/O)."""
    from slipstream.offload import AioSettings, AsyncIOEngine, SwapSpace

    space = SwapSpace(path, AsyncIOEngine(AioSettings()), name="bench")
    try:
        data = torch.ones(1 << 28, dtype=torch.float32)  # 1 GiB
        space.allocate("probe", data.numel(), data.dtype)
        space.write("probe", data).wait()
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            space.read("probe", data).wait()
            best = min(best, time.perf_counter() - start)
    finally:
        space.close()
    return data.numel() * 4 / best


def build_model(
    preset: str, dtype: torch.dtype, device: torch.device, layers: int = 0
) -> torch.nn.Module:
    """A random-weight ``LlamaForCausalLM`` built directly on ``device`` in ``dtype``."""
    import transformers

    shape = dict(PRESETS[preset])
    if layers:
        shape["num_hidden_layers"] = layers
    config = transformers.LlamaConfig(**shape, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    # Built in place on the device in `dtype` (HF's init draws the random weights there): no
    # fp32 copy on the host. The default dtype is the one knob every transformers release reads.
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def bench_batch(
    args: argparse.Namespace,
    engine: Any,
    model: torch.nn.Module,
    ids: torch.Tensor,
    weight_bytes: int,
    params: int,
    bandwidth: float,
    common: dict[str, Any],
) -> None:
    """Slipstream and the Hugging Face baselines on one batch of prompts ``ids``."""
    device, dtype, spec = ids.device, DTYPES[args.dtype], engine.fused.spec
    batch, max_len = ids.shape[0], args.prompt + args.new_tokens
    mask = torch.ones_like(ids)
    run = {"batch": batch, "prompt": args.prompt, "new_tokens": args.new_tokens, **common}

    def ours(new: int) -> torch.Tensor:
        return engine.generate(  # type: ignore[no-any-return]
            ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=None
        )

    # Each generate is timed whole (wall clock) and its decode steps alone (device clock, see
    # timed_generate); the first call of each length is the warm-up (its times are listed in
    # the decode_timing row, not used).
    full_calls = [
        timed_generate(engine, lambda: ours(args.new_tokens), device)
        for _ in range(1 + args.repeats)
    ]
    first_calls = [timed_generate(engine, lambda: ours(1), device) for _ in range(1 + args.repeats)]
    full = min(wall for wall, _ in full_calls[1:])
    first = min(wall for wall, _ in first_calls[1:])
    # The step by difference (generate of `new` minus generate of 1, over `new - 1` steps, the
    # bests of each), as this bench measured it before: it carries the prefill's variation.
    step_difference = (full - first) / max(args.new_tokens - 1, 1)
    event_steps = [per_step for _, per_step in full_calls[1:]]
    step = min(event_steps) if args.new_tokens > 1 else step_difference
    emit(
        result="decode_timing",
        weights=args.weights,
        batch=batch,
        step_ms_per_call=[round(s * 1e3, 4) for _, s in full_calls],
        full_ms_per_call=[round(w * 1e3, 2) for w, _ in full_calls],
        first_ms_per_call=[round(w * 1e3, 2) for w, _ in first_calls],
        step_ms_median=round(sorted(event_steps)[len(event_steps) // 2] * 1e3, 4),
        step_ms_by_difference=round(step_difference * 1e3, 4),
        note="per_call lists start with the warm-up call",
    )
    kv_bytes = (
        2 * spec.num_layers * batch * engine.fused.blocks[0].kv_heads * max_len * spec.head_dim
    ) * dtype.itemsize
    fraction = (weight_bytes + kv_bytes) / step / bandwidth
    graph = engine._runner.captured(batch)
    if args.offload:
        prefill = first  # a forward streams every block: one generate(1) is the prefill
    else:
        prefill = best_time(lambda: engine(ids, attention_mask=mask), device, args.repeats)
    tokens = batch * args.prompt
    attention = 2 * spec.num_layers * batch * args.prompt**2 * spec.num_heads * spec.head_dim
    # Causal attention: half of QK^T and PV, counted once. Under TP: the work of all ranks.
    prefill_flops = 2 * params * tokens + attention
    extra: dict[str, Any] = {}
    if args.offload:
        # Each step streams every block host -> device: the achieved stream rate, beside the
        # bandwidth measured alone (fraction near 1: copies back to back, compute hidden).
        extra = {
            "streamed_gb_per_s": round(weight_bytes / step / 1e9, 2),
            "stream_fraction_of_measured": round(weight_bytes / step / bandwidth, 3),
        }
        if device.type == "cuda":
            extra["gpu_peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    emit(
        result="slipstream",
        decode_tokens_per_s=round(batch / step, 1),
        decode_step_ms=round(step * 1e3, 3),
        decode_step_ms_by_difference=round(step_difference * 1e3, 3),
        bandwidth_fraction=round(fraction, 3),
        end_to_end_tokens_per_s=round(batch * args.new_tokens / full, 1),
        prefill_tflops=round(prefill_flops / prefill / 1e12, 2),
        prefill_ms=round(prefill * 1e3, 2),
        cuda_graph=graph,
        **extra,
        offload=args.offload or False,
        weights=args.weights,
        use_triton=args.use_triton,
        decode_fusion=",".join(sorted(engine.fused.decode_fusion)) or "off",
        gemv_layout=args.gemv_layout,
        lm_head_quantized=args.lm_head,
        lm_head_bits=args.lm_head_bits,
        scale_dtype=_scale_dtype(engine),
        quant_decode_pdl=engine.fused.quant_pdl if args.weights != "native" else None,
        quant_decode_table=args.quant_decode_table,
        gemv_table=args.gemv_table,
        decode_gemv_table=args.decode_gemv_table,
        decode_pdl=getattr(engine.fused, "decode_pdl", None),
        quant_pdl=args.quant_pdl,
        **run,
    )
    hf_kwargs = {
        "attention_mask": mask,
        "max_new_tokens": args.new_tokens,
        "min_new_tokens": args.new_tokens,
        "do_sample": False,
        "pad_token_id": 0,
    }
    if not args.skip_hf_eager:
        seconds = best_time(lambda: model.generate(ids, **hf_kwargs), device, args.repeats)
        emit(
            result="hf_eager",
            end_to_end_tokens_per_s=round(batch * args.new_tokens / seconds, 1),
            **run,
        )
    if not args.skip_hf_compiled:
        seconds = best_time(
            lambda: model.generate(ids, cache_implementation="static", **hf_kwargs),
            device,
            args.repeats,
        )
        emit(
            result="hf_static_compiled",
            end_to_end_tokens_per_s=round(batch * args.new_tokens / seconds, 1),
            compiled=device.type == "cuda",  # generate compiles static-cache decoding on GPUs
            **run,
        )


def tp_compare(args: argparse.Namespace) -> None:
    """``--tp-compare N``: TP=1, then TP=N, each a child process running this script."""
    import subprocess
    import sys

    argv = sys.argv[1:]
    for flag in ("--tp-compare", "--tp-allreduce", "--tp-decode"):  # each run gets its own
        index = next((i for i, a in enumerate(argv) if a.startswith(flag)), None)
        if index is None:
            continue
        end = index + 1
        while "=" not in argv[index] and end < len(argv) and not argv[end].startswith("--"):
            end += 1
        del argv[index:end]
    argv += ["--skip-hf-eager", "--skip-hf-compiled"]
    script = os.path.abspath(__file__)
    runs: dict[str, list[str]] = {"tp1": [sys.executable, script, *argv]}
    variants = [
        (mode, decode, mode if len(args.tp_decode) == 1 else f"{mode}/{decode}")
        for mode in args.tp_allreduce
        for decode in args.tp_decode
    ]
    for mode, decode, name in variants:
        runs[name] = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={args.tp_compare}",
            script,
            *argv,
            "--tp-allreduce",
            mode,
            "--tp-decode",
            decode,
        ]
    rates: dict[int, dict[str, float]] = {}
    failed = []
    for name, command in runs.items():
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        for line in done.stdout.splitlines():
            print(line, flush=True)
            if line.startswith("{"):
                row = json.loads(line)
                if row.get("result") == "slipstream":
                    rates.setdefault(row["batch"], {})[name] = row["decode_tokens_per_s"]
        if done.returncode != 0:
            print(done.stderr[-4000:], file=sys.stderr, flush=True)
            failed.append(name)
    for batch, by_run in sorted(rates.items()):
        for mode, decode, name in variants:
            if "tp1" in by_run and name in by_run:
                emit(
                    result="tp_speedup",
                    batch=batch,
                    tp=args.tp_compare,
                    allreduce=mode,
                    tp_decode=decode,
                    tp1_decode_tokens_per_s=by_run["tp1"],
                    tpn_decode_tokens_per_s=by_run[name],
                    speedup=round(by_run[name] / by_run["tp1"], 3),
                )
    if failed:
        raise SystemExit(f"--tp-compare: these runs failed: {failed}")


def main() -> None:
    args = parse_args()
    if args.tp_compare > 1 and "WORLD_SIZE" not in os.environ:
        tp_compare(args)
        return
    cpu = args.device == "cpu" or not torch.cuda.is_available()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # tensor parallelism over the launched ranks; rank 0 prints
        from slipstream import comm

        comm.init_distributed("gloo" if cpu else "nccl")
        global EMIT
        EMIT = int(os.environ["RANK"]) == 0
        args.skip_hf_eager = args.skip_hf_compiled = True  # HF runs one GPU only
    device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    dtype = DTYPES[args.dtype]
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    common: dict[str, Any] = {
        "preset": args.preset,
        "dtype": args.dtype,
        "device": machine,
        "tp": world,
    }
    if args.layers:
        common["layers"] = args.layers
    bandwidth = copy_bandwidth(device)
    emit(result="copy_bandwidth", gb_per_s=round(bandwidth / 1e9, 1), **common)

    started = time.perf_counter()
    model = build_model(args.preset, dtype, device, args.layers)
    if args.offload and device.type == "cuda":
        # Random weights are drawn on the GPU (drawing 8B of them on the host's CPU takes
        # minutes), then moved to host memory, where ZeRO-Inference keeps them.
        model.to("cpu")
        torch.cuda.empty_cache()
    emit(result="phase", phase="build_model", seconds=round(time.perf_counter() - started, 2))
    if args.gpu_memory_gib and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(args.gpu_memory_gib * 2**30 / total, 1.0))
        emit(result="gpu_memory_cap", gib=args.gpu_memory_gib, device_total_gib=total / 2**30)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(
            device
        )  # the peak reported is the run's, not the build's
    weight_modes, lm_head = args.weights, args.lm_head
    for index, mode in enumerate(weight_modes):
        # one model, each --weights mode served and timed in turn (same process and GPU)
        args.weights, _, head_bits = mode.partition("-head")
        args.lm_head = lm_head or mode.endswith("-head") or bool(head_bits)
        args.lm_head_bits = int(head_bits) if head_bits else None  # int4-head8: 8
        common["weights_mode"] = mode  # the --weights entry each result line belongs to
        if index:
            _free(device)
        serve(args, model, device, world, common, bandwidth)


def _free(device: torch.device) -> None:
    """Drop the previous mode's engine (its memory) before the next one is built."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def serve(
    args: argparse.Namespace,
    model: Any,
    device: torch.device,
    world: int,
    common: dict[str, Any],
    bandwidth: float,
) -> None:
    """``init_inference`` of ``model`` with ``args.weights`` (one mode), its checks, timings
    and profile."""
    # --profile runs generate with 1 + STEPS new tokens: the cache holds the longer of the two
    max_len = args.prompt + max(args.new_tokens, args.profile + 1 if args.profile else 0)
    if max_len > args.prompt + args.new_tokens:
        emit(result="kv_cache_sized_for_profile", max_out_tokens=max_len, profile=args.profile)
    config: dict[str, Any] = {
        "dtype": args.dtype if args.weights == "native" else "int8",
        "replace_with_kernel_inject": True,
        "enable_cuda_graph": not args.no_cuda_graph and not args.offload,
        "max_out_tokens": max_len,
        "tensor_parallel": {
            "tp_size": world,
            "allreduce": args.tp_allreduce[0].split(":")[0],
            "symm_mem_kernel": "torch" if args.tp_allreduce[0].endswith(":torch") else "slipstream",
        },
        "use_triton": args.use_triton,
        "decode_fusion": {"auto": "auto", "off": False}.get(args.decode_fusion, True),
        "decode_gemv_table": args.decode_gemv_table,
        "decode_pdl": {"auto": "auto", "on": True, "off": False}[args.decode_pdl],
    }
    if world > 1 and args.tp_decode[0] != "auto":  # --tp-decode: the TP=N step's variant
        decode = args.tp_decode[0]
        config["decode_fusion"] = decode != "unfused"
    if args.offload:
        offload: dict[str, Any] = {"device": args.offload, "pin_memory": True}
        if args.offload == "nvme":
            offload.update(nvme_path=args.nvme_path, max_in_cpu=0)
        config["zero"] = {"stage": 3, "offload_param": offload}
        args.skip_hf_eager = args.skip_hf_compiled = True
    if args.weights != "native":
        bits = 4 if args.weights == "int4" else 8
        config["quant"] = {
            "weight": {
                "num_bits": bits,
                "group_size": args.group_size,
                "compute_dtype": args.dtype,
                "format": "fp8_e4m3" if args.weights == "fp8" else "int",
                "gemv_layout": {"auto": "auto", "on": True, "off": False}[args.gemv_layout],
                "lm_head": args.lm_head,
                "decode_gemv_table": args.quant_decode_table,
            }
        }
        if args.lm_head_bits is not None:
            config["quant"]["weight"]["lm_head_bits"] = args.lm_head_bits
        if args.scale_dtype is not None:
            config["quant"]["weight"]["scale_dtype"] = args.scale_dtype
    if args.attention_block_s:
        from slipstream.kernels.ops.decode_attention import triton as attention_module

        chunk = args.attention_block_s
        attention_module.default_block_s = lambda *_: chunk  # type: ignore[assignment]
        emit(result="attention_block_s", block_s=chunk)
    if args.gemv_table:
        from slipstream.kernels.ops.quant_matmul import gemv as gemv_module

        with open(args.gemv_table) as handle:
            table = json.load(handle)
        for key, launch in table.items():
            fmt, out_features, in_features = key.split(",")
            gemv_module.GEMV_TABLE[(fmt, int(out_features), int(in_features))] = (
                gemv_module.GemvConfig(**launch)
            )
        emit(result="gemv_table", path=args.gemv_table, entries=len(table))
    if args.quant_pdl is not None and args.weights != "native":
        pdl = {"on": "l2_partial", "basic": True, "off": False}[args.quant_pdl]
        config["quant"]["weight"]["decode_pdl"] = pdl
    started = time.perf_counter()
    engine = init_inference(model, config)
    emit(result="phase", phase="init_inference", seconds=round(time.perf_counter() - started, 2))
    fused = engine.fused
    assert fused is not None
    if args.decode_fusion not in ("auto", "on", "off"):  # a subset of the parts
        fused.decode_fusion = frozenset(args.decode_fusion.split(",")) & fused.decode_fusion
    spec = fused.spec
    reducer = getattr(fused.blocks[0], "reducer", None)
    common["allreduce"] = reducer.kind if reducer is not None else None
    if reducer is not None and reducer.kind == "symm_mem":
        common["allreduce"] += ":slipstream" if reducer.norm_state is not None else ":torch"
        if reducer.norm_why:
            emit(result="symm_mem_kernel_fallback", why=reducer.norm_why)
    # Bytes a decode step reads: every weight but the embedding table (only gathered rows).
    weight_bytes = sum(
        t.numel() * t.element_size()
        for name, t in list(fused.named_parameters()) + list(fused.named_buffers())
        if not name.startswith("embed.")
    )
    params = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    checks: dict[str, float] = {}
    if args.offload:
        # The fraction is then of the host -> device bandwidth, over the streamed blocks' bytes.
        weight_bytes = sum(t.numel() * t.element_size() for t in fused.blocks.state_dict().values())
        if args.offload == "nvme":  # the drive's read rate bounds the stream
            bandwidth = nvme_read_bandwidth(args.nvme_path)
            emit(result="nvme_read_bandwidth", gb_per_s=round(bandwidth / 1e9, 2), **common)
        else:
            bandwidth = host_to_device_bandwidth(device) if device.type == "cuda" else bandwidth
            emit(result="h2d_bandwidth", gb_per_s=round(bandwidth / 1e9, 1), **common)
    else:
        probe = torch.randint(3, spec.vocab_size, (1, args.prompt), device=device)
        with torch.no_grad():
            expected = model(input_ids=probe).logits.float()
        got = engine(probe).logits.float()
        error = (got - expected).abs().max().item()
        checks = {
            "logits_max_abs_diff_vs_hf": round(error, 4),
            "logits_max_abs_hf": round(expected.abs().max().item(), 4),
            # greedy decoding's view of the error: positions whose next token is HF's
            "top1_agreement_vs_hf": round(
                (got.argmax(-1) == expected.argmax(-1)).float().mean().item(), 4
            ),
        }
        del got
        if args.weights != "native" and world == 1:
            # The quantized kernels against the same model with plain linears holding the
            # dequantized codes: what is left is kernel rounding, not quantization error.
            checks["logits_max_abs_diff_vs_dequantized"] = round(
                dequantized_difference(engine, probe), 4
            )
            # One token: every linear runs the decode GEMV (at most 8 rows), not the prefill path.
            with torch.no_grad():
                expected_one = model(input_ids=probe[:, :1]).logits.float()
                got_one = engine(probe[:, :1]).logits.float()
            checks["one_token_logits_max_abs_diff_vs_hf"] = round(
                (got_one - expected_one).abs().max().item(), 4
            )
            checks["one_token_logits_max_abs_diff_vs_dequantized"] = round(
                dequantized_difference(engine, probe[:, :1]), 4
            )
    emit(
        result="model",
        offload=args.offload,
        **checks,
        params_non_embedding=params,
        weight_bytes_read_per_step=weight_bytes,
        bytes_per_parameter=round(weight_bytes * world / params, 3),  # this rank: 1/world
        # the LM head at its own width (quant.weight.lm_head / lm_head_bits; this rank's slice)
        lm_head_bytes=_linear_info(fused.head)[0],
        lm_head_format=_linear_info(fused.head)[2],
        weights=args.weights,
        **common,
    )

    generator = torch.Generator().manual_seed(0)
    for batch in args.batch:
        ids = torch.randint(3, spec.vocab_size, (batch, args.prompt), generator=generator)
        bench_batch(args, engine, model, ids.to(device), weight_bytes, params, bandwidth, common)
    if args.profile:
        ids = torch.randint(3, spec.vocab_size, (args.batch[0], args.prompt), generator=generator)
        profile_decode(engine, ids.to(device), args.profile, common, bandwidth)
    if reducer is not None and reducer.norm_state is not None:
        # Set when a wait of Slipstream's TP kernel gave up (then the sums were wrong).
        emit(result="tp_kernel_check", wait_gave_up=int(reducer.norm_state.error.item()))


def _scale_dtype(engine: Any) -> str | None:
    """The dtype of the quantized linears' group scales (None: no quantized linear)."""
    for module in engine.fused.modules():
        scales = getattr(module, "scales", None)
        if hasattr(module, "codes") and isinstance(scales, torch.Tensor):
            return str(scales.dtype).removeprefix("torch.")
    return None


def dequantized_difference(engine: Any, ids: torch.Tensor) -> float:
    """Max |logit difference| between the engine and a copy of its fused model whose quantized
    linears are plain linears holding the dequantized weights (in the compute dtype)."""
    import copy

    from slipstream.inference.quantize import WeightOnlyLinear

    reference = copy.deepcopy(engine.fused)
    for module in list(reference.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, WeightOnlyLinear):
                plain = torch.nn.Linear(1, 1, bias=child.bias is not None, device="meta")
                plain.weight = torch.nn.Parameter(child.dequantized_weight(), requires_grad=False)
                if child.bias is not None:
                    plain.bias = child.bias
                setattr(module, name, plain)
    length = ids.shape[1]
    slots = torch.arange(length, device=ids.device)
    with torch.no_grad():
        got = engine(ids).logits.float()
        want = reference(ids, slots[None], torch.ones_like(ids, dtype=torch.bool), slots).float()
    del reference
    return (got - want).abs().max().item()


# The decode-step GEMV kernels the profile labels by position: the bf16 fused GEMV, the fused
# quantized GEMV (quant_decode_gemv / quant_decode_qkv), the plain packed quantized GEMV and the
# unpacked quantized matmul (a quantized linear outside decode_fusion).
GEMV_KERNELS = ("decode_gemv_kernel", "fused_gemv_kernel", "gemv_kernel", "quant_matmul_kernel")


def _linear_info(linear: Any) -> tuple[int, str, str]:
    """A linear's weight bytes read per call (quantized: codes and scales), its ``out x in``
    shape and its weight format (``bf16``, ``int4``, ...)."""
    if hasattr(linear, "codes"):  # WeightOnlyLinear (packed or not)
        size = sum(t.numel() * t.element_size() for t in (linear.codes, linear.scales))
        fmt = linear.format + ("/packed" if linear.packed else "")
        return size, f"{linear.out_features}x{linear.in_features}", fmt
    weight = linear.weight
    dtype = str(weight.dtype).removeprefix("torch.").replace("bfloat16", "bf16")
    return weight.numel() * weight.element_size(), "x".join(map(str, weight.shape)), dtype


def _gemv_parts(engine: Any) -> list[tuple[str, int, str, str]]:
    """The decode GEMVs of one decode step in launch order as ``(part, weight bytes, shape,
    format)``: the parts in ``decode_fusion`` (one ``GEMV_KERNELS`` launch each) and every
    quantized linear (its own kernel even when unfused; the profile tells them apart by
    position)."""
    fused = engine.fused
    parts = fused.decode_fusion
    order = []
    for block in fused.blocks:
        for part, name in (("qkv", "qkv"), ("out", "out"), ("gate_up", "up"), ("down", "down")):
            linear = getattr(block, name)
            if part in parts or hasattr(linear, "codes"):
                order.append((part, *_linear_info(linear)))
    if "head" in parts or hasattr(fused.head, "codes"):
        order.append(("head", *_linear_info(fused.head)))
    return order


def profile_decode(
    engine: Any, ids: torch.Tensor, steps: int, common: dict[str, Any], bandwidth: float
) -> None:
    """Per-kernel GPU time of a decode step: ``generate`` of 1 and of ``1 + steps`` new tokens
    are profiled, and the difference per kernel name, divided by ``steps``, is one decode step
    (inside the CUDA graph the kernels are still reported one by one). The GEMV kernels'
    calls (``GEMV_KERNELS``: bf16 and quantized) are also told apart by their place in the step
    (QKV, output, gate/up, down per block, then the head): time, shape, weight format, GB/s and
    share of the copy bandwidth of each part, and of all GEMVs together."""
    from torch.profiler import ProfilerActivity, profile

    gemv_order = _gemv_parts(engine)
    gemv_calls: dict[int, list[float]] = {}

    def kernels(new: int) -> dict[str, tuple[int, float]]:
        mask = torch.ones_like(ids)
        engine.generate(ids, attention_mask=mask, max_new_tokens=new, eos_token_id=None)
        sync(ids.device)
        activities = [ProfilerActivity.CPU]
        if ids.is_cuda:
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities) as prof:
            engine.generate(ids, attention_mask=mask, max_new_tokens=new, eos_token_id=None)
            sync(ids.device)
        table: dict[str, tuple[int, float]] = {}
        gemvs = []
        for event in prof.events():
            on_device = getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA
            if not on_device and ids.is_cuda:
                continue
            if not ids.is_cuda and event.cpu_parent is not None:
                continue  # CPU run: top-level ops only
            time_us = event.device_time if ids.is_cuda else event.cpu_time
            if event.name in GEMV_KERNELS:
                gemvs.append((event.time_range.start, time_us))
            calls, total = table.get(event.name, (0, 0.0))
            table[event.name] = (calls + 1, total + time_us)
        gemv_calls[new] = [time_us for _, time_us in sorted(gemvs)]
        return table

    base, longer = kernels(1), kernels(1 + steps)
    rows = []
    for name, (calls, total) in longer.items():
        base_calls, base_total = base.get(name, (0, 0.0))
        per_step_calls = (calls - base_calls) / steps
        per_step_us = (total - base_total) / steps
        if per_step_calls > 0 or per_step_us > 0.5:
            rows.append((per_step_us, per_step_calls, name))
    rows.sort(reverse=True)
    step_us = sum(row[0] for row in rows)
    emit(
        result="decode_profile_total",
        kernels_per_step=round(sum(row[1] for row in rows), 1),
        kernel_us_per_step=round(step_us, 1),
        batch=ids.shape[0],
        **common,
    )
    for per_step_us, per_step_calls, name in rows[:40]:
        emit(
            result="decode_profile",
            kernel=name[:120],
            calls_per_step=round(per_step_calls, 2),
            us_per_step=round(per_step_us, 2),
            share=round(per_step_us / max(step_us, 1e-9), 4),
        )
    # The decode steps' GEMVs, each labelled by its place in the step
    # (a GEMV kernel the prefill runs too, e.g. the unpacked quantized matmul: the longer run's
    # first ones are the prefill's)
    in_prefill = gemv_calls.get(1, [])
    in_steps = gemv_calls.get(1 + steps, [])[len(in_prefill) :]
    period = len(gemv_order)
    if not ids.is_cuda or not period or len(in_steps) != period * steps:
        if ids.is_cuda and (in_steps or in_prefill):
            emit(
                result="decode_profile_gemv_skipped",
                calls=len(in_steps),
                in_prefill=len(in_prefill),
                expected=period * steps,
            )
        return
    by_part: dict[str, list[float]] = {}
    by_bytes: dict[str, int] = {}
    labels: dict[str, tuple[str, str]] = {}
    for index, time_us in enumerate(in_steps):
        part, size, shape, fmt = gemv_order[index % period]
        by_part.setdefault(part, []).append(time_us)
        by_bytes[part] = by_bytes.get(part, 0) + size
        labels[part] = (shape, fmt)
    gemv_us = sum(in_steps) / steps
    emit(
        result="decode_profile_gemv_total",
        us_per_step=round(gemv_us, 1),
        share_of_step=round(gemv_us / max(step_us, 1e-9), 4),
        other_us_per_step=round(step_us - gemv_us, 1),
        gb_per_s=round(sum(by_bytes.values()) / (sum(in_steps) / 1e6) / 1e9, 1),
        fraction_of_copy=round(sum(by_bytes.values()) / (sum(in_steps) / 1e6) / bandwidth, 3),
    )
    for part, times in by_part.items():
        seconds = sum(times) / 1e6
        emit(
            result="decode_profile_gemv",
            part=part,
            shape=labels[part][0],
            format=labels[part][1],
            calls_per_step=len(times) // steps,
            us_per_step=round(sum(times) / steps, 2),
            us_per_call=round(sum(times) / len(times), 2),
            gb_per_s=round(by_bytes[part] / seconds / 1e9, 1),
            fraction_of_copy=round(by_bytes[part] / seconds / bandwidth, 3),
        )


if __name__ == "__main__":
    main()
