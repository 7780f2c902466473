"""Training progress as users read it: loss, lr, samples/s, tokens/s and MFU."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

# Dense (no sparsity) peak matrix rates from the vendors' datasheets, in TFLOP/s, by the
# substring that identifies the device in torch.cuda.get_device_name(). MFU is reported against
# these, as is customary; set SLIPSTREAM_PEAK_TFLOPS to use a measured ceiling instead.
_PEAK_TFLOPS_16BIT = {
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "MI300X": 1307.0,
    "MI325X": 1307.0,
    "MI250X": 383.0,
    "MI210": 181.0,
}


def peak_tflops(device_name: str | None, dtype: torch.dtype) -> float | None:
    """The device's peak TFLOP/s for ``dtype`` matrix work, or None when unknown (e.g. CPU)."""
    override = os.environ.get("SLIPSTREAM_PEAK_TFLOPS")
    if override:
        return float(override)
    if not device_name:
        return None
    for key, value in _PEAK_TFLOPS_16BIT.items():
        if key in device_name:
            # fp32 matrix work runs through TF32 at half the 16-bit rate on these parts.
            return value if dtype in (torch.float16, torch.bfloat16) else value / 2
    return None


def count_tokens(args: tuple, kwargs: dict) -> int:
    """Tokens in a micro-batch: the elements of its `input_ids` (or first 2-D integer tensor)."""
    candidates = [kwargs.get("input_ids")] if "input_ids" in kwargs else []
    for value in (*args, *kwargs.values()):
        if isinstance(value, dict):
            candidates.append(value.get("input_ids"))
        candidates.append(value)
    for value in candidates:
        if (
            isinstance(value, torch.Tensor)
            and value.dim() >= 2
            and not value.dtype.is_floating_point
            and not value.dtype.is_complex
            and value.dtype != torch.bool
        ):
            return value.numel()
    return 0


@dataclass(slots=True)
class ProgressReport:
    """One logged line's numbers."""

    step: int
    loss: float | None
    lr: list[float]
    loss_scale: float | None
    grad_norm: float | None
    samples_per_s: float
    tokens_per_s: float | None
    mfu: float | None
    skipped_steps: int

    def format(self) -> str:
        """The log line: `step=… loss=… lr=… …` with only the fields that apply."""
        parts = [f"step={self.step}"]
        if self.loss is not None:
            parts.append(f"loss={self.loss:.4f}")
        parts.append("lr=" + ",".join(f"{lr:.3e}" for lr in self.lr))
        if self.loss_scale is not None:
            parts.append(f"loss_scale={self.loss_scale:g}")
        if self.grad_norm is not None:
            parts.append(f"grad_norm={self.grad_norm:.4f}")
        parts.append(f"samples/s={self.samples_per_s:.2f}")
        if self.tokens_per_s is not None:
            parts.append(f"tokens/s={self.tokens_per_s:,.0f}")
        if self.mfu is not None:
            parts.append(f"MFU={100 * self.mfu:.1f}%")
        if self.skipped_steps:
            parts.append(f"skipped={self.skipped_steps}")
        return " ".join(parts)


class ThroughputMeter:
    """Counts samples and tokens between two log lines and turns them into rates.

    Rates cover the wall time between log lines, so data loading and everything else the loop
    does is included, as a user timing the loop would see it.
    """

    def __init__(
        self,
        *,
        dp_world_size: int,
        flops_per_token: float,
        peak: float | None,
        sequence_parallel_size: int = 1,
    ) -> None:
        # dp_world_size: the ranks whose tokens add up (DP × SP under Ulysses: each SP rank
        # holds 1/SP of its replica's tokens); samples count once per replica (÷ SP).
        self.dp_world_size = dp_world_size
        self.sequence_parallel_size = sequence_parallel_size
        self.flops_per_token = flops_per_token
        self.peak_flops = peak * 1e12 if peak else None
        self._start = time.perf_counter()
        self._samples = 0
        self._tokens = 0

    def add(self, samples: int, tokens: int) -> None:
        """Record one micro-batch on this rank."""
        self._samples += samples
        self._tokens += tokens

    def rates(self) -> tuple[float, float | None, float | None]:
        """(samples/s, tokens/s, MFU) over all data-parallel ranks since the last call; resets."""
        now = time.perf_counter()
        elapsed = max(now - self._start, 1e-9)
        samples_per_s = self._samples * self.dp_world_size / self.sequence_parallel_size / elapsed
        tokens_per_s = self._tokens * self.dp_world_size / elapsed if self._tokens else None
        mfu = None
        if tokens_per_s is not None and self.peak_flops:
            mfu = (tokens_per_s / self.dp_world_size) * self.flops_per_token / self.peak_flops
        self._start, self._samples, self._tokens = now, 0, 0
        return samples_per_s, tokens_per_s, mfu
