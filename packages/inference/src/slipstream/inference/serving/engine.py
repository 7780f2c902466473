"""The serving engine loop: admit requests, schedule a step, run it, sample, stream outputs."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from slipstream.inference.model import FusedDecoder
from slipstream.inference.serving.config import ServingConfig
from slipstream.inference.serving.detokenizer import IncrementalDetokenizer
from slipstream.inference.serving.model_runner import (
    CaptureFn,
    PagedDecoder,
    build_fused_decoder,
    check_supported,
)
from slipstream.inference.serving.request import Request, RequestStatus, SamplingParams
from slipstream.inference.serving.sampler import sample_tokens
from slipstream.inference.serving.scheduler import (
    ScheduledChunk,
    Scheduler,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RequestOutput:
    """What one step produced for one request (a streaming increment, or the final one)."""

    request_id: str
    new_token_ids: list[int]
    text: str  # the text delta of ``new_token_ids`` ("" without a tokenizer)
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length" or "abort" once finished
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass
class StepRecord:
    """One step of the engine's timeline (``ServingEngine.timeline``), times in ms.

    ``forward_ms`` waits for the GPU when the timeline is on, so it is the forward's own time
    (not under ``async_scheduling``, where waiting would undo the overlap: there it is the launch
    of this step, or of the next one planned ahead, and the GPU's time shows in ``sample_ms``);
    ``sample_ms`` the batched sampling and its copy to the host; ``update_ms`` the scheduler's
    bookkeeping, stop checks and detokenization.
    """

    start: float  # time.perf_counter() at the step's start
    schedule_ms: float
    forward_ms: float
    sample_ms: float
    update_ms: float
    tokens: int
    sequences: int
    decode_only: bool
    graph_bucket: int  # the decode graph's batch bucket, 0 for an eager step


@dataclass
class EngineStats:
    """Counters the server's /metrics reads (monotonic totals, and the latest gauges)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    preemptions: int = 0
    steps_ahead: int = 0  # steps launched before the previous step's tokens were on the host
    batched_tokens: int = 0  # tokens of all forward passes (prompt chunks + decodes)
    requests_finished: dict[str, int] = field(default_factory=dict)
    # Where the engine's time goes, in seconds: planning the step, launching the forward,
    # waiting for its logits and sampling (the GPU's time shows here: the first device-to-host
    # copy), and bookkeeping plus detokenization after it.
    seconds: dict[str, float] = field(
        default_factory=lambda: {"schedule": 0.0, "forward": 0.0, "sample": 0.0, "update": 0.0}
    )


def _fetch(tokens: torch.Tensor) -> Callable[[], list[int]]:
    """Start copying ``tokens`` to the host now; the returned call waits for that copy alone.

    A plain ``tolist()`` later would queue its copy behind whatever the stream holds by then —
    under asynchronous scheduling, the whole next step.
    """
    if not tokens.is_cuda:
        return lambda: tokens.tolist()  # type: ignore[no-any-return]
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    done = torch.cuda.Event()
    done.record()

    def read() -> list[int]:
        done.synchronize()
        return host.tolist()  # type: ignore[no-any-return]

    return read


# A step launched ahead: its plan, sampling chunks, tokens on the device, their host fetch and
# its graph bucket.
_Pending = tuple[
    "SchedulerOutput", list["ScheduledChunk"], torch.Tensor, Callable[[], list[int]], int
]


def _check_tp_world(tp: int, group: dist.ProcessGroup | None) -> None:
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world != tp:
        raise ValueError(
            f"serving.tensor_parallel={tp} needs a process group of {tp} ranks; this one has "
            f"{world}. Launch {tp} processes (`slipstream run --num_gpus {tp} ...`, or "
            "torchrun) and build the engine on every rank"
        )


def _num_blocks(decoder: FusedDecoder, config: ServingConfig, device: torch.device) -> int:
    if config.num_blocks is not None:
        return config.num_blocks
    per_block = PagedDecoder.bytes_per_block(decoder, config.block_size)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * config.kv_cache_memory_fraction)
    else:
        budget = config.cpu_kv_cache_bytes
    return max(1, budget // per_block)


class ServingEngine:
    """Continuous batching over a paged KV cache for one decoder-only model.

    The model runs as ``init_inference``'s fused decoder (every family it has an adapter for:
    Llama, Mistral, Qwen2, Phi-3, Mixtral, GPT-2, OPT, Falcon), see [Note: one decoder] in
    ``model_runner.py``.

    Single-threaded: call :meth:`add_request`, :meth:`abort` and :meth:`step` from one thread
    (:class:`~slipstream.inference.serving.deployment.Deployment` runs it on its own thread).

    >>> engine = ServingEngine(model, tokenizer, ServingConfig(num_blocks=64))  # doctest: +SKIP
    >>> engine.add_request("Hello", SamplingParams(max_tokens=8))  # doctest: +SKIP
    >>> while engine.has_unfinished:  # doctest: +SKIP
    ...     for out in engine.step():
    ...         print(out.text, end="")
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any = None,
        config: ServingConfig | None = None,
        *,
        tp_group: dist.ProcessGroup | None = None,
        capture: CaptureFn | None = None,
    ) -> None:
        """``tp_group``: the tensor-parallel group of ``config.tensor_parallel`` ranks (default:
        the whole default group). ``capture`` replaces CUDA-graph capture (tests pass a plain
        function to run the decode-graph path's buffers and padding on the CPU)."""
        self.config = config or ServingConfig()
        if self.config.dtype != "auto":
            model = model.to(_DTYPES[self.config.dtype])
        model_config: Any = model.config  # type: ignore[attr-defined]
        self.max_model_len = self.config.max_model_len or int(model_config.max_position_embeddings)
        tp = self.config.tensor_parallel
        self.tp_group = tp_group
        if tp > 1:
            _check_tp_world(tp, tp_group)
        decoder = build_fused_decoder(model, tensor_parallel=tp, tp_group=tp_group)
        check_supported(decoder, self.max_model_len)
        self.rank = dist.get_rank(tp_group) if tp > 1 else 0
        self.tokenizer = tokenizer
        self.vocab_size = int(model_config.vocab_size)
        eos = model_config.eos_token_id if tokenizer is None else tokenizer.eos_token_id
        self.eos_token_id: int | None = eos[0] if isinstance(eos, list) else eos
        device = decoder.embed.weight.device  # the head may be quantized (no .weight)
        num_blocks = _num_blocks(decoder, self.config, device)
        if tp > 1:  # every rank's cache must hold the same blocks: the smallest free memory wins
            agreed = torch.tensor([num_blocks], dtype=torch.int64, device=device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=tp_group)
            num_blocks = int(agreed.item())
        block_size = self.config.block_size
        self.runner = PagedDecoder(
            decoder,
            num_blocks=num_blocks,
            block_size=block_size,
            max_blocks_per_seq=-(-self.max_model_len // block_size),
            cuda_graph=self.config.cuda_graph,
            graph_max_batch=min(self.config.cuda_graph_max_batch_size, self.config.max_num_seqs),
            capture=capture,
        )
        if device.type == "cuda":  # compile the Triton kernels' prompt-step variants now
            self.runner.warmup(min(self.config.max_num_batched_tokens, self.max_model_len))
        self.scheduler = Scheduler(
            num_blocks=num_blocks,
            block_size=self.config.block_size,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_num_seqs=self.config.max_num_seqs,
            max_model_len=self.max_model_len,
            enable_prefix_caching=self.config.enable_prefix_caching,
        )
        self.stats = EngineStats()
        # Set to a list to record a StepRecord per step (serve_bench's --timeline); None: off.
        self.timeline: list[StepRecord] | None = None
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._generators: dict[str, torch.Generator | None] = {}
        self._ids = itertools.count()
        # Asynchronous scheduling: the step launched ahead (its plan, sampling chunks and
        # tokens on the device), collected by the next step() call.
        self._pending: _Pending | None = None
        logger.info(
            "serving engine: %d KV blocks of %d tokens (%.2f GiB), budget %d tokens/step",
            num_blocks,
            self.config.block_size,
            num_blocks * PagedDecoder.bytes_per_block(decoder, block_size) / 2**30,
            self.config.max_num_batched_tokens,
        )

    @property
    def is_driver(self) -> bool:
        """True on the rank that schedules (rank 0 of the tensor-parallel group)."""
        return self.rank == 0

    def run_worker(self) -> int:
        """Ranks > 0 under tensor parallelism: run the steps rank 0 schedules until rank 0's
        :meth:`close`; returns the number of steps run."""
        return self.runner.serve_worker()

    def close(self) -> None:
        """Rank 0: release the tensor-parallel workers (their :meth:`run_worker` returns)."""
        if self.is_driver:
            self.runner.stop_workers()

    def _check_driver(self) -> None:
        if not self.is_driver:
            raise RuntimeError(
                f"rank {self.rank} is a tensor-parallel worker of this engine: send requests to "
                "rank 0, and call run_worker() here"
            )

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of ``prompt`` (ids pass through)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass prompts as token-id lists")
            return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        ids = list(prompt)
        # An id past the embedding would fail inside a batched forward (on a GPU, as a device
        # assert that ends the process): refuse it here, for this request alone.
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token ids must be integers in [0, {self.vocab_size}); got {bad[:5]}"
            )
        return ids

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a prompt (text or token ids); returns its request id.

        ValueError when it can never be served (too long for ``max_model_len``, empty).
        """
        self._check_driver()
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        request = Request(request_id, self.tokenize(prompt), params, self.eos_token_id)
        self.scheduler.add_request(request)
        if self.tokenizer is not None:
            self._detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, params.stop)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        self._generators[request_id] = generator
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request (frees its KV blocks); None if it already finished."""
        request = self.scheduler.finish(request_id, RequestStatus.FINISHED_ABORTED)
        if request is None:
            return None
        return self._finish(request, [], "")

    @property
    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[RequestOutput]:
        """Run one forward pass of the scheduled batch; return each touched request's output.

        With ``serving.async_scheduling``, the pass after it may already be launched here
        (see :meth:`Scheduler.schedule_ahead`); the next call then collects it.
        """
        self._check_driver()
        clock = started = time.perf_counter()
        seconds = self.stats.seconds
        pending, self._pending = self._pending, None
        schedule_ms = 0.0
        if pending is None:
            plan = self.scheduler.schedule()
            self.stats.preemptions += len(plan.preempted)
            if not plan.chunks:
                return []
            now = time.perf_counter()
            seconds["schedule"] += now - clock
            schedule_ms = (now - clock) * 1000
            clock = now
            logits = self.runner.forward(plan.chunks)
            if self.timeline is not None and logits.is_cuda and not self.config.async_scheduling:
                # Timeline runs only: wait for the GPU so "forward" holds the forward's own
                # time rather than the launch (sampling would wait for it next anyway).
                torch.cuda.synchronize(logits.device)
            sampling = [c for c in plan.chunks if c.samples]
            device_tokens = self._sample(sampling, logits)
            fetch = _fetch(device_tokens)  # before a step launched ahead queues behind it
            bucket = self.runner.last_bucket
        else:
            plan, sampling, device_tokens, fetch, bucket = pending
        if self.config.async_scheduling:
            self._launch_ahead(plan, sampling, device_tokens)
        now = time.perf_counter()
        seconds["forward"] += now - clock
        forward_ms = (now - clock) * 1000
        clock = now
        tokens = fetch()  # the step's one sync point
        now = time.perf_counter()
        seconds["sample"] += now - clock
        sample_ms = (now - clock) * 1000
        clock = now
        if pending is not None:
            # Launched before the previous step's update: drop the requests that ended since.
            live = [self._is_live(chunk) for chunk in plan.chunks]
            plan = SchedulerOutput([c for c, keep in zip(plan.chunks, live) if keep])
            kept = [(c, t) for c, t in zip(sampling, tokens) if self._is_live(c)]
            sampling, tokens = [c for c, _ in kept], [t for _, t in kept]
        requests = [self.scheduler.requests[c.request_id] for c in sampling]
        self.stats.steps += 1
        self.stats.batched_tokens += plan.num_tokens
        self.stats.prompt_tokens += sum(
            len(c.token_ids)
            for c in plan.chunks
            if c.start < self.scheduler.requests[c.request_id].num_prompt_tokens
        )
        finished = {
            r.request_id
            for r in self.scheduler.update(
                plan, dict(zip([c.request_id for c in sampling], tokens))
            )
        }
        outputs = []
        for request, token in zip(requests, tokens):
            self.stats.generated_tokens += 1
            text, stopped = "", False
            detokenizer = self._detokenizers.get(request.request_id)
            if detokenizer is not None:
                text, stopped = detokenizer.update(
                    request.output_token_ids, request.request_id in finished
                )
            if stopped and request.request_id not in finished:
                self.scheduler.finish(request.request_id, RequestStatus.FINISHED_STOPPED)
                request.status = RequestStatus.FINISHED_STOPPED
            if request.status.finished:
                outputs.append(self._finish(request, [token], text))
            else:
                outputs.append(self._output(request, [token], text))
        now = time.perf_counter()
        seconds["update"] += now - clock
        if self.timeline is not None:
            decode_only = all(len(c.token_ids) == 1 and c.samples for c in plan.chunks)
            self.timeline.append(
                StepRecord(
                    start=started,
                    schedule_ms=schedule_ms,
                    forward_ms=forward_ms,
                    sample_ms=sample_ms,
                    update_ms=(now - clock) * 1000,
                    tokens=plan.num_tokens,
                    sequences=len(plan.chunks),
                    decode_only=decode_only,
                    graph_bucket=bucket,
                )
            )
        return outputs

    def _sample(self, sampling: list[ScheduledChunk], logits: torch.Tensor) -> torch.Tensor:
        """The sampling chunks' next tokens, left on the device."""
        requests = [self.scheduler.requests[c.request_id] for c in sampling]
        return sample_tokens(
            logits,
            [r.sampling for r in requests],
            [self._generators[r.request_id] for r in requests],
        )

    def _launch_ahead(
        self, plan: SchedulerOutput, sampling: list[ScheduledChunk], tokens: torch.Tensor
    ) -> None:
        """Asynchronous scheduling: plan and launch the step after ``plan`` now, its token ids
        read on the device from ``tokens`` (``plan``'s samples, not yet on the host)."""
        ahead = self.scheduler.schedule_ahead(plan)
        if ahead is None:
            return
        row_of = {chunk.request_id: row for row, chunk in enumerate(sampling)}
        rows = torch.tensor([row_of[c.request_id] for c in ahead.chunks], dtype=torch.int64)
        if tokens.is_cuda:  # page-locked: a pageable copy would wait for the queued step
            rows = rows.pin_memory()
        rows = rows.to(tokens.device, non_blocking=True)
        logits = self.runner.forward(ahead.chunks, feed=(tokens, rows))
        self.stats.steps_ahead += 1
        tokens_ahead = self._sample(ahead.chunks, logits)
        fetch = _fetch(tokens_ahead)
        self._pending = (ahead, ahead.chunks, tokens_ahead, fetch, self.runner.last_bucket)

    def _is_live(self, chunk: ScheduledChunk) -> bool:
        """The chunk's request still runs, at the position the chunk was planned for."""
        request = self.scheduler.requests.get(chunk.request_id)
        return (
            request is not None
            and request.status is RequestStatus.RUNNING
            and request.num_computed_tokens == chunk.start
        )

    def _output(self, request: Request, tokens: list[int], text: str) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=tokens,
            text=text,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_prompt_tokens,
        )

    def _finish(self, request: Request, tokens: list[int], text: str) -> RequestOutput:
        self._detokenizers.pop(request.request_id, None)
        self._generators.pop(request.request_id, None)
        reason = request.status.value
        self.stats.requests_finished[reason] = self.stats.requests_finished.get(reason, 0) + 1
        out = self._output(request, tokens, text)
        out.finished, out.finish_reason = True, reason
        return out

    def generate(
        self, prompts: list[str] | list[list[int]], params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Serve ``prompts`` together to completion; one output per prompt (all tokens, text)."""
        ids = [self.add_request(prompt, params) for prompt in prompts]
        results = {rid: RequestOutput(rid, [], "") for rid in ids}
        started = time.perf_counter()
        while any(not results[rid].finished for rid in ids):
            for out in self.step():
                if out.request_id not in results:
                    continue
                total = results[out.request_id]
                total.new_token_ids += out.new_token_ids
                total.text += out.text
                total.finished, total.finish_reason = out.finished, out.finish_reason
                total.num_prompt_tokens = out.num_prompt_tokens
                total.num_output_tokens = out.num_output_tokens
                total.num_cached_tokens = out.num_cached_tokens
        logger.debug("generate: %d prompts in %.3fs", len(ids), time.perf_counter() - started)
        return [results[rid] for rid in ids]
