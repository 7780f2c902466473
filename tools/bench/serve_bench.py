"""Serving load generator: Poisson arrivals and realistic lengths against the OpenAI-compatible
server over HTTP on localhost (throughput, TTFT and ITL p50/p99, SLO goodput), and the same
workload through Hugging Face Transformers' continuous batching (``generate_batch``).

CPU check (tiny random Llama, about a minute)::

    PYTHONPATH=$(ls -d kernels/src packages/*/src | tr '\\n' ':') python3 tools/bench/serve_bench.py \\
        --model tiny --num-requests 16 --rate 8 --prompt-len 16:64 --output-len 16:48

One H100, a Llama-3-8B-shaped model with random bf16 weights: 64 requests of 64-200 prompt
tokens and 256 new tokens, all at once (the HF baseline's setting), the engine in process and
Transformers' ``generate_batch`` in one run; then the per-step timeline, the same without CUDA
graphs, and Poisson arrivals at 4 requests/s::

    python3 tools/bench/serve_bench.py --model llama3-8b --num-requests 64 --rate inf \\
        --prompt-len 64:200 --output-len 256 --backend in-process hf --json serve_bench.jsonl
    python3 tools/bench/serve_bench.py --model llama3-8b --num-requests 64 --rate inf \\
        --prompt-len 64:200 --output-len 256 --backend in-process --timeline timeline.json
    python3 tools/bench/serve_bench.py --model llama3-8b --num-requests 64 --rate inf \\
        --prompt-len 64:200 --output-len 256 --backend in-process --no-cuda-graph
    python3 tools/bench/serve_bench.py --model llama3-8b --num-requests 64 --rate 4 \\
        --prompt-len 64:200 --output-len 256 --backend in-process --json serve_bench.jsonl

Kernel tables (torch.profiler) of the prompt steps and of 20 decode-only steps, no benchmark::

    python3 tools/bench/serve_bench.py --model llama3-8b --num-requests 64 --rate inf \\
        --prompt-len 64:200 --output-len 256 --profile 20 --profile-out profile.txt

Per measured step: Triton compiles, cudaMalloc calls and allocator retries (``--probe``); and
tensor-parallel serving on two GPUs (NCCL)::

    python3 tools/bench/serve_bench.py --model llama3-8b --num-requests 64 --rate inf \\
        --prompt-len 64:200 --output-len 256 --backend in-process --probe --timeline timeline.json
    torchrun --nproc_per_node 2 tools/bench/serve_bench.py --model llama3-8b --num-requests 64 \\
        --rate inf --prompt-len 64:200 --output-len 256 --backend in-process --tp 2

``--backend slipstream`` (the HTTP server in a child process, the client over localhost) needs
starlette, uvicorn and httpx (``slipstream-inference[serve]``); ``--backend in-process``
replays the same workload on the engine without HTTP and needs none of them.

Prompts are random token ids (no tokenizer is needed or downloaded); every request generates
exactly its output length (``ignore_eos``), as serving benchmarks do.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import inspect
import itertools
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

MODEL_NAME = "bench"


@dataclass
class Workload:
    """Prompts (token ids), output lengths and arrival times (seconds from the start)."""

    prompts: list[list[int]]
    output_lens: list[int]
    arrivals: list[float]


@dataclass
class RequestResult:
    """What the client saw of one request."""

    prompt_len: int
    output_len: int = 0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0
    error: str | None = None


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def make_workload(args: argparse.Namespace, vocab: int) -> Workload:
    """Lengths uniform in MIN:MAX, or lognormal (a long tail, as chat traffic has) clipped to it."""
    rng = random.Random(args.seed)

    def length(bounds: tuple[int, int]) -> int:
        low, high = bounds
        if low == high:
            return low
        if args.lengths == "lognormal":
            median = math.sqrt(low * high)
            return int(min(high, max(low, rng.lognormvariate(math.log(median), 0.6))))
        return rng.randint(low, high)

    prompt_bounds, output_bounds = _range(args.prompt_len), _range(args.output_len)
    prompts = [
        [rng.randrange(10, vocab) for _ in range(length(prompt_bounds))]
        for _ in range(args.num_requests)
    ]
    if args.shared_prefix:  # one system prompt before every prompt: prefix caching's case
        prefix = [rng.randrange(10, vocab) for _ in range(args.shared_prefix)]
        prompts = [prefix + prompt for prompt in prompts]
    outputs = [length(output_bounds) for _ in range(args.num_requests)]
    arrivals, now = [], 0.0
    for _ in range(args.num_requests):
        arrivals.append(now)
        if args.rate != math.inf:
            now += rng.expovariate(args.rate)  # Poisson process: exponential gaps
    return Workload(prompts, outputs, arrivals)


def build_model(name: str, device: str) -> Any:
    """A random model of a known shape ("tiny", "llama3-8b") or a Hugging Face id / folder."""
    import torch
    import transformers

    shapes = {
        "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                     max_position_embeddings=1024),
        "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                          max_position_embeddings=8192, rope_theta=500000.0),
    }  # fmt: skip
    if name not in shapes:
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        return transformers.AutoModelForCausalLM.from_pretrained(name, dtype=dtype).to(device)
    dtype = torch.float32 if name == "tiny" else torch.bfloat16
    config = transformers.LlamaConfig(**shapes[name], bos_token_id=1, eos_token_id=2)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def serve_only(args: argparse.Namespace) -> int:
    """The server process: build the model, serve it on 127.0.0.1:port until SIGTERM."""
    from slipstream.inference.serving import pipeline
    from slipstream.inference.serving.server import build_server

    model = build_model(args.model, args.device)
    deployment = pipeline(model, config=_serving_config(args)).serve()
    deployment.model_name = MODEL_NAME
    build_server(deployment, "127.0.0.1", args.port, log_level="warning").run()
    return 0


async def _one(client: Any, url: str, prompt: list[int], output_len: int, delay: float,
               origin: float) -> RequestResult:  # fmt: skip
    await asyncio.sleep(max(0.0, origin + delay - time.perf_counter()))
    result = RequestResult(len(prompt))
    body = {
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    result.start = last = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                now = time.perf_counter()
                if event.get("usage"):
                    result.output_len = event["usage"]["completion_tokens"]
                elif event["choices"]:
                    if result.ttft is None:
                        result.ttft = now - result.start
                    else:
                        result.itl.append(now - last)
                    last = now
    except Exception as error:
        result.error = repr(error)
    result.end = time.perf_counter()
    return result


async def run_client(url: str, workload: Workload) -> list[RequestResult]:
    """Replay ``workload`` against ``url``: each request sent at its arrival time, streamed."""
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        origin = time.perf_counter()
        jobs = [
            _one(client, url, p, n, a, origin)
            for p, n, a in zip(workload.prompts, workload.output_lens, workload.arrivals)
        ]
        return list(await asyncio.gather(*jobs))


def _warmup_prompt(workload: Workload, index: int) -> list[int]:
    """A prompt of a workload's length, reversed so that it shares no prefix-cache block with
    the measured requests."""
    return list(reversed(workload.prompts[index % len(workload.prompts)]))


async def _warm(url: str, workload: Workload, count: int) -> None:
    """``count`` short requests, one at a time (compiles the kernels before measuring)."""
    import httpx

    async with httpx.AsyncClient(timeout=None) as client:
        for index in range(count):
            prompt = _warmup_prompt(workload, index)
            await _one(client, url, prompt, 8, 0.0, time.perf_counter())


def _engine_counters(url: str) -> dict[str, float]:
    import httpx

    counters = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(
            (
                "slipstream_engine_",
                "slipstream_num_preemptions",
                "slipstream_prefix_cache_hit",
                "slipstream_prompt_tokens",
            )
        ):
            name, value = line.split()
            counters[name.removeprefix("slipstream_")] = float(value)
    return counters


def where_time_goes(before: dict[str, float], after: dict[str, float], duration: float) -> dict:
    """Per-step engine time by phase over the measured run, and how busy the engine was."""
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    steps = max(delta.get("engine_steps", 0.0), 1.0)
    phases = ("schedule", "forward", "sample", "update")
    per_step = {p: round(delta.get(f"engine_{p}_seconds", 0.0) / steps * 1000, 3) for p in phases}
    busy = sum(delta.get(f"engine_{p}_seconds", 0.0) for p in phases)
    return {
        "steps": int(delta.get("engine_steps", 0)),
        "tokens_per_step": round(delta.get("engine_batched_tokens", 0.0) / steps, 1),
        "ms_per_step": per_step,
        "engine_busy_fraction": round(busy / duration, 3),
        "preemptions": int(delta.get("num_preemptions", 0)),
        "prefix_cache_hit_rate": round(
            delta.get("prefix_cache_hit_tokens_total", 0.0)
            / max(delta.get("prompt_tokens_total", 0.0), 1.0),
            3,
        ),
    }


def copy_bandwidth(device: str, size_bytes: int = 1 << 30, repeats: int = 10) -> float:
    """Measured device-memory bandwidth in bytes/s: a ``size_bytes`` copy reads and writes it."""
    import torch

    src = torch.empty(size_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    synchronize = torch.cuda.synchronize if src.is_cuda else (lambda: None)
    synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    synchronize()
    return 2 * size_bytes * repeats / (time.perf_counter() - start)


def model_bytes(name: str) -> tuple[int, int]:
    """(bytes of the weights a decode step reads, KV-cache bytes per token) of the served model,
    counted on the meta device (bf16 on a GPU as build_model makes it; the embedding table is
    not counted: a step reads only its tokens' rows)."""
    import torch
    import transformers

    if name in ("tiny", "llama3-8b"):
        model = build_model(name, "meta")
    else:  # only the config is read: no weights are loaded
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(
                transformers.AutoConfig.from_pretrained(name)
            )
    config = model.config
    element = 4 if name == "tiny" else 2
    embed = model.get_input_embeddings().weight
    weights = sum(p.numel() for p in model.parameters()) - embed.numel()
    if getattr(config, "tie_word_embeddings", False):
        weights += embed.numel()  # the LM head reads the tied table whole
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = config.num_key_value_heads or heads
    kv_per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * element
    return weights * element, kv_per_token


def decode_bound(
    workload: Workload,
    tokens_per_s: float,
    batch: float,
    weights: int,
    kv_per_token: int,
    bandwidth: float,
) -> dict:
    """The decode bound at the run's concurrency ``batch``: each step reads the weights once
    (and every running request's KV cache) at the measured copy ``bandwidth``, and yields one
    token per request. ``fraction`` is the run's output rate over the weights-and-KV bound
    (prefill time counts against the run, so a decode-heavy workload approaches it)."""
    prompt = sum(len(p) for p in workload.prompts) / len(workload.prompts)
    context = prompt + sum(workload.output_lens) / len(workload.output_lens) / 2
    weights_step = weights / bandwidth
    kv_step = batch * context * kv_per_token / bandwidth
    bound = batch / (weights_step + kv_step)
    return {
        "concurrency": round(batch, 1),
        "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "weight_gb": round(weights / 1e9, 3),
        "kv_gb_per_step": round(batch * context * kv_per_token / 1e9, 3),
        "step_ms_bound": round((weights_step + kv_step) * 1000, 3),
        "weights_only_tokens_per_s": round(batch / weights_step, 1),
        "tokens_per_s": round(bound, 1),
        "fraction": round(tokens_per_s / bound, 3),
    }


def timeline_summary(records: list[dict]) -> dict:
    """Mean ms per phase over decode-only steps and over steps with a prompt chunk."""
    out: dict[str, Any] = {}
    for kind, chosen in (
        ("decode_only", [r for r in records if r["decode_only"]]),
        ("with_prefill", [r for r in records if not r["decode_only"]]),
    ):
        if not chosen:
            continue
        phases = ("schedule_ms", "forward_ms", "sample_ms", "update_ms")
        out[kind] = {
            "steps": len(chosen),
            "graph_steps": sum(1 for r in chosen if r["graph_bucket"]),
            "mean_sequences": round(sum(r["sequences"] for r in chosen) / len(chosen), 1),
            "mean_tokens": round(sum(r["tokens"] for r in chosen) / len(chosen), 1),
            **{p: round(sum(r[p] for r in chosen) / len(chosen), 3) for p in phases},
        }
        if len(chosen) > 1:  # wall time per step, gaps between steps included
            span = chosen[-1]["start"] - chosen[0]["start"]
            out[kind]["wall_ms_per_step"] = round(span / (len(chosen) - 1) * 1000, 3)
    return out


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def summarize(backend: str, results: list[RequestResult], args: argparse.Namespace) -> dict:
    """Throughput, TTFT/ITL percentiles and SLO goodput of one run."""
    done = [r for r in results if r.error is None]
    duration = max(r.end for r in results) - min(r.start for r in results)
    itl = [x for r in done for x in r.itl]
    ttft = [r.ttft for r in done if r.ttft is not None]
    good = [
        r for r in done
        if r.ttft is not None and r.ttft <= args.slo_ttft
        and (_percentile(r.itl, 99) or 0.0) <= args.slo_itl
    ]  # fmt: skip
    out_tokens = sum(r.output_len for r in done)
    return {
        "backend": backend,
        "model": args.model,
        "requests": len(results),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "rate": args.rate,
        "duration_s": round(duration, 3),
        "output_tokens": out_tokens,
        "output_tokens_per_s": round(out_tokens / duration, 1),
        "requests_per_s": round(len(done) / duration, 3),
        "ttft_p50_s": _percentile(ttft, 50),
        "ttft_p99_s": _percentile(ttft, 99),
        "itl_p50_s": _percentile(itl, 50),
        "itl_p99_s": _percentile(itl, 99),
        "goodput_requests_per_s": round(len(good) / duration, 3),
        "slo": {"ttft_s": args.slo_ttft, "itl_p99_s": args.slo_itl},
    }


def run_slipstream(args: argparse.Namespace, workload: Workload) -> dict:
    """Start the server in a child process (unless --url), replay, stop it with SIGTERM."""
    url, process = args.url, None
    if url is None:
        import httpx

        command = [sys.executable, __file__, "--serve-only", "--model", args.model,
                   "--device", args.device, "--port", str(args.port),
                   "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                   "--max-num-seqs", str(args.max_num_seqs)]  # fmt: skip
        if args.no_prefix_caching:
            command.append("--no-prefix-caching")
        if args.no_cuda_graph:
            command.append("--no-cuda-graph")
        command.append("--async-scheduling" if args.async_scheduling else "--no-async-scheduling")
        for flag, value in (
            ("--num-blocks", args.num_blocks),
            ("--max-model-len", args.max_model_len),
        ):
            if value is not None:
                command += [flag, str(value)]
        process = subprocess.Popen(command, env=os.environ.copy())
        url = f"http://127.0.0.1:{args.port}"
        deadline = time.monotonic() + args.startup_timeout
        while True:
            if process.poll() is not None:
                raise SystemExit(f"the server exited with {process.returncode} before serving")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                process.kill()
                raise SystemExit("the server did not start in time")
            time.sleep(0.5)
    try:
        asyncio.run(_warm(url, workload, args.warmup))  # compiles kernels; not measured
        before = _engine_counters(url)
        results = asyncio.run(run_client(url, workload))
        summary = summarize("slipstream", results, args)
        summary["engine"] = where_time_goes(before, _engine_counters(url), summary["duration_s"])
        return summary
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)  # graceful: drains, then exits
            process.wait(timeout=120)


def _serving_config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "num_blocks": args.num_blocks,
        "max_model_len": args.max_model_len,
        "enable_prefix_caching": not args.no_prefix_caching,
        "cuda_graph": not args.no_cuda_graph,
        "async_scheduling": args.async_scheduling,
    }


