"""Adam with host-resident states stepped on the GPU, beside the C++ CPU Adam: what each costs.

CPU optimizer offload keeps the fp32 masters and Adam's two moments in host memory, and the
step is bound by the host's memory bandwidth: the C++ Adam moves about 32 bytes per element
(reads master, m, v and the bf16 gradient; writes master, m, v; the gradient's landing and the
master's upload add 2 + 4). Another way to step the same host-resident states: stream each
chunk of master, m and v to the GPU, step it there (the gradient is already on the GPU), and
stream it back. That moves 24 bytes per element through host memory (12 read by the
host-to-device copy, 12 written by the device-to-host copy), all of it by the GPU's copy
engines, none by the CPU cores; PCIe carries 12 bytes per element each way.

This tool measures both on one host, with ``--processes`` ranks at once (one GPU each), as
training runs them. Per rank it allocates ``--params`` elements of pinned fp32 master, m, v
(and, out of place, a second set as the speculative step does) and a bf16 gradient on the
GPU, then times ``--steps`` steps of:

- ``stream``: chunks of ``--chunk`` elements, host-to-device copies on one stream, the Adam
  (``torch._fused_adamw_``) on another, device-to-host copies on a third, ``--slots`` chunk
  buffers in flight;
- ``cpu``: the C++ CPU Adam on the same host tensors (bf16 gradient in pinned host memory),
  ``--threads`` OpenMP threads, out of place with ``--out-of-place`` (the speculative step);
- ``stream-hostgrad``: ``stream`` with the bf16 gradient read from pinned host memory
  (where CPU offload lands it today) instead of the GPU: 2 more bytes per element;
- ``hybrid``: both at once, the CPU on the first ``--cpu-share`` of the elements (on a
  thread) and the GPU streaming the rest: whether the copy engines' traffic adds to the
  cores' or only shares the same memory bandwidth;
- ``stream+gemm`` (after ``stream``): the streamed step beside bf16 matmuls on another
  stream that alone take about as long (backward's stand-in): whether the two overlap.

    PYTHONPATH=kernels/src python3 tools/bench/stream_adam_bench.py --processes 2 --params 5e8 \\
        --modes stream,cpu,hybrid --threads 16

``cpu`` takes modifiers after slashes that add, one at a time, what training runs beside the
C++ step, to tell apart why the step is slower there than here (``cpu/j16/dma/busy2``):

- ``jN``: the step as N calls over consecutive slices (training steps one gradient bucket at a
  time), from a worker thread (training's ``slipstream-cpu-step``);
- ``dma`` (with ``jN``, on a GPU): training's copy-engine traffic beside it: slice k+1's bf16
  gradient lands (device-to-host into the gradient the next call reads) while slice k steps,
  and each stepped slice's fp32 master is uploaded (host-to-device) as its call returns;
- ``busyK``: K processes per rank that spin on a core (the training process's other busy
  threads: the Python thread driving the GPU, NCCL's proxy thread);
- ``gil``: a Python thread that holds the GIL as a forward does (the worker needs it between
  calls);
- ``tN`` / ``dyn``: N OpenMP threads for this variant / the dynamic schedule;
- ``siUS``: ``sys.setswitchinterval`` of US microseconds for this variant (Python's default is
  5000): how long a thread that wants the GIL waits before the holder is asked to drop it.

Each ``cpu`` row also reports, from the C++ step's own clock (``cpu_optim.last_step_stats``),
the time inside its OpenMP regions per step and how late the last thread ended against the
mean (``straggle``: 1.0 when the threads end together).

``--huge-pages`` allocates the host tensors in memory advised for transparent huge pages and
registers it (``cudaHostRegister``) instead of using the pinned allocator, which maps 4 KiB
pages: whether the TLB matters to the memory-bound step.

Prints one JSON line per mode with the median step over ranks, host bytes counted per second
(stream 24 B, stream-hostgrad 26 B, cpu 32 B counting the landing and upload, hybrid in
proportion) and, for the streamed elements, PCIe bytes per second each way. Without CUDA,
``stream`` runs its copies on the CPU (a smoke test of the tool, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import threading
import time
from typing import Any


def _stream_step(
    host: list[Any], spare: list[Any] | None, grad: Any, bufs: list[list[Any]], step: int,
    chunk: int, streams: list[Any] | None, device: Any,
) -> None:  # fmt: skip
    import torch

    numel = host[0].numel()
    slots = len(bufs)
    out = spare if spare is not None else host
    h2d, calc, d2h = streams if streams is not None else (None, None, None)
    free: list[Any] = [None] * slots  # event: the slot's last device-to-host copy is done
    step_t = torch.tensor(float(step), device=device)
    for index, start in enumerate(range(0, numel, chunk)):
        n = min(chunk, numel - start)
        slot = index % slots
        p, m, v, g, landed = (b[:n] for b in bufs[slot])
        ctx = torch.cuda.stream(h2d) if h2d is not None else _null()
        with ctx:
            if free[slot] is not None:
                h2d.wait_event(free[slot])
            for dst, src in zip((p, m, v), host):
                dst.copy_(src[start : start + n], non_blocking=True)
            if grad.device.type == "cpu":  # the gradient landed in host memory: upload it
                landed.copy_(grad[start : start + n], non_blocking=True)
            loaded = torch.cuda.Event() if h2d is not None else None
            if loaded is not None:
                loaded.record(h2d)
        ctx = torch.cuda.stream(calc) if calc is not None else _null()
        with ctx:
            if loaded is not None:
                calc.wait_event(loaded)
            # bf16 -> fp32 on the device
            g.copy_(landed if grad.device.type == "cpu" else grad[start : start + n])
            step_t.fill_(step)  # the step being taken (torch counts it up before the call)
            torch._fused_adamw_(
                [p], [g], [m], [v], [], [step_t], lr=1e-3, beta1=0.9, beta2=0.95,
                weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False,
            )  # fmt: skip
            stepped = torch.cuda.Event() if calc is not None else None
            if stepped is not None:
                stepped.record(calc)
        ctx = torch.cuda.stream(d2h) if d2h is not None else _null()
        with ctx:
            if stepped is not None:
                d2h.wait_event(stepped)
            for dst, src in zip(out, (p, m, v)):
                dst[start : start + n].copy_(src, non_blocking=True)
            if d2h is not None:
                free[slot] = torch.cuda.Event()
                free[slot].record(d2h)
    if d2h is not None:
        torch.cuda.synchronize(device)


_HUGE = 2 << 20
_keep: list[Any] = []  # the mappings (and registrations) live as long as the process


def _huge_page_tensor(numel: int, dtype: Any, pin: bool) -> Any:
    """A host tensor in anonymous memory advised for transparent huge pages (2 MiB-aligned),
    page-locked with ``cudaHostRegister`` when ``pin``."""
    import mmap

    import torch

    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    mapping = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = (-raw.data_ptr()) % _HUGE
    tensor = raw[offset : offset + nbytes].view(dtype)
    tensor.fill_(0)  # fault the pages in (as huge pages where the kernel can) before pinning
    if pin:
        code = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
        if int(code) != 0:
            raise RuntimeError(f"cudaHostRegister failed with {code}")
    _keep.append(mapping)
    return tensor


def _with_gemms(
    args: argparse.Namespace, barrier: Any, stream_s: float, run_stream: Any
) -> tuple[list[float], list[float]]:
    """Backward's stand-in: bf16 8192^3 matmuls on a stream of their own, as many as take
    about ``stream_s`` alone. Returns the times of the matmuls alone and of the matmuls with
    a streamed step issued beside them (both to completion)."""
    import torch

    side = torch.cuda.Stream()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def gemms(count: int) -> None:
        with torch.cuda.stream(side):
            for _ in range(count):
                torch.mm(a, b)

    gemms(3)
    torch.cuda.synchronize()
    start = time.perf_counter()
    gemms(20)
    torch.cuda.synchronize()
    count = max(1, round(stream_s / ((time.perf_counter() - start) / 20)))
    alone, together = [], []
    for step in range(1, args.steps + 2):
        barrier.wait()
        start = time.perf_counter()
        gemms(count)
        torch.cuda.synchronize()
        alone.append(time.perf_counter() - start)
        barrier.wait()
        start = time.perf_counter()
        gemms(count)
        run_stream(step)  # synchronises the device (the matmuls too) before it returns
        together.append(time.perf_counter() - start)
    return alone[1:], together[1:]


def _anon_huge_gib() -> float:
    """This process's memory in transparent huge pages (GiB), from /proc/self/smaps_rollup."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return round(int(line.split()[1]) / 2**20, 2)
    except OSError:
        pass
    return -1.0


