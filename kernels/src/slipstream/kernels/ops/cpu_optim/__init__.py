"""CPU optimizer steps in C++ (Adam/AdamW, Adagrad, Lion): the ``cpp`` backends on ``cpu``.

The extension (``cpu_optim.cpp``) is built by :mod:`slipstream.kernels.build_ops` into a
cache; these wrappers match the reference ops' signatures. Params and states must be fp32 and
contiguous on the CPU; grads fp32, bf16 or fp16; ``param_copies`` (bf16, fp16 or fp32) receive
the updated params in the same pass. ``SLIPSTREAM_CPU_ISA=avx512|avx2|generic`` forces a
vector path (tests; comparing paths); the default is the best the CPU supports.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from types import ModuleType

import torch

from slipstream.kernels.build_ops import load_cpu_optimizer

ISA_ENV = "SLIPSTREAM_CPU_ISA"
# How the OpenMP threads share a step's chunks (each step's ``schedule`` argument): "static"
# (default: one contiguous share each) or "dynamic" (one 16 Ki-element chunk at a time, so that
# a descheduled thread does not hold the step up when other threads of the process share the
# cores). Callers take it from their typed settings (offload_optimizer.cpu_schedule).
SCHEDULES = ("static", "dynamic")
# How the Adam step writes its results (``adam(stores=...)``; the same values either way):
# "stream_out" (non-temporal full lines out of place, ordinary stores in place), "mixed" (the
# earlier kernel) or "stream" (non-temporal everywhere). (Ordinary stores out of place were
# 20-30% slower on every host measured and were removed: docs/offload.md.)
STORES = ("stream_out", "mixed", "stream")
# Widths of the streaming step's non-temporal stores (``adam(stores="stream", store_bytes=...)``):
# 0 is the widest the vector path has (64 bytes, a whole cache line, with AVX-512).
STORE_BYTES = (0, 16, 32, 64)
PROBES = ("read", "copy", "write")


def _extension() -> ModuleType:
    # Loaded (or built into the cache, see build_ops) on the first step, not on import: the
    # registry imports this module to check the backend, and `slipstream report` must not
    # start a compiler.
    return load_cpu_optimizer()


def _isa() -> str:
    return os.environ.get(ISA_ENV, "auto").strip() or "auto"


def _schedule(value: str) -> str:
    if value not in SCHEDULES:
        raise ValueError(f"schedule={value!r} is not one of {', '.join(SCHEDULES)}")
    return value


def _copies(param_copies: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
    return [] if param_copies is None else list(param_copies)


def supported_isas() -> list[str]:
    """The vector paths this CPU can run, best first (``"generic"`` is always last)."""
    return list(_extension().supported_isas())


def max_threads() -> int:
    """OpenMP threads one optimizer step called from this thread uses.

    :func:`set_num_threads` when it was called (from any thread), else OpenMP's default
    (``OMP_NUM_THREADS``, or the core count).
    """
    return int(_extension().max_threads())


def set_num_threads(threads: int) -> None:
    """Set the OpenMP threads later steps use (this extension's OpenMP runtime, not torch's).

    Process-wide: it holds for steps called from any thread (OpenMP's own
    ``omp_set_num_threads`` holds only for the thread that calls it).
    """
    if threads < 1:
        raise ValueError(f"set_num_threads needs a positive thread count, got {threads}")
    _extension().set_num_threads(int(threads))


def last_step_stats() -> dict[str, float] | None:
    """How the last :func:`adam` called from this thread spent its time (benchmarks), or None
    before the first: ``wall_s`` (its OpenMP region), ``threads``, and over the threads the
    mean and latest ``start_s``/``end_s`` of each one's share, counted from the region's
    start. With the static schedule the shares are equal, so ``end_max_s`` far above
    ``end_mean_s`` means a thread was descheduled or starved of memory bandwidth."""
    raw = list(_extension().last_step_stats())
    if not raw:
        return None
    starts, ends = raw[1::2], raw[2::2]
    count = max(1, len(starts))
    return {
        "wall_s": raw[0],
        "threads": float(len(starts)),
        "start_mean_s": sum(starts) / count,
        "start_max_s": max(starts, default=0.0),
        "end_mean_s": sum(ends) / count,
        "end_max_s": max(ends, default=0.0),
    }


def adam(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adam_w_mode: bool,
    bias_correction: bool,
    step: int,
    param_copies: Sequence[torch.Tensor] | None = None,
    grad_scale: float = 1.0,
    out: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor], Sequence[torch.Tensor]]
    | None = None,
    schedule: str = "static",
    stores: str = "mixed",
    store_bytes: int = 0,
    prefetch: int = 0,
) -> None:
    """C++ Adam/AdamW with the semantics of :func:`slipstream.kernels.ops.adam.reference.adam`.

    ``grad_scale`` multiplies every gradient as it is read (loss unscaling and clipping folded
    into the step, instead of a separate pass over the gradients).

    ``out=(params_out, exp_avgs_out, exp_avg_sqs_out)``: write the updated params and states
    there (fp32, same sizes, sharing no memory with the inputs) and leave ``params``,
    ``exp_avgs`` and ``exp_avg_sqs`` untouched: a step that can still be thrown away
    (CPU offload's speculative step during backward). Same values, bit for bit, as in place;
    the outputs are written with non-temporal stores.

    ``schedule``: how the OpenMP threads share the elements, ``"static"`` or ``"dynamic"``
    (see :data:`SCHEDULES`); the same values either way.

    How the step writes memory (the same values, bit for bit, whatever is chosen), ``stores``:
    ``"mixed"`` (the earlier kernel, the default of this function): in place with ordinary
    stores, out of place with 16-byte non-temporal stores through 512-element L1 buffers.
    ``"stream_out"``: out of place as ``"stream"``, in place as ``"mixed"`` (CPU offload's
    default, ``offload_optimizer.cpu_stores``: the fastest measured on 2x H100 hosts). ``"stream"``: 512 elements at a time
    into L1 buffers, every result (param, both moments, the ``param_copies``; in place too)
    written with non-temporal stores of ``store_bytes`` each (0: the widest the vector path
    has, a whole 64-byte line with AVX-512; 16, 32 or 64), each block's inputs prefetched
    ``prefetch`` elements ahead (0: off).
    """
    if stores not in STORES:
        raise ValueError(f"stores={stores!r} is not one of {', '.join(STORES)}")
    if store_bytes not in STORE_BYTES:
        raise ValueError(f"store_bytes={store_bytes!r} is not one of {STORE_BYTES}")
    if prefetch < 0:
        raise ValueError(f"prefetch={prefetch!r} must be >= 0 elements (0: off)")
    outputs: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] = ([], [], [])
    if out is not None:
        outputs = (list(out[0]), list(out[1]), list(out[2]))
    _extension().adam_step(
        list(params),
        list(grads),
        list(exp_avgs),
        list(exp_avg_sqs),
        _copies(param_copies),
        float(lr),
        float(beta1),
        float(beta2),
        float(eps),
        float(weight_decay),
        bool(adam_w_mode),
        bool(bias_correction),
        int(step),
        float(grad_scale),
        _isa(),
        _schedule(schedule),
        *outputs,
        stores,
        int(store_bytes),
        int(prefetch),
    )


def memory_probe(
    mode: str,
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    out: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor], Sequence[torch.Tensor]]
    | None = None,
    store_bytes: int = 0,
    schedule: str = "static",
) -> float:
    """Adam's memory traffic without its arithmetic, over :func:`adam`'s tensors, with the
    same threads: what the host's memory gives a step of this shape (benchmarks).

    ``mode``: ``"read"`` reads params, both states and the gradients (14 bytes per element
    with bf16 gradients) and writes nothing; ``"copy"`` also writes three fp32 results
    (``out``, or over the inputs) with non-temporal stores of ``store_bytes`` as
    ``adam(stores="stream")`` does (26 bytes; the values written are not an Adam step);
    ``"write"`` only writes them (12 bytes). Returns the sum ``"read"`` took, else 0.
    """
    if mode not in PROBES:
        raise ValueError(f"mode={mode!r} is not one of {', '.join(PROBES)}")
    if store_bytes not in STORE_BYTES:
        raise ValueError(f"store_bytes={store_bytes!r} is not one of {STORE_BYTES}")
    outputs: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] = ([], [], [])
    if out is not None:
        outputs = (list(out[0]), list(out[1]), list(out[2]))
    return float(
        _extension().memory_probe(
            mode,
            list(params),
            list(grads),
            list(exp_avgs),
            list(exp_avg_sqs),
            *outputs,
            int(store_bytes),
            _isa(),
            _schedule(schedule),
        )
    )


def adagrad(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    lr: float,
    eps: float,
    weight_decay: float,
    param_copies: Sequence[torch.Tensor] | None = None,
    grad_scale: float = 1.0,
    schedule: str = "static",
) -> None:
    """C++ Adagrad with the semantics of :func:`slipstream.kernels.ops.adagrad.reference.adagrad`."""
    _extension().adagrad_step(
        list(params),
        list(grads),
        list(exp_avg_sqs),
        _copies(param_copies),
        float(lr),
        float(eps),
        float(weight_decay),
        float(grad_scale),
        _isa(),
        _schedule(schedule),
    )


def lion(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    param_copies: Sequence[torch.Tensor] | None = None,
    grad_scale: float = 1.0,
    schedule: str = "static",
) -> None:
    """C++ Lion with the semantics of :func:`slipstream.kernels.ops.lion.reference.lion`."""
    _extension().lion_step(
        list(params),
        list(grads),
        list(exp_avgs),
        _copies(param_copies),
        float(lr),
        float(beta1),
        float(beta2),
        float(weight_decay),
        float(grad_scale),
        _isa(),
        _schedule(schedule),
    )