def install_step_probe(engine: Any) -> list[dict]:
    """Wrap ``engine.step`` (before its thread starts stepping it): per step, its wall time, the
    Triton kernels compiled or loaded from Triton's disk cache during it (the JIT cache hook
    fires only when a launch misses the in-memory cache), and the CUDA caching allocator's
    ``cudaMalloc`` calls and out-of-memory retries. Returns the list the steps append to."""
    import torch

    compiles: list[str] = []

    def hook(*_: Any, **kwargs: Any) -> bool:
        text = str(kwargs.get("repr", "?"))
        compiles.append(text.split("[", 1)[0] + " " + text.rsplit("](", 1)[-1][:400])
        return False  # never skip the compile

    try:
        from triton import knobs

        knobs.runtime.jit_cache_hook = hook
    except (ImportError, AttributeError):  # Triton < 3.4
        from triton.runtime.jit import JITFunction

        JITFunction.cache_hook = hook  # type: ignore[attr-defined]
    cuda = torch.cuda.is_available()
    probes: list[dict] = []
    step = engine.step

    def memory() -> tuple[int, int]:
        if not cuda:
            return 0, 0
        stats = torch.cuda.memory_stats()
        return int(stats.get("num_device_alloc", 0)), int(stats.get("num_alloc_retries", 0))

    def probed() -> Any:
        seen, (mallocs, retries) = len(compiles), memory()
        start = time.perf_counter()
        outputs = step()
        if outputs or len(compiles) > seen:
            after = memory()
            probes.append({
                "ms": round((time.perf_counter() - start) * 1000, 2),
                "outputs": len(outputs),
                "compiles": compiles[seen:],
                "cuda_mallocs": after[0] - mallocs,
                "alloc_retries": after[1] - retries,
            })  # fmt: skip
        return outputs

    engine.step = probed
    return probes


