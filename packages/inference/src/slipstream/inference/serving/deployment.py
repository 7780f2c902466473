"""A persistent deployment: the serving engine on its own thread, fed by many callers."""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

from slipstream.inference.serving.engine import RequestOutput, ServingEngine
from slipstream.inference.serving.metrics import ServingMetrics
from slipstream.inference.serving.request import SamplingParams

logger = logging.getLogger(__name__)


class DeploymentClosedError(RuntimeError):
    """Raised by :meth:`Deployment.submit` once shutdown has begun."""


@dataclass
class _Timing:
    arrival: float
    last_token: float | None = None


def _deliver(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    """On a stream's event loop: hand each output to its stream's queue."""
    for stream, out in items:
        assert stream._async is not None
        stream._async.put_nowait(out)


class RequestStream:
    """One submitted request's outputs, in order, ending with a ``finished`` one.

    Iterate it (``for out in stream``) from a thread, or ``async for`` from the event loop it
    was submitted with. An engine-side failure ends the stream by raising it.
    """

    def __init__(
        self, request_id: str, num_prompt_tokens: int, loop: asyncio.AbstractEventLoop | None
    ):
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self._loop = loop
        self._sync: queue.Queue[RequestOutput | BaseException] = queue.Queue()
        self._async: asyncio.Queue[RequestOutput | BaseException] | None = (
            asyncio.Queue() if loop is not None else None
        )

    def _put(self, item: RequestOutput | BaseException) -> None:
        if self._loop is not None and self._async is not None:
            try:
                self._loop.call_soon_threadsafe(self._async.put_nowait, item)
            except RuntimeError:  # the loop closed: nobody is listening any more
                pass
        else:
            self._sync.put(item)

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            item = self._sync.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        if self._async is None:
            raise RuntimeError("this stream was submitted without an event loop; iterate it")
        while True:
            item = await self._async.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return


class Deployment:
    """Keeps a :class:`ServingEngine` stepping on a background thread while requests arrive.

    Callers on any thread :meth:`submit` prompts and read a :class:`RequestStream`;
    :meth:`abort` cancels one; :meth:`shutdown` stops accepting work, lets in-flight requests
    finish (``drain=True``) and stops the thread.

    >>> deployment = Deployment(engine)  # doctest: +SKIP
    >>> for out in deployment.submit("Hello", SamplingParams(max_tokens=8)):  # doctest: +SKIP
    ...     print(out.text, end="")
    >>> deployment.shutdown()  # doctest: +SKIP
    """

    def __init__(self, engine: ServingEngine, model_name: str = "model") -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = ServingMetrics()
        self._inbox: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._timings: dict[str, _Timing] = {}
        self._ids = itertools.count()
        self._accepting = True
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="slipstream-serving", daemon=True)
        self._thread.start()

    @property
    def max_model_len(self) -> int:
        """Longest prompt + output this deployment serves."""
        return self.engine.max_model_len

    @property
    def healthy(self) -> bool:
        """False once the engine loop has failed (every later submit raises)."""
        return self._error is None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        """Submitted requests that have not finished."""
        with self._lock:
            return len(self._streams)

    def submit(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> RequestStream:
        """Queue a prompt; its outputs arrive on the returned stream.

        Raises ValueError here, in the caller's thread, for a prompt that cannot be served (too
        long for ``max_model_len``), and :class:`DeploymentClosedError` during shutdown.
        """
        params = params or SamplingParams()
        token_ids = self.engine.tokenize(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens; this model serves at most "
                f"{self.max_model_len} tokens (prompt + output): shorten the prompt"
            )
        request_id = request_id or f"dep-{next(self._ids)}"
        stream = RequestStream(request_id, len(token_ids), loop)

        def add() -> None:
            try:
                self.engine.add_request(token_ids, params, request_id)
            except Exception as error:  # a bad request fails alone, never the serving loop
                self._close(request_id, error)

        with self._lock:
            if not self._accepting:
                raise DeploymentClosedError(
                    "the deployment is shutting down; not accepting requests"
                )
            if self._error is not None:
                raise RuntimeError("the serving loop failed") from self._error
            self._streams[request_id] = stream
            self._timings[request_id] = _Timing(time.monotonic())
            self._inbox.append(add)
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Cancel a request (a no-op if it already finished); its stream ends with "abort"."""

        def cancel() -> None:
            out = self.engine.abort(request_id)
            if out is not None:
                self._dispatch([out])

        with self._lock:
            self._inbox.append(cancel)
        self._wake.set()

    def generate(
        self, prompts: list[str] | list[list[int]], params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Submit ``prompts`` and wait for all; one collected output per prompt."""
        streams = [self.submit(prompt, params) for prompt in prompts]
        results = []
        for stream in streams:
            total = RequestOutput(stream.request_id, [], "")
            for out in stream:
                total.new_token_ids += out.new_token_ids
                total.text += out.text
                total.finished, total.finish_reason = out.finished, out.finish_reason
                total.num_prompt_tokens = out.num_prompt_tokens
                total.num_output_tokens = out.num_output_tokens
            results.append(total)
        return results

    def gauges(self) -> dict[str, tuple[float, str]]:
        """Queue depth, running requests, KV-cache use and engine totals now (for /metrics)."""
        scheduler = self.engine.scheduler
        stats = self.engine.stats
        engine_time = {
            f"engine_{phase}_seconds": (value, f"engine time in {phase} so far")
            for phase, value in stats.seconds.items()
        }
        return {
            **engine_time,
            "engine_steps": (stats.steps, "forward passes so far"),
            "engine_batched_tokens": (stats.batched_tokens, "tokens of all forward passes"),
            "num_requests_waiting": (len(scheduler.waiting), "requests queued for the KV cache"),
            "num_requests_running": (len(scheduler.running), "requests holding KV blocks"),
            "kv_cache_usage": (scheduler.kv_cache_usage, "fraction of KV blocks in use"),
            "num_preemptions": (self.engine.stats.preemptions, "requests preempted so far"),
            "generation_tokens_per_second": (
                self.metrics.tokens_per_second(),
                "tokens generated per second over the last 10 s",
            ),
        }

    def _run(self) -> None:
        try:
            while not self._stop:
                with self._lock:
                    work, self._inbox = self._inbox, []
                for action in work:
                    action()
                if not self.engine.has_unfinished:
                    self._wake.wait(timeout=0.05)
                    self._wake.clear()
                    continue
                self._dispatch(self.engine.step())
        except BaseException as error:  # surface it to every waiting caller, never hang them
            logger.exception("the serving loop failed")
            with self._lock:
                self._error = error
                streams = list(self._streams)
            for request_id in streams:
                self._close(request_id, error)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        metrics = self.metrics
        with metrics.lock:
            for out in outputs:
                timing = self._timings.get(out.request_id)
                if timing is None:
                    continue
                if out.new_token_ids:
                    if timing.last_token is None:
                        metrics.time_to_first_token.observe(now - timing.arrival)
                        metrics.prompt_tokens += out.num_prompt_tokens
                        metrics.cached_prompt_tokens += out.num_cached_tokens
                    else:
                        metrics.inter_token_latency.observe(now - timing.last_token)
                    timing.last_token = now
                    metrics.record_tokens(len(out.new_token_ids), now)
                if out.finished:
                    metrics.request_latency.observe(now - timing.arrival)
                    reason = out.finish_reason or "stop"
                    metrics.requests[reason] = metrics.requests.get(reason, 0) + 1
        # One wake-up per event loop per step, not one per token: each call_soon_threadsafe
        # writes to the loop's self-pipe.
        batches: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                if stream._loop is not None and stream._async is not None:
                    batches.setdefault(stream._loop, []).append((stream, out))
                else:
                    stream._put(out)
                if out.finished:
                    self._close(out.request_id, None)
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the loop closed: nobody is listening any more
                pass

    def _close(self, request_id: str, error: BaseException | None) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None)
            self._timings.pop(request_id, None)
        if stream is not None and error is not None:
            stream._put(error)

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting requests; with ``drain``, wait for in-flight ones (up to ``timeout``
        seconds, then abort the rest); then stop the engine thread."""
        with self._lock:
            self._accepting = False
        deadline = None if timeout is None else time.monotonic() + timeout
        if drain:
            while self.num_in_flight and self._thread.is_alive():
                if deadline is not None and time.monotonic() > deadline:
                    break
                time.sleep(0.01)
        with self._lock:
            leftover = list(self._streams)
        for request_id in leftover:
            self.abort(request_id)
        while self.num_in_flight and self._thread.is_alive():
            time.sleep(0.01)
        self._stop = True
        self._wake.set()
        self._thread.join()
        self.engine.close()  # releases tensor-parallel workers
