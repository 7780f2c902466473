"""Dynamic SplitFuse scheduling: each step, a token budget filled by running requests first
(decodes and unfinished prompt chunks), then by waiting prompts, split to fit."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from slipstream.inference.serving.kv_cache_manager import KVCacheManager
from slipstream.inference.serving.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledChunk:
    """The tokens of one request that one forward pass computes.

    ``token_ids`` sit at positions ``start .. start + len(token_ids) - 1``; ``block_table`` holds
    their (and all earlier tokens') keys/values. ``samples`` is True when the chunk ends at the
    request's last token, so the forward's last logits give its next token.
    """

    request_id: str
    token_ids: list[int]
    start: int
    block_table: list[int]
    samples: bool


@dataclass
class SchedulerOutput:
    """One step's work: the chunks (in batch order) and the requests preempted to make room."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens in the forward pass (at most the scheduler's token budget)."""
        return sum(len(chunk.token_ids) for chunk in self.chunks)


class Scheduler:
    """Decides each forward pass from the queues, the KV cache's free blocks and a token budget.

    Policy (first come, first served): running requests keep their order and each gets all its
    uncomputed tokens (one for a decode) while the budget lasts; a long prompt is split across
    steps (Dynamic SplitFuse), so every forward runs close to ``max_num_batched_tokens`` tokens
    and decodes are never stalled behind a whole prompt. When the cache is full, the most
    recently admitted running request is preempted: its blocks are freed and it goes back to the
    head of the queue to recompute later (its generated tokens kept). Waiting requests are
    admitted, with prefix-cache hits, only in a step that preempted nothing.

    The scheduler never runs the model: :meth:`schedule` plans a step, :meth:`update` applies
    the sampled tokens, so every invariant is testable without one.
    """

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        enable_prefix_caching: bool = True,
    ) -> None:
        if -(-max_model_len // block_size) > num_blocks:
            raise ValueError(
                f"the KV cache has {num_blocks} blocks of {block_size} tokens, fewer than one "
                f"request of max_model_len={max_model_len} needs; give the cache more memory "
                "or lower max_model_len"
            )
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError(
                f"max_num_batched_tokens={max_num_batched_tokens} and max_num_seqs="
                f"{max_num_seqs} must both be >= 1"
            )
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}

    def add_request(self, request: Request) -> None:
        """Queue ``request``; ValueError if it could never fit the model's context."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"the prompt has {request.num_prompt_tokens} tokens; this deployment serves "
                f"at most max_model_len={self.max_model_len} tokens (prompt + output): "
                "shorten the prompt"
            )
        self.requests[request.request_id] = request
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        """Requests waiting or running."""
        return len(self.requests)

    def schedule(self) -> SchedulerOutput:
        """Plan the next forward pass (changes queues and block tables, not token counts)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            count = min(len(request.token_ids) - request.num_computed_tokens, budget)
            while not self.kv.allocate_slots(request, count):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            out.chunks.append(self._chunk(request, count))
            budget -= count
            index += 1

        while (
            not out.preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.max_num_seqs
        ):
            request = self.waiting[0]
            computed = self.kv.computed_blocks(request)
            cached = len(computed) * self.kv.block_size
            count = min(len(request.token_ids) - cached, budget)
            if not self.kv.allocate_slots(request, count, computed):
                break  # queue: the cache is full until running requests finish
            self.waiting.popleft()
            if request.num_preemptions == 0:
                request.num_cached_prompt_tokens = cached
            request.num_computed_tokens = cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(self._chunk(request, count))
            budget -= count
        return out

    def schedule_ahead(self, plan: SchedulerOutput) -> SchedulerOutput | None:
        """Plan the step after ``plan`` before ``plan``'s tokens are sampled (asynchronous
        scheduling), or None when the regular :meth:`schedule` must plan it.

        Only while nothing waits and every running request samples in ``plan`` (decodes and
        last prompt chunks): each decodes one token, the one ``plan`` samples for it, whose id
        is unknown here — the chunk carries a placeholder id 0 and the forward reads the real
        one on the device (``feed_rows``). Requests that ``plan`` ends by length are left out;
        ones it ends otherwise (end of sequence, a stop) are computed once more and dropped by
        :meth:`update`. Nothing is preempted: a full cache returns None (blocks it allocated
        stay with their requests, which would need them next anyway).
        """
        if self.waiting or len(plan.chunks) != len(self.running) or not plan.chunks:
            return None
        out = SchedulerOutput()
        for chunk, request in zip(plan.chunks, self.running):
            if chunk.request_id != request.request_id or not chunk.samples:
                return None
            if request.num_computed_tokens != chunk.start:
                return None
            params = request.sampling
            length = len(request.token_ids) + 1  # with the token ``plan`` samples
            if request.num_output_tokens + 1 >= params.max_tokens or length >= self.max_model_len:
                continue  # ``plan`` ends it by length
            if not self.kv.allocate_slots(request, len(chunk.token_ids) + 1):
                return None
            start = chunk.start + len(chunk.token_ids)
            block_table = list(self.kv.block_table(request))
            out.chunks.append(ScheduledChunk(request.request_id, [0], start, block_table, True))
        return out if out.chunks else None

    def _chunk(self, request: Request, count: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=request.token_ids[start : start + count],
            start=start,
            block_table=list(self.kv.block_table(request)),
            samples=start + count == len(request.token_ids),
        )

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Record that ``output`` ran and append each sampling chunk's token from ``sampled``.

        Returns the requests that finished (end of sequence, stop token, max_tokens, or the
        model's context full); their blocks are freed. Requests finished by :meth:`finish`
        between :meth:`schedule` and this call are skipped.
        """
        finished = []
        for chunk in output.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            request.num_computed_tokens += len(chunk.token_ids)
            if not chunk.samples:
                continue
            token = sampled[chunk.request_id]
            request.token_ids.append(token)
            status = self._stop_status(request, token)
            if status is not None:
                self.finish(request.request_id, status)
                finished.append(request)
        return finished

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling
        if token in params.stop_token_ids or (
            not params.ignore_eos and token == request.eos_token_id
        ):
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if len(request.token_ids) >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request now (a stop string, or cancellation): free its blocks, drop it."""
        if not status.finished:
            raise ValueError(f"finish: {status} is not a finished status")
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.kv.free(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = status
        return request

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks held by requests (0 to 1)."""
        return self.kv.pool.usage