def probe_summary(probes: list[dict], limit: int = 12) -> list[str]:
    """Compact lines: every step that compiled, retried an allocation or called cudaMalloc,
    and the slowest steps."""
    lines = []
    slow = sorted(range(len(probes)), key=lambda i: -probes[i]["ms"])[:5]
    for index, probe in enumerate(probes):
        eventful = probe["compiles"] or probe["alloc_retries"] or probe["cuda_mallocs"]
        if eventful or index in slow:
            lines.append(
                f"step {index}: {probe['ms']} ms, {probe['outputs']} outputs, "
                f"{probe['cuda_mallocs']} cudaMalloc, {probe['alloc_retries']} alloc retries, "
                f"{len(probe['compiles'])} Triton compiles {probe['compiles']}"
            )
    return lines[:limit] + ([f"... {len(lines) - limit} more"] if len(lines) > limit else [])


def run_in_process(args: argparse.Namespace, workload: Workload) -> dict:
    """The same workload through a :class:`Deployment` in this process, without HTTP (needs
    no starlette/uvicorn/httpx): the engine's own throughput and latencies."""
    from slipstream.inference.serving import SamplingParams, pipeline

    served = pipeline(
        build_model(args.model, args.device),
        config=_serving_config(args),
        tensor_parallel=args.tp,
    )
    if not served.engine.is_driver:
        # Tensor parallelism, ranks > 0: pipeline() returned after serving rank 0's steps.
        return {"backend": "tp-worker", "rank": served.engine.rank}
    probes = install_step_probe(served.engine) if args.probe else None
    deployment = served.serve()
    engine = deployment.engine

    async def one(prompt: list[int], output_len: int, delay: float, origin: float) -> RequestResult:
        await asyncio.sleep(max(0.0, origin + delay - time.perf_counter()))
        result = RequestResult(len(prompt))
        params = SamplingParams(max_tokens=output_len, ignore_eos=True)
        result.start = last = time.perf_counter()
        stream = deployment.submit(prompt, params, loop=asyncio.get_running_loop())
        async for out in stream:
            now = time.perf_counter()
            if out.new_token_ids:
                if result.ttft is None:
                    result.ttft = now - result.start
                else:
                    result.itl.append(now - last)
                last = now
            result.output_len = out.num_output_tokens
        result.end = time.perf_counter()
        return result

    async def warm() -> None:
        for index in range(args.warmup):
            await one(_warmup_prompt(workload, index), 8, 0.0, time.perf_counter())

    async def replay() -> list[RequestResult]:
        origin = time.perf_counter()
        jobs = [
            one(p, n, a, origin)
            for p, n, a in zip(workload.prompts, workload.output_lens, workload.arrivals)
        ]
        return list(await asyncio.gather(*jobs))

    try:
        asyncio.run(warm())  # compiles kernels; not measured
        if probes is not None:
            probes.clear()
        before = _engine_totals(deployment)
        if args.timeline:
            engine.timeline = []  # read by the engine thread at its next step
        results = asyncio.run(replay())
        summary = summarize("slipstream-in-process", results, args)
        summary["engine"] = where_time_goes(
            before, _engine_totals(deployment), summary["duration_s"]
        )
        if engine.timeline is not None:
            records = [dataclasses.asdict(r) for r in list(engine.timeline)]
            summary["timeline"] = timeline_summary(records)
            with open(args.timeline, "w") as handle:
                json.dump({"argv": sys.argv[1:], "steps": records}, handle)
            summary["timeline_file"] = args.timeline
        if probes is not None:
            summary["probe"] = probe_summary(probes)
        return summary
    finally:
        deployment.shutdown()
        # Free the KV cache now: the next backend in this process needs the GPU memory.
        deployment.engine.runner.key_cache.clear()
        deployment.engine.runner.value_cache.clear()


