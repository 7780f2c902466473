"""A serving request: its tokens, sampling parameters, progress through the KV cache, status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class RequestStatus(enum.Enum):
    """Where a request is: queued, holding KV blocks, or done (and why)."""

    WAITING = "waiting"  # queued (new, or preempted: its KV blocks were freed for recompute)
    RUNNING = "running"  # holds KV blocks; scheduled every step until it finishes
    FINISHED_STOPPED = "stop"  # end-of-sequence token, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens generated, or the model's context is full
    FINISHED_ABORTED = "abort"  # cancelled by the caller (or its client disconnected)

    @property
    def finished(self) -> bool:
        """True for the three finished states."""
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass(kw_only=True)
class SamplingParams:
    """Per-request generation settings (OpenAI's names where they exist).

    ``temperature == 0`` is greedy decoding. ``top_k == 0`` and ``top_p == 1`` switch those
    filters off. ``seed`` makes a sampled request reproducible whatever it is batched with.
    ``stop`` strings end generation where they appear (the string itself is not returned);
    ``stop_token_ids`` and the tokenizer's end-of-sequence token (unless ``ignore_eos``) end it
    after that token.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        checks = (
            (self.max_tokens >= 1, "max_tokens", self.max_tokens, "an integer >= 1"),
            (self.temperature >= 0, "temperature", self.temperature, "a number >= 0"),
            (0 < self.top_p <= 1, "top_p", self.top_p, "a number in (0, 1]"),
            (self.top_k >= 0, "top_k", self.top_k, "an integer >= 0 (0 = off)"),
        )
        for ok, name, value, allowed in checks:
            if not ok:
                raise ValueError(f"sampling parameter {name}={value!r} is invalid; use {allowed}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(
                f"sampling parameter seed={self.seed!r} is invalid; use 0 <= seed < 2**63"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"sampling parameter stop={self.stop!r}: use non-empty strings")

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0)."""
        return self.temperature == 0.0


@dataclass(eq=False)
class Request:
    """One generation request as the scheduler tracks it.

    ``token_ids`` is the prompt followed by the tokens generated so far; the first
    ``num_computed_tokens`` of them have their keys/values in the KV cache. A preempted request
    keeps its generated tokens and recomputes all of them (``num_computed_tokens`` back to 0).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0  # prefix-cache hits on the first admission
    block_hashes: list[bytes] = field(default_factory=list)  # of its full blocks, filled lazily

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: the prompt has no tokens")
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The tokens generated so far."""
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        """How many tokens were generated."""
        return len(self.token_ids) - len(self.prompt_token_ids)
