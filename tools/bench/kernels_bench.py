"""Benchmark Slipstream's kernels against the PyTorch they replace.

CPU (always): the C++ CPU Adam (``slipstream.kernels.ops.cpu_optim.adam``, the ZeRO-Offload
optimizer) against ``torch.optim.AdamW(foreach=True)`` on ``--cpu-params`` fp32 parameters
split into model-like tensors; with and without the fused bf16 copy-back.

GPU (only where CUDA/ROCm is available): the Triton multi-tensor AdamW, Lion and LAMB bandwidth
against the device's measured copy bandwidth, timed by the host clock (Python and launches
included) and by CUDA events (the kernels alone); RMSNorm, LayerNorm and cross-entropy
(forward + backward) against eager PyTorch.

    PYTHONPATH=kernels/src python tools/bench/kernels_bench.py                 # 100M params
    PYTHONPATH=kernels/src python tools/bench/kernels_bench.py --cpu-params 2e8 --json out.json

Timings are medians of ``--steps`` timed repetitions after one warm-up; a shared or noisy
machine shows up as a wide min-max spread, which is printed beside each median.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def _time(
    fn: Callable[[], Any], steps: int, sync: Callable[[], None] = lambda: None
) -> list[float]:
    fn()  # warm-up: first-touch page faults, kernel compilation, allocator growth
    sync()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


def _summary(times: list[float]) -> dict[str, float]:
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
    }


def _model_like_sizes(total: int) -> list[int]:
    # A decoder's mix: large matrices plus many small vectors (norm weights, biases).
    sizes = []
    remaining = total
    big = 4096 * 4096
    while remaining > big:
        sizes.append(big)
        sizes.extend([4096] * 4)
        remaining -= big + 4 * 4096
    if remaining > 0:
        sizes.append(remaining)
    return sizes


def bench_cpu_adam(total_params: int, steps: int) -> dict[str, Any]:
    """torch.optim.AdamW(foreach=True) vs the C++ CPU Adam on the same sizes, one after the other."""
    from slipstream.kernels.ops import cpu_optim

    sizes = _model_like_sizes(total_params)
    options = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    result: dict[str, Any] = {
        "params": sum(sizes),
        "tensors": len(sizes),
        "threads": torch.get_num_threads(),
        "omp_threads": cpu_optim.max_threads(),
        "isa": cpu_optim.supported_isas()[0],
    }

    # torch first, then freed, so peak memory holds one copy of the states.
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer = torch.optim.AdamW(params, foreach=True, **options)  # type: ignore[arg-type]
    result["torch_adamw_foreach"] = _summary(_time(optimizer.step, steps))
    del optimizer, params

    params_data = [torch.randn(n) for n in sizes]
    grads = [torch.randn(n) for n in sizes]
    grads_bf16 = [g.to(torch.bfloat16) for g in grads]
    exp_avgs = [torch.zeros(n) for n in sizes]
    exp_avg_sqs = [torch.zeros(n) for n in sizes]
    copies = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    counter = {"step": 0}

    # Out of place (CPU offload's speculative step): into a second set, with the bf16 copy.
    spares = [[torch.zeros(n) for n in sizes] for _ in range(3)]

    def ours(
        with_copies: bool, out_of_place: bool = False, bf16_grads: bool = False
    ) -> Callable[[], None]:
        def step() -> None:
            counter["step"] += 1
            cpu_optim.adam(
                params_data,
                grads_bf16 if bf16_grads else grads,
                exp_avgs,
                exp_avg_sqs,
                lr=1e-3,
                beta1=0.9,
                beta2=0.999,
                eps=1e-8,
                weight_decay=0.01,
                adam_w_mode=True,
                bias_correction=True,
                step=counter["step"],
                param_copies=copies if with_copies else None,
                out=(spares[0], spares[1], spares[2]) if out_of_place else None,
            )

        return step

    result["slipstream_cpu_adam"] = _summary(_time(ours(False), steps))
    result["slipstream_cpu_adam_bf16_copy"] = _summary(_time(ours(True), steps))
    result["slipstream_cpu_adam_out_of_place_bf16_copy"] = _summary(_time(ours(True, True), steps))
    # bf16 gradients (CPU offload when the reduction is in bf16): 2 bytes less to read each.
    result["slipstream_cpu_adam_bf16_grads_bf16_copy"] = _summary(
        _time(ours(True, False, True), steps)
    )
    result["slipstream_cpu_adam_out_of_place_bf16_grads_bf16_copy"] = _summary(
        _time(ours(True, True, True), steps)
    )
    torch_median = result["torch_adamw_foreach"]["median_s"]
    ours_median = result["slipstream_cpu_adam"]["median_s"]
    result["speedup"] = torch_median / ours_median
    # 28 bytes per element: read p, g, m, v (16) and write p, m, v (12).
    result["slipstream_gbps"] = 28 * sum(sizes) / ours_median / 1e9
    return result


def _cuda_sync() -> None:
    torch.cuda.synchronize()


def _fwd_bwd(fn: Callable[[], torch.Tensor], inputs: list[torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        out = fn()
        torch.autograd.grad(out, inputs, torch.ones_like(out))

    return run


def _event_time(fn: Callable[[], Any], steps: int) -> list[float]:
    """Seconds of GPU time per call, by CUDA events: the kernels alone, without host overhead.

    A ``torch.cuda._sleep`` at the head of the stream holds the GPU back while the host queues
    every timed call, so no event window includes the host's Python and launch work.
    """
    fn()  # warm-up
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(50_000_000)  # ~25-50 ms of spinning: longer than queuing the calls
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) / 1e3 for start, end in zip(starts, ends)]


def _copy_bandwidth(steps: int) -> tuple[float, float]:
    """Device-to-device copy bandwidth in GB/s (read + write): by the host clock, by events."""
    numel = 256 * 1024 * 1024  # 1 GiB of fp32 per buffer
    source = torch.empty(numel, device="cuda")
    target = torch.empty_like(source)
    host = _summary(_time(lambda: target.copy_(source), steps, _cuda_sync))
    events = _summary(_event_time(lambda: target.copy_(source), steps))
    return 2 * 4 * numel / host["median_s"] / 1e9, 2 * 4 * numel / events["median_s"] / 1e9


def _bandwidth_row(
    fn: Callable[[], Any], steps: int, bytes_moved: int, copy_gbps: tuple[float, float]
) -> dict[str, Any]:
    """Host-clock and CUDA-event timings of ``fn``, as GB/s and as a fraction of copy."""
    host = _summary(_time(fn, steps, _cuda_sync))
    events = _summary(_event_time(fn, steps))
    return {
        "triton": host,
        "triton_events": events,
        "triton_gbps": bytes_moved / host["median_s"] / 1e9,
        "triton_events_gbps": bytes_moved / events["median_s"] / 1e9,
        "fraction_of_copy": bytes_moved / host["median_s"] / 1e9 / copy_gbps[0],
        "events_fraction_of_copy": bytes_moved / events["median_s"] / 1e9 / copy_gbps[1],
    }


def _optimizer_tensors(
    states: int, device: str = "cuda"
) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor], list[list[torch.Tensor]]]:
    """200M model-like elements: sizes, random params and grads, ``states`` zeroed states."""
    sizes = _model_like_sizes(200_000_000)
    params = [torch.randn(n, device=device) for n in sizes]
    grads = [torch.randn(n, device=device) for n in sizes]
    return (
        sizes,
        params,
        grads,
        [[torch.zeros(n, device=device) for n in sizes] for _ in range(states)],
    )


def _adamw(steps: int, copy_gbps: tuple[float, float]) -> dict[str, Any]:
    from slipstream.kernels.ops.adam.triton import adam as triton_adam

    sizes, params, grads, (exp_avgs, exp_avg_sqs) = _optimizer_tensors(2)

    def adam_step() -> None:
        triton_adam(params, grads, exp_avgs, exp_avg_sqs, lr=1e-3, beta1=0.9, beta2=0.999,
                    eps=1e-8, weight_decay=0.01, adam_w_mode=True, bias_correction=True, step=1)  # fmt: skip

    # 28 bytes/element: read p, g, m, v (16) and write p, m, v (12).
    result = {"params": sum(sizes), **_bandwidth_row(adam_step, steps, 28 * sum(sizes), copy_gbps)}
    torch_params = [torch.nn.Parameter(p.clone()) for p in params]
    for param, grad in zip(torch_params, grads):
        param.grad = grad
    fused = torch.optim.AdamW(torch_params, lr=1e-3, fused=True)
    result["torch_fused"] = _summary(_time(fused.step, steps, _cuda_sync))
    return result


def _lion(steps: int, copy_gbps: tuple[float, float]) -> dict[str, Any]:
    from slipstream.kernels.ops.lion.triton import lion as triton_lion

    sizes, params, grads, (exp_avgs,) = _optimizer_tensors(1)

    def lion_step() -> None:
        triton_lion(params, grads, exp_avgs, lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.01)

    # 20 bytes/element: read p, g, m (12) and write p, m (8).
    return {"params": sum(sizes), **_bandwidth_row(lion_step, steps, 20 * sum(sizes), copy_gbps)}


def _lamb(steps: int, copy_gbps: tuple[float, float]) -> dict[str, Any]:
    from slipstream.kernels.ops.lamb.triton import lamb as triton_lamb

    sizes, params, grads, (exp_avgs, exp_avg_sqs) = _optimizer_tensors(2)

    def lamb_step() -> None:
        triton_lamb(params, grads, exp_avgs, exp_avg_sqs, lr=1e-3, beta1=0.9, beta2=0.999,
                    eps=1e-6, weight_decay=0.01, bias_correction=True, step=1)  # fmt: skip

    # 40 bytes/element over the two passes: the moments pass reads p, g, m, v (16) and writes
    # m, v (8); the update pass reads p, m, v (12) and writes p (4).
    return {"params": sum(sizes), **_bandwidth_row(lamb_step, steps, 40 * sum(sizes), copy_gbps)}


def _vs_eager(steps: int, triton_fn: Callable[[], None], eager_fn: Callable[[], None]) -> dict:
    """Host clock (synchronised per call: launch overhead included) and GPU time by events."""
    return {
        "triton": _summary(_time(triton_fn, steps, _cuda_sync)),
        "eager": _summary(_time(eager_fn, steps, _cuda_sync)),
        "triton_events": _summary(_event_time(triton_fn, steps)),
        "eager_events": _summary(_event_time(eager_fn, steps)),
    }


def _norms_at(steps: int, tokens: int, hidden: int) -> dict[str, Any]:
    import torch.nn.functional as F

    from slipstream.kernels.ops.layer_norm.triton import layer_norm as triton_ln
    from slipstream.kernels.ops.rms_norm.triton import rms_norm as triton_rms

    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.ones(hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bias = torch.zeros(hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    suffix = "" if (tokens, hidden) == (16384, 4096) else f"@{tokens}x{hidden}"
    return {
        "rms_norm" + suffix: _vs_eager(
            steps,
            _fwd_bwd(lambda: triton_rms(x, weight), [x, weight]),
            _fwd_bwd(lambda: F.rms_norm(x, (hidden,), weight), [x, weight]),
        ),
        "layer_norm" + suffix: _vs_eager(
            steps,
            _fwd_bwd(lambda: triton_ln(x, weight, bias), [x, weight, bias]),
            _fwd_bwd(lambda: F.layer_norm(x, (hidden,), weight, bias), [x, weight, bias]),
        ),
    }


def _norms(steps: int) -> dict[str, Any]:
    # The benchmark shape, then the 1.3b and 7b models' (8192 tokens of hidden 2048 and 4096).
    result: dict[str, Any] = {}
    for tokens, hidden in ((16384, 4096), (8192, 2048), (8192, 4096)):
        result.update(_norms_at(steps, tokens, hidden))
    return result


def _cross_entropy(steps: int) -> dict[str, Any]:
    import torch.nn.functional as F

    from slipstream.kernels.ops.cross_entropy.triton import cross_entropy as triton_ce

    tokens, vocab = 8192, 128256
    logits = torch.randn(tokens, vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,), device="cuda")
    return {
        "shape": [tokens, vocab],
        **_vs_eager(
            steps,
            _fwd_bwd(lambda: triton_ce(logits, labels), [logits]),
            _fwd_bwd(lambda: F.cross_entropy(logits.float(), labels), [logits]),
        ),
    }


def bench_gpu(steps: int) -> dict[str, Any]:
    """Triton AdamW/Lion/LAMB bandwidth vs copy bandwidth; norms and cross-entropy vs eager."""
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0)}
    copy_gbps = _copy_bandwidth(steps)
    result["copy_gbps"], result["copy_events_gbps"] = copy_gbps
    torch.cuda.empty_cache()
    for name, bench in (("adamw", _adamw), ("lion", _lion), ("lamb", _lamb)):
        result[name] = bench(steps, copy_gbps)
        result[name]["copy_gbps"] = copy_gbps[0]
        torch.cuda.empty_cache()
    result.update(_norms(steps))
    torch.cuda.empty_cache()
    result["cross_entropy"] = _cross_entropy(steps)
    return result


def main(argv: list[str] | None = None) -> int:
    """Run the CPU benchmark (and the GPU one where a GPU exists); print and optionally save."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-params", type=float, default=1e8, help="fp32 params (default 1e8)")
    parser.add_argument("--steps", type=int, default=5, help="timed repetitions")
    parser.add_argument("--skip-cpu", action="store_true")
    parser.add_argument("--skip-gpu", action="store_true")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
    }
    if not args.skip_cpu:
        cpu = bench_cpu_adam(int(args.cpu_params), args.steps)
        results["cpu_adam"] = cpu
        torch_s, ours_s = cpu["torch_adamw_foreach"], cpu["slipstream_cpu_adam"]
        copy_s = cpu["slipstream_cpu_adam_bf16_copy"]
        out_s = cpu["slipstream_cpu_adam_out_of_place_bf16_copy"]
        half_s = cpu["slipstream_cpu_adam_bf16_grads_bf16_copy"]
        half_out_s = cpu["slipstream_cpu_adam_out_of_place_bf16_grads_bf16_copy"]
        print(f"CPU Adam, {cpu['params'] / 1e6:.0f}M fp32 params in {cpu['tensors']} tensors, "
              f"{cpu['omp_threads']} threads, ISA {cpu['isa']}:")  # fmt: skip
        for name, row in (("torch AdamW(foreach=True)", torch_s), ("slipstream cpp", ours_s),
                          ("slipstream cpp + bf16 copy", copy_s),
                          ("  same, out of place", out_s),
                          ("slipstream cpp, bf16 grads + copy", half_s),
                          ("  same, out of place", half_out_s)):  # fmt: skip
            print(f"  {name:34s} {row['median_s'] * 1e3:9.1f} ms/step "
                  f"(min {row['min_s'] * 1e3:.1f}, max {row['max_s'] * 1e3:.1f})")  # fmt: skip
        print(f"  speedup {cpu['speedup']:.2f}x; {cpu['slipstream_gbps']:.1f} GB/s effective")
    if not args.skip_gpu and torch.cuda.is_available():
        gpu = bench_gpu(args.steps)
        results["gpu"] = gpu
        print(f"GPU {gpu['device']}: copy {gpu['copy_gbps']:.0f} GB/s (host clock), "
              f"{gpu['copy_events_gbps']:.0f} GB/s (CUDA events); 200M fp32 params:")  # fmt: skip
        for op, name in (("adamw", "AdamW"), ("lion", "Lion"), ("lamb", "LAMB (2 passes)")):
            row = gpu[op]
            print(f"  Triton {name:16s} host {row['triton']['median_s'] * 1e3:6.2f} ms "
                  f"{row['triton_gbps']:5.0f} GB/s {row['fraction_of_copy']:4.0%} | events "
                  f"{row['triton_events']['median_s'] * 1e3:6.2f} ms "
                  f"{row['triton_events_gbps']:5.0f} GB/s {row['events_fraction_of_copy']:4.0%} "
                  "of copy")  # fmt: skip
        print(
            f"  torch AdamW(fused=True) host {gpu['adamw']['torch_fused']['median_s'] * 1e3:6.2f} ms"
        )
        print("  fwd+bwd: host clock (synchronised per call) | GPU time by events")
        for op in [k for k in gpu if k.startswith(("rms_norm", "layer_norm", "cross_entropy"))]:
            row = gpu[op]
            print(f"  {op:22s} triton {row['triton']['median_s'] * 1e3:6.3f} ms  "
                  f"eager {row['eager']['median_s'] * 1e3:6.3f} ms | triton "
                  f"{row['triton_events']['median_s'] * 1e3:6.3f} ms  eager "
                  f"{row['eager_events']['median_s'] * 1e3:6.3f} ms")  # fmt: skip
    elif not args.skip_gpu:
        print("no CUDA/ROCm GPU here: GPU benchmarks skipped")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