def _engine_totals(deployment: Any) -> dict[str, float]:
    totals = {name: float(value) for name, (value, _) in deployment.gauges().items()}
    totals["prompt_tokens_total"] = float(deployment.metrics.prompt_tokens)
    totals["prefix_cache_hit_tokens_total"] = float(deployment.metrics.cached_prompt_tokens)
    return totals


def _kernel_table(prof: Any, rows: int = 30) -> str:
    averages = prof.key_averages()
    for key in ("self_device_time_total", "self_cuda_time_total", "self_cpu_time_total"):
        try:
            return str(averages.table(sort_by=key, row_limit=rows))
        except (AttributeError, KeyError, ValueError):
            continue
    return str(averages.table(row_limit=rows))


def run_profile(args: argparse.Namespace, workload: Workload) -> dict:
    """torch.profiler over the engine stepped in this thread: the steps with a prompt chunk
    (all requests submitted at once), then ``--profile`` decode-only steps; prints each
    phase's kernel table (sorted by self device time) and writes them to ``--profile-out``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from slipstream.inference.serving import SamplingParams, pipeline

    engine = pipeline(build_model(args.model, args.device), config=_serving_config(args)).engine
    warm = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.generate([_warmup_prompt(workload, i) for i in range(max(1, args.warmup))], warm)
    for prompt, output_len in zip(workload.prompts, workload.output_lens):
        engine.add_request(prompt, SamplingParams(max_tokens=output_len, ignore_eos=True))
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    engine.timeline = []
    with profile(activities=activities) as prefill:
        while engine.has_unfinished:
            engine.step()
            if engine.timeline and engine.timeline[-1].decode_only:
                break
    prefill_steps = len(engine.timeline)
    engine.timeline = []
    with profile(activities=activities) as decode:
        for _ in range(args.profile):
            if not engine.has_unfinished:
                break
            engine.step()
    records = [dataclasses.asdict(r) for r in engine.timeline]
    while engine.has_unfinished:  # finish the work (frees the KV blocks)
        engine.step()
    text = (
        f"== {prefill_steps} steps until the first decode-only step (prompt chunks) ==\n"
        f"{_kernel_table(prefill)}\n== {len(records)} decode-only steps ==\n"
        f"{_kernel_table(decode)}\n"
    )
    print(text)
    if args.profile_out:
        with open(args.profile_out, "w") as handle:
            handle.write(text)
    return {
        "backend": "profile",
        "prefill_steps": prefill_steps,
        "decode_timeline": timeline_summary(records),
        "profile_out": args.profile_out,
    }


def _batch_inputs(prompts: list[list[int]], device: str) -> tuple[Any, Any]:
    """Left-padded ids (pad 0) and their attention mask."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


