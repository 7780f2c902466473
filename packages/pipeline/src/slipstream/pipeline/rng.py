"""Named RNG streams that activation-checkpoint recomputation can replay exactly.

Megatron and DeepSpeed keep two random streams: the default one (same seed on every
tensor-parallel rank, for dropout outside tensor-parallel regions) and a ``model-parallel-rng``
stream (a different seed per tensor-parallel rank, for dropout inside them). Code draws from a
named stream with ``with get_rng_tracker().fork():``. Checkpointing records every stream's
state before a forward and restores it for the recomputation, so dropout masks repeat.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = [
    "MODEL_PARALLEL_RNG",
    "RNGStatesTracker",
    "get_rng_tracker",
    "model_parallel_manual_seed",
]

MODEL_PARALLEL_RNG = "model-parallel-rng"

# Offset between the default seed and the tensor-parallel stream's seed (Megatron's constant, so
# a model ported from Megatron-DeepSpeed draws the same masks).
_MODEL_PARALLEL_SEED_OFFSET = 2718


def _device_type() -> str:
    """Where dropout masks are drawn: the accelerator when there is one, else the CPU."""
    if torch.cuda.is_available():  # CUDA and ROCm builds both answer here
        return "cuda"
    return "cpu"


def _get_state() -> torch.Tensor:
    if _device_type() == "cuda":
        return torch.cuda.get_rng_state()
    return torch.get_rng_state()


def _set_state(state: torch.Tensor) -> None:
    if _device_type() == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named generator states of the current device, forked into with :meth:`fork`.

    >>> tracker = RNGStatesTracker()
    >>> tracker.add("stream", seed=7)
    >>> saved = tracker.get_states()
    >>> with tracker.fork("stream"):
    ...     a = torch.rand(2)
    >>> tracker.set_states(saved)  # rewind, as checkpoint recomputation does
    >>> with tracker.fork("stream"):
    ...     b = torch.rand(2)
    >>> torch.equal(a, b)
    True
    """

    def __init__(self) -> None:
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: set[int] = set()

    def reset(self) -> None:
        """Forget every stream."""
        self._states.clear()
        self._seeds.clear()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of every stream's state (to restore later with :meth:`set_states`)."""
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the streams with ``states`` (from :meth:`get_states`)."""
        self._states = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed``; names and seeds must be new."""
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists; call reset() first")
        if seed in self._seeds:
            raise ValueError(
                f"seed {seed} is already used by another RNG stream; streams with the same "
                "seed would draw the same numbers"
            )
        outer = _get_state()
        try:
            if _device_type() == "cuda":
                torch.cuda.manual_seed(seed)
            else:
                torch.manual_seed(seed)
            self._states[name] = _get_state()
        finally:
            _set_state(outer)
        self._seeds.add(seed)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; the default stream is left untouched."""
        if name not in self._states:
            raise KeyError(
                f"RNG stream {name!r} does not exist; create it with add() or "
                "model_parallel_manual_seed()"
            )
        outer = _get_state()
        _set_state(self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_state()
            _set_state(outer)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker that :func:`slipstream.pipeline.checkpointing.checkpoint` replays."""
    return _TRACKER


def model_parallel_manual_seed(seed: int, tensor_parallel_rank: int = 0) -> None:
    """Seed the default stream with ``seed`` and the tensor-parallel stream per rank.

    DeepSpeed's ``model_parallel_cuda_manual_seed``: the default generator gets ``seed``
    (identical across tensor-parallel ranks), the ``model-parallel-rng`` stream gets
    ``seed + 2718 + tensor_parallel_rank`` (distinct per rank). Works on CPU too.

    >>> model_parallel_manual_seed(1234)
    >>> with get_rng_tracker().fork():
    ...     mask = torch.rand(3) > 0.5
    """
    if _device_type() == "cuda":
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + _MODEL_PARALLEL_SEED_OFFSET + tensor_parallel_rank)