def _is_float(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


def _cpu_modifiers(mode: str) -> dict[str, Any]:
    """``cpu/j16/dma/busy2/gil/t15/dyn`` -> its settings (see the module docstring)."""
    mods: dict[str, Any] = {"jobs": 1, "dma": False, "busy": 0, "gil": False, "threads": 0,
                            "dyn": False, "switch": 0.0}  # fmt: skip
    for part in mode.split("/")[1:]:
        if part == "dma":
            mods["dma"] = True
        elif part == "gil":
            mods["gil"] = True
        elif part == "dyn":
            mods["dyn"] = True
        elif part.startswith("si") and _is_float(part[2:]):
            mods["switch"] = float(part[2:]) * 1e-6
        elif part.startswith("busy") and part[4:].isdigit():
            mods["busy"] = int(part[4:])
        elif part.startswith("j") and part[1:].isdigit() and int(part[1:]) > 0:
            mods["jobs"] = int(part[1:])
        elif part.startswith("t") and part[1:].isdigit() and int(part[1:]) > 0:
            mods["threads"] = int(part[1:])
        else:
            raise SystemExit(
                f"unknown cpu modifier {part!r} in {mode!r}: expected jN, dma, busyK, gil, tN, dyn, siUS"
            )
    return mods


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _worker(rank: int, args: argparse.Namespace, barrier: Any, results: Any) -> None:
    try:
        _measure(rank, args, barrier, results)
    except BaseException as exc:  # reported by the parent; the others leave the barrier
        barrier.abort()
        results.put((rank, f"{type(exc).__name__}: {exc}", None))
        raise


def _measure(rank: int, args: argparse.Namespace, barrier: Any, results: Any) -> None:
    import torch

    from slipstream.kernels.ops import cpu_optim

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank % max(1, torch.cuda.device_count())) if cuda else None
    if cuda:
        torch.cuda.set_device(device)
    numel = int(args.params)
    pin = cuda

    def host(value: float, dtype: Any = torch.float32) -> Any:
        if not args.huge_pages:
            return torch.full((numel,), value, dtype=dtype, pin_memory=pin)
        tensor = _huge_page_tensor(numel, dtype, pin)
        return tensor.fill_(value)

    params, exp_avgs, exp_avg_sqs = host(0.5), host(0.01), host(0.001)
    states = [params, exp_avgs, exp_avg_sqs]
    spare = [host(0.0), host(0.0), host(0.0)] if args.out_of_place else None
    dev = device if cuda else torch.device("cpu")
    modes = args.modes.split(",")
    need_stream = any(m in ("stream", "hybrid") for m in modes)
    need_cpu = any(m.split("/")[0] in ("cpu", "hybrid", "stream-hostgrad") for m in modes)
    grad = torch.full((numel,), 0.1, dtype=torch.bfloat16, device=dev) if need_stream else None
    bufs = [
        [torch.empty(args.chunk, device=dev) for _ in range(4)]
        + [torch.empty(args.chunk, device=dev, dtype=torch.bfloat16)]
        for _ in range(args.slots)
    ]
    streams = [torch.cuda.Stream() for _ in range(3)] if cuda else None
    host_grads = host(0.1, torch.bfloat16) if need_cpu else None
    cpu_optim.set_num_threads(args.threads)

    def cut(tensors: list[Any] | None, lo: int, hi: int) -> list[Any] | None:
        return None if tensors is None else [t[lo:hi] for t in tensors]

    def run_stream(step: int, lo: int, hi: int, source: Any) -> None:
        _stream_step(
            cut(states, lo, hi), cut(spare, lo, hi), source[lo:hi], bufs, step, args.chunk,
            streams, dev,
        )  # fmt: skip

    schedule_of = ["static"]

    def run_cpu(step: int, lo: int, hi: int) -> None:
        p, m, v = cut(states, lo, hi)
        extra: dict[str, Any] = {}
        if spare is not None:
            extra = {"out": tuple([t] for t in cut(spare, lo, hi))}
        cpu_optim.adam(
            [p], [host_grads[lo:hi]], [m], [v], lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8,
            weight_decay=0.1, adam_w_mode=True, bias_correction=True, step=step,
            schedule=schedule_of[0], **extra,
        )  # fmt: skip

    kernel: list[float] = [0.0, 0.0, 0.0]  # this step: region wall, sum of max end, of mean end

    def run_cpu_stats(step: int, lo: int, hi: int) -> None:
        run_cpu(step, lo, hi)
        stats = cpu_optim.last_step_stats()
        if stats is not None:
            kernel[0] += stats["wall_s"]
            kernel[1] += stats["end_max_s"]
            kernel[2] += stats["end_mean_s"]

    dma_bufs: dict[str, Any] = {}

    def run_cpu_variant(step: int, mods: dict[str, Any]) -> None:
        # The step as ``jobs`` calls on a worker thread; with ``dma``, slice k+1's gradient
        # lands while slice k steps and each stepped slice's master is uploaded.
        jobs = mods["jobs"]
        bounds = [numel * k // jobs for k in range(jobs + 1)]
        dma = mods["dma"] and cuda
        if dma and not dma_bufs:
            dma_bufs["grad"] = torch.full((numel,), 0.1, dtype=torch.bfloat16, device=dev)
            dma_bufs["master"] = torch.empty(numel, device=dev)
            dma_bufs["land"], dma_bufs["up"] = torch.cuda.Stream(), torch.cuda.Stream()
        written = spare if spare is not None else states

        def land(k: int) -> Any:
            lo, hi = bounds[k], bounds[k + 1]
            with torch.cuda.stream(dma_bufs["land"]):
                host_grads[lo:hi].copy_(dma_bufs["grad"][lo:hi], non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            return event

        def body() -> None:
            if dma:
                torch.cuda.set_device(dev)  # a new thread starts on device 0
            landed = land(0) if dma else None
            for k in range(jobs):
                following = land(k + 1) if dma and k + 1 < jobs else None
                if landed is not None:
                    landed.synchronize()
                lo, hi = bounds[k], bounds[k + 1]
                run_cpu_stats(step, lo, hi)
                if dma:
                    with torch.cuda.stream(dma_bufs["up"]):
                        dma_bufs["master"][lo:hi].copy_(written[0][lo:hi], non_blocking=True)
                landed = following
            if dma:
                dma_bufs["up"].synchronize()

        worker = threading.Thread(target=body, name="slipstream-cpu-step")
        worker.start()
        worker.join()

    def run_hybrid(step: int) -> None:
        # The C++ step releases the GIL: it runs on a thread while this one issues the copies.
        split = int(numel * args.cpu_share)
        worker = threading.Thread(target=run_cpu, args=(step, 0, split))
        worker.start()
        run_stream(step, split, numel, grad)
        worker.join()

    out: dict[str, list[float]] = {}
    for mode in modes:
        if mode.startswith("cpu/"):
            mods = _cpu_modifiers(mode)
            cpu_optim.set_num_threads(mods["threads"] or args.threads)
            schedule_of[0] = "dynamic" if mods["dyn"] else "static"
            hogs = [
                subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(mods["busy"])
            ]
            stop = threading.Event()
            holder = None
            if mods["switch"]:
                sys.setswitchinterval(mods["switch"])
            if mods["gil"]:

                def hold_gil(stop: threading.Event = stop) -> None:
                    count = 0
                    while not stop.is_set():
                        for _ in range(1000):
                            count += 1

                holder = threading.Thread(target=hold_gil, daemon=True)
                holder.start()
            times, walls, straggle = [], [], []
            try:
                for step in range(1, args.steps + 2):
                    barrier.wait()
                    kernel[:] = [0.0, 0.0, 0.0]
                    start = time.perf_counter()
                    run_cpu_variant(step, mods)
                    times.append(time.perf_counter() - start)
                    walls.append(kernel[0])
                    straggle.append(kernel[1] / max(kernel[2], 1e-9))
            finally:
                stop.set()
                for hog in hogs:
                    hog.kill()
                    hog.wait()
                if holder is not None:
                    holder.join()
                cpu_optim.set_num_threads(args.threads)
                schedule_of[0] = "static"
                sys.setswitchinterval(0.005)  # Python's default
            out[mode] = times[1:]
            out[mode + ":kernel"] = walls[1:]
            out[mode + ":straggle"] = straggle[1:]
            continue
        if mode not in ("stream", "stream-hostgrad", "cpu", "hybrid", "stream+gemm"):
            raise SystemExit(
                f"unknown mode {mode!r}: expected stream, stream-hostgrad, cpu, hybrid or "
                "stream+gemm"
            )
        if mode == "stream+gemm":
            if "stream" not in out or not cuda:
                raise SystemExit("stream+gemm needs CUDA and the stream mode measured before it")
            out["gemm-alone"], out[mode] = _with_gemms(
                args,
                barrier,
                statistics.median(out["stream"]),
                lambda s: run_stream(s, 0, numel, grad),
            )
            continue
        times = []
        for step in range(1, args.steps + 2):  # the first is a warm-up
            barrier.wait()
            start = time.perf_counter()
            if mode == "stream":
                run_stream(step, 0, numel, grad)
            elif mode == "stream-hostgrad":
                run_stream(step, 0, numel, host_grads)
            elif mode == "cpu":
                kernel[:] = [0.0, 0.0, 0.0]
                run_cpu_stats(step, 0, numel)
            else:
                run_hybrid(step)
            times.append(time.perf_counter() - start)
            if mode == "cpu":
                out.setdefault("cpu:kernel", []).append(kernel[0])
                out.setdefault("cpu:straggle", []).append(kernel[1] / max(kernel[2], 1e-9))
        out[mode] = times[1:]
    results.put((rank, out, _anon_huge_gib()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, default=2, help="ranks on the host (2)")
    parser.add_argument("--params", type=float, default=5e8, help="elements per rank (5e8)")
    parser.add_argument(
        "--modes", default="stream,cpu,hybrid", help="stream,stream-hostgrad,cpu,hybrid"
    )
    parser.add_argument(
        "--cpu-share", type=float, default=0.3, help="hybrid: elements the CPU steps (0.3)"
    )
    parser.add_argument("--threads", type=int, default=16, help="CPU threads per rank (16)")
    parser.add_argument("--chunk", type=int, default=1 << 24, help="elements per chunk (16 Mi)")
    parser.add_argument("--slots", type=int, default=3, help="chunk buffers in flight (3)")
    parser.add_argument("--out-of-place", action="store_true", help="write a second set")
    parser.add_argument(
        "--huge-pages",
        action="store_true",
        help="host tensors in memory advised for transparent huge pages (then pinned with "
        "cudaHostRegister) instead of the pinned allocator's",
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps (3, after 1 warm-up)")
    args = parser.parse_args()
    context = mp.get_context("spawn")
    barrier = context.Barrier(args.processes)
    results = context.Queue()
    workers = [
        context.Process(target=_worker, args=(rank, args, barrier, results))
        for rank in range(args.processes)
    ]
    for worker in workers:
        worker.start()
    gathered, huge = {}, {}
    errors = []
    for _ in workers:
        rank, times, huge_gib = results.get()
        if isinstance(times, str):
            errors.append(f"rank {rank}: {times}")
            continue
        gathered[rank], huge[rank] = times, huge_gib
    for worker in workers:
        worker.join()
    if errors:
        raise SystemExit("; ".join(errors))
    numel = int(args.params)
    share = args.cpu_share
    per_element = {
        "stream": 24,
        "stream-hostgrad": 26,
        "cpu": 32,
        "hybrid": 32 * share + 24 * (1 - share),
    }
    for mode in args.modes.split(","):
        if mode.startswith("cpu/"):
            medians = [statistics.median(gathered[r][mode]) for r in sorted(gathered)]
            median = statistics.median(medians)
            kernel = statistics.median(
                statistics.median(gathered[r][mode + ":kernel"]) for r in sorted(gathered)
            )
            straggle = statistics.median(
                statistics.median(gathered[r][mode + ":straggle"]) for r in sorted(gathered)
            )
            print(json.dumps({
                "mode": mode, "params": numel, "out_of_place": args.out_of_place,
                "median_step_ms": round(median * 1e3, 1),
                "rank_medians_ms": [round(t * 1e3, 1) for t in medians],
                "in_kernel_ms": round(kernel * 1e3, 1), "straggle": round(straggle, 3),
                "cores_gb_per_s": round(args.processes * numel * 26 / median / 1e9, 1),
            }), flush=True)  # fmt: skip
            continue
        if mode == "stream+gemm":
            alone = statistics.median(
                statistics.median(gathered[r]["gemm-alone"]) for r in sorted(gathered)
            )
            both = statistics.median(statistics.median(gathered[r][mode]) for r in sorted(gathered))
            stream = statistics.median(
                statistics.median(gathered[r]["stream"]) for r in sorted(gathered)
            )
            print(json.dumps({
                "mode": mode, "gemm_alone_ms": round(alone * 1e3, 1),
                "stream_alone_ms": round(stream * 1e3, 1),
                "together_ms": round(both * 1e3, 1),
                "overlap": "perfect at together = max(alone), none at their sum",
            }), flush=True)  # fmt: skip
            continue
        medians = [statistics.median(gathered[r][mode]) for r in sorted(gathered)]
        median = statistics.median(medians)
        row: dict[str, Any] = {
            "mode": mode, "processes": args.processes, "params": numel,
            "out_of_place": args.out_of_place, "huge_pages": args.huge_pages,
            "median_step_ms": round(median * 1e3, 1),
            "rank_medians_ms": [round(t * 1e3, 1) for t in medians],
            "anon_huge_gib": [huge[r] for r in sorted(huge)],
            "host_gb_per_s": round(args.processes * numel * per_element[mode] / median / 1e9, 1),
        }  # fmt: skip
        if mode != "cpu":
            streamed = numel * (1 - share if mode == "hybrid" else 1)
            row["pcie_gb_per_s_each_way_per_rank"] = round(streamed * 12 / median / 1e9, 1)
            row["slots"] = args.slots
            row["chunk"] = args.chunk
        else:
            row["threads"] = args.threads
            kernel = [statistics.median(gathered[r]["cpu:kernel"][1:]) for r in sorted(gathered)]
            straggle = [
                statistics.median(gathered[r]["cpu:straggle"][1:]) for r in sorted(gathered)
            ]
            row["in_kernel_ms"] = round(statistics.median(kernel) * 1e3, 1)
            row["straggle"] = round(statistics.median(straggle), 3)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