def run_static(args: argparse.Namespace, workload: Workload) -> dict:
    """The same workload through ``init_inference``'s static-cache ``generate`` (fused decoder,
    CUDA-graph decode) in static batches of ``--static-batch`` requests (default: all, up to
    ``--max-num-seqs``): a batch starts when the previous one ends, with the requests that have
    arrived by then (the first waiting one's arrival at the earliest), left-padded, and runs
    until its longest output; each request counts its own output length. TTFT includes the
    wait for a batch; TTFT and ITL come from CUDA events recorded after the prefill and each
    decode step (no extra host syncs)."""
    import torch

    from slipstream.inference import init_inference

    model = build_model(args.model, args.device)
    cuda = str(args.device).startswith("cuda")
    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    max_len = max(len(p) for p in workload.prompts) + max(workload.output_lens)
    engine = init_inference(
        model,
        {
            "dtype": names[next(model.parameters()).dtype],
            "replace_with_kernel_inject": True,
            "enable_cuda_graph": cuda and not args.no_cuda_graph,
            "max_out_tokens": max_len,
        },
    )
    batch = args.static_batch or min(len(workload.prompts), args.max_num_seqs)
    # Per-token timestamps: the engine's generate has no streamer, so the bench wraps its
    # static-cache runner's two steps (a private attribute: this is a measuring tool).
    runner = engine._runner
    stamps: list[Any] = []
    prefill, decode = runner.prefill, runner.decode

    def mark() -> None:
        if cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            stamps.append(event)
        else:
            stamps.append(time.perf_counter())

    def timed_prefill(*call: Any) -> Any:
        out = prefill(*call)
        mark()
        return out

    def timed_decode(*call: Any, **options: Any) -> Any:
        out = decode(*call, **options)
        mark()
        return out

    runner.prefill, runner.decode = timed_prefill, timed_decode

    def run_batch(prompts: list[list[int]], new_tokens: int) -> tuple[float, list[float]]:
        """Generate; returns the start (perf_counter) and each new token's time."""
        ids, mask = _batch_inputs(prompts, args.device)
        stamps.clear()
        start_event = None
        if cuda:
            torch.cuda.synchronize()
            start_event = torch.cuda.Event(enable_timing=True)
            start_event.record()
        start = time.perf_counter()
        engine.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0
        )
        if cuda:
            torch.cuda.synchronize()
            times = [start + start_event.elapsed_time(e) / 1000 for e in stamps]  # type: ignore[union-attr]
        else:
            times = list(stamps)
        return start, times[:new_tokens]

    # Warm-up: compiles, and the decode graph of each batch size an all-at-once run meets.
    sizes = {batch, len(workload.prompts) % batch} - {0}
    for size in sorted(sizes):
        run_batch([_warmup_prompt(workload, i) for i in range(size)], 4)
    results = [RequestResult(len(p)) for p in workload.prompts]
    origin = time.perf_counter()
    index = 0
    while index < len(results):
        now = time.perf_counter() - origin
        if workload.arrivals[index] > now:
            time.sleep(workload.arrivals[index] - now)
            now = time.perf_counter() - origin
        members = [
            j for j in range(index, min(index + batch, len(results))) if workload.arrivals[j] <= now
        ]
        index += len(members)
        outputs = [workload.output_lens[j] for j in members]
        _, times = run_batch([workload.prompts[j] for j in members], max(outputs))
        for j, count in zip(members, outputs):
            result = results[j]
            result.start = origin + workload.arrivals[j]
            result.ttft = times[0] - result.start
            result.itl = [b - a for a, b in itertools.pairwise(times[:count])]
            result.output_len = count
            result.end = times[count - 1]
    summary = summarize("static-init_inference", results, args)
    summary["static_batch"] = batch
    runner.prefill, runner.decode = prefill, decode
    return summary


def run_hf_continuous_batching(args: argparse.Namespace, workload: Workload) -> dict:
    """The same prompts through ``model.generate_batch`` (all submitted at once: its API has
    no arrivals; compare with ``--rate inf``). One max_new_tokens for all requests: the
    longest output length (tokens actually generated are counted)."""
    import transformers

    model = build_model(args.model, args.device)
    config = transformers.GenerationConfig(
        max_new_tokens=max(workload.output_lens), do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    accepted = inspect.signature(model.generate_batch).parameters
    extra = {"record_timestamps": True} if "record_timestamps" in accepted else {}
    model.generate_batch(
        inputs=[_warmup_prompt(workload, i) for i in range(max(1, args.warmup))],
        generation_config=config,
        **extra,
    )
    start = time.perf_counter()
    outputs = model.generate_batch(inputs=workload.prompts, generation_config=config, **extra)
    end = time.perf_counter()
    results = []
    for out in outputs.values():
        result = RequestResult(len(out.prompt_ids), len(out.generated_tokens), start=start, end=end)
        lifespan = getattr(out, "lifespan", None)
        if lifespan and getattr(out, "created_time", None):
            # Transformers' own clock: from the request's creation to its last token, leaving
            # out what the call spends around generation (its warm-up, manager start and stop).
            result.start, result.end = out.created_time, lifespan[1]
        stamps = getattr(out, "timestamps", None)
        if stamps:
            result.ttft = stamps[0] - out.created_time
            result.itl = [b - a for a, b in itertools.pairwise(stamps)]
        results.append(result)
    summary = summarize("hf-generate_batch", results, args)
    summary["call_duration_s"] = round(end - start, 3)
    summary["note"] = (
        "offline: all requests at once; duration from the requests' creation to their last "
        "token (Transformers' timestamps) where present, else the whole call; ttft/itl from "
        "record_timestamps when present"
    )
    return summary


def _release_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def init_tensor_parallel(args: argparse.Namespace) -> int:
    """``--tp N`` under ``torchrun --nproc_per_node N`` (or ``slipstream run``): one GPU per rank,
    the process group up (NCCL on GPUs); returns this rank."""
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.tp:
        raise SystemExit(
            f"--tp {args.tp} needs {args.tp} processes (WORLD_SIZE={world}): launch with "
            f"`torchrun --nproc_per_node {args.tp} tools/bench/serve_bench.py ... --tp {args.tp}`"
        )
    if set(args.backend) != {"in-process"} or args.profile or args.url:
        raise SystemExit("--tp > 1 runs the in-process backend only (--backend in-process)")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        args.device = f"cuda:{torch.cuda.current_device()}"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank()


def main(argv: list[str] | None = None) -> int:
    """Parse options, run the chosen backends, print and (optionally) append JSON lines."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="tiny", help="tiny, llama3-8b (random) or an HF id/folder"
    )
    parser.add_argument("--device", default=None, help="default: cuda when available")
    parser.add_argument(
        "--backend",
        nargs="+",
        choices=["slipstream", "in-process", "static", "hf", "both"],
        default=["slipstream"],
        help="one or more, run in order. slipstream: the HTTP server in a child process; "
        "in-process: its engine without HTTP; static: init_inference's generate in static "
        "batches; hf: Transformers' generate_batch; "
        "both: slipstream and hf",
    )
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument(
        "--rate", type=float, default=math.inf, help="requests/s (inf: all at once)"
    )
    parser.add_argument("--prompt-len", default="64:200", help="MIN:MAX or N tokens")
    parser.add_argument("--output-len", default="256", help="MIN:MAX or N tokens")
    parser.add_argument("--lengths", choices=["uniform", "lognormal"], default="uniform")
    parser.add_argument(
        "--shared-prefix", type=int, default=0, help="tokens of a system prompt shared by all"
    )
    parser.add_argument(
        "--no-prefix-caching", action="store_true", help="serve without prefix caching"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured requests first")
    parser.add_argument("--url", help="use a running server (model name 'bench') instead")
    parser.add_argument("--port", type=int, default=18431)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--static-batch",
        type=int,
        help="static backend: requests per batch (default: all, up to --max-num-seqs)",
    )
    parser.add_argument("--num-blocks", type=int)
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="seconds, for goodput")
    parser.add_argument("--slo-itl", type=float, default=0.1, help="p99 seconds, for goodput")
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--json", help="append one JSON line per backend here")
    parser.add_argument(
        "--timeline",
        help="in-process backend: write every measured step's phase times here (JSON); the "
        "forward then waits for the GPU each step so that its time is its own",
    )
    parser.add_argument(
        "--no-cuda-graph", action="store_true", help="serve with serving.cuda_graph off"
    )
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serving.async_scheduling (decode steps launched ahead; on by default, as in the "
        "engine's config): --no-async-scheduling serves with it off",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        help="instead of a benchmark: torch.profiler kernel tables of the prompt steps and of "
        "this many decode-only steps of the workload (the engine stepped in this thread)",
    )
    parser.add_argument("--profile-out", help="with --profile: also write the tables here")
    parser.add_argument(
        "--probe",
        action="store_true",
        help="in-process backend: per measured step, the Triton JIT compiles (or disk-cache "
        "loads), cudaMalloc calls and allocator retries; prints the eventful and slowest steps",
    )
    parser.add_argument(
        "--no-decode-bound",
        action="store_true",
        help="skip measuring the copy bandwidth for the decode bound",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks (serving.tensor_parallel), in-process backend only; launch "
        "under torchrun --nproc_per_node N (every rank builds the same seeded model, rank 0 "
        "replays the workload and prints)",
    )
    parser.add_argument("--serve-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    rank = init_tensor_parallel(args) if args.tp > 1 else 0
    if args.serve_only:
        return serve_only(args)
    vocab = {"tiny": 512, "llama3-8b": 128256}.get(args.model, 32000)
    workload = make_workload(args, vocab)
    if args.profile:
        print(json.dumps(run_profile(args, workload)))
        return 0
    summaries = []
    backends = [
        b for name in args.backend for b in (["slipstream", "hf"] if name == "both" else [name])
    ]
    runners = {
        "slipstream": run_slipstream,
        "in-process": run_in_process,
        "static": run_static,
        "hf": run_hf_continuous_batching,
    }
    for backend in backends:
        try:
            summaries.append(runners[backend](args, workload))
        except (Exception, SystemExit) as error:  # report it; the other backends still run
            print(f"backend {backend} failed: {error!r}", file=sys.stderr)
            summaries.append({"backend": backend, "failed": len(workload.prompts),
                              "error": repr(error)[:500]})  # fmt: skip
        _release_memory()
    if rank != 0:
        import torch.distributed as dist

        dist.destroy_process_group()
        return 0
    if not args.no_decode_bound and summaries:
        weights, kv_per_token = model_bytes(args.model)
        # Under tensor parallelism each rank reads its 1/tp of the weights and KV cache at its
        # own bandwidth: the bound scales with the ranks (the all-reduces are left out).
        bandwidth = copy_bandwidth(args.device) * args.tp
        for summary in (s for s in summaries if "error" not in s):
            # The run's concurrency: the mean decode batch when the timeline has it, else all
            # requests at once (up to max_num_seqs), as with --rate inf.
            decode = summary.get("timeline", {}).get("decode_only", {})
            batch = decode.get("mean_sequences") or min(len(workload.prompts), args.max_num_seqs)
            bound = decode_bound(
                workload, summary["output_tokens_per_s"], batch, weights, kv_per_token, bandwidth
            )
            if decode.get("wall_ms_per_step"):  # the decode steps alone against the bound
                bound["decode_step_fraction"] = round(
                    bound["step_ms_bound"] / decode["wall_ms_per_step"], 3
                )
            summary["decode_bound"] = bound
    for summary in summaries:
        print(json.dumps(summary))
        if args.json:
            with open(args.json, "a") as handle:
                handle.write(json.dumps({**summary, "argv": sys.argv[1:]}) + "\n")
    header = f"{'backend':<20}{'tok/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>10}{'ITL p99':>10}"
    print(header)

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.1f}ms"

    for s in summaries:
        if "error" in s:
            print(f"{s['backend']:<20} failed: {s['error'][:120]}")
            continue
        print(f"{s['backend']:<20}{s['output_tokens_per_s']:>10}{ms(s['ttft_p50_s']):>10}"
              f"{ms(s['ttft_p99_s']):>10}{ms(s['itl_p50_s']):>10}{ms(s['itl_p99_s']):>10}")  # fmt: skip
    if args.tp > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    for s in summaries:
        if "engine" in s:
            engine = s["engine"]
            print(
                f"slipstream engine: {engine['steps']} steps, {engine['tokens_per_step']} tokens "
                f"per step, ms per step {engine['ms_per_step']}, busy "
                f"{engine['engine_busy_fraction']:.0%} of the run, {engine['preemptions']} preemptions, "
                f"prefix-cache hits {engine['prefix_cache_hit_rate']:.0%} of prompt tokens"
            )
        if "decode_bound" in s:
            bound = s["decode_bound"]
            print(
                f"{s['backend']}: {bound['fraction']:.0%} of the decode bound "
                f"({bound['tokens_per_s']} tok/s at {bound['concurrency']} requests: "
                f"{bound['weight_gb']} GB weights + {bound['kv_gb_per_step']} GB KV per step "
                f"at {bound['copy_bandwidth_gb_s']} GB/s); goodput "
                f"{s['goodput_requests_per_s']} requests/s within {s['slo']}"
            )
        if "timeline" in s:
            print(f"{s['backend']} timeline (mean ms per step): {json.dumps(s['timeline'])}")
        for line in s.get("probe", []):
            print(f"{s['backend']} probe: {line}")
    return 0 if all(s["failed"] == 0 for s in summaries) else 1


if __name__ == "__main__":
    raise SystemExit(main())
