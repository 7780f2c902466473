"""The OpenAI-compatible HTTP server (Starlette + uvicorn) over a :class:`Deployment`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with server-sent-event
streaming), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from slipstream.inference.serving.deployment import Deployment, DeploymentClosedError, RequestStream
from slipstream.inference.serving.engine import RequestOutput
from slipstream.inference.serving.request import SamplingParams

logger = logging.getLogger(__name__)


class RequestError(Exception):
    """A request the server refuses: becomes an OpenAI-style JSON error with ``status``."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        """The ``{"error": {...}}`` body OpenAI clients parse."""
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        body = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status)


def _field(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        value = object()  # JSON true/false is not a number here
    if not isinstance(value, kinds):
        names = " or ".join("number" if k is float else k.__name__ for k in kinds)
        raise RequestError(
            400, f"'{name}' must be a {names}, got {json.dumps(body.get(name))}", name
        )
    return value


class OpenAIServer:
    """Builds the Starlette app for one deployment (one model, served under ``model_name``)."""

    def __init__(self, deployment: Deployment, model_name: str) -> None:
        self.deployment = deployment
        self.model_name = model_name
        self.created = int(time.time())
        self.draining = False
        self.app = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            ],
            lifespan=self._lifespan,
        )

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        yield
        # uvicorn reaches here after its graceful shutdown let open responses finish.
        self.draining = True
        await asyncio.to_thread(self.deployment.shutdown, True)

    async def health(self, request: Request) -> Response:
        """200 while serving; 503 while draining for shutdown or after the engine failed."""
        if self.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not self.deployment.healthy:
            return JSONResponse({"status": "engine failed"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        """Prometheus text exposition of the deployment's metrics."""
        text = self.deployment.metrics.render(self.deployment.gauges())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def models(self, request: Request) -> Response:
        """The one model this server serves."""
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "slipstream",
            "max_model_len": self.deployment.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def _body(self, request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise RequestError(400, f"the request body is not valid JSON: {error}") from error
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is None:
            raise RequestError(400, "'model' is required", "model")
        if model != self.model_name:
            raise RequestError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                "model",
                "model_not_found",
            )
        for unsupported, allowed in (("n", 1), ("best_of", 1), ("echo", False), ("logprobs", None)):
            if body.get(unsupported, allowed) not in (allowed, None):
                raise RequestError(
                    400,
                    f"'{unsupported}' other than {json.dumps(allowed)} is not supported",
                    unsupported,
                )
        return body

    def _sampling(
        self, body: dict[str, Any], prompt_tokens: int, default_max: int | None
    ) -> SamplingParams:
        limit = self.deployment.max_model_len
        room = limit - prompt_tokens
        max_tokens = _field(body, "max_completion_tokens", (int,), None)
        max_tokens = _field(body, "max_tokens", (int,), max_tokens)
        if max_tokens is None:  # completions default to 16 tokens, chat to the room left
            max_tokens = room if default_max is None else min(default_max, room)
        if max_tokens < 1 or max_tokens > room:
            raise RequestError(
                400,
                f"this model's maximum context length is {limit} tokens; the prompt has "
                f"{prompt_tokens} tokens and max_tokens={max_tokens} asks for more than the "
                f"{max(room, 0)} left: shorten the prompt or lower max_tokens",
                "max_tokens",
            )
        stop = _field(body, "stop", (str, list), [])
        stop = [stop] if isinstance(stop, str) else stop
        if not all(isinstance(s, str) for s in stop):
            raise RequestError(400, "'stop' must be a string or a list of strings", "stop")
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=float(_field(body, "temperature", (int, float), 1.0)),
                top_p=float(_field(body, "top_p", (int, float), 1.0)),
                top_k=_field(body, "top_k", (int,), 0),
                seed=_field(body, "seed", (int,), None),
                stop=stop,
                ignore_eos=_field(body, "ignore_eos", (bool,), False),
            )
        except ValueError as error:
            raise RequestError(400, str(error)) from error

    def _tokenize(self, prompt: Any, add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            tokenizer = self.deployment.engine.tokenizer
            if tokenizer is None:
                raise RequestError(
                    400, "this server has no tokenizer: send 'prompt' as token ids", "prompt"
                )
            ids = list(tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])
        elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            ids = prompt
        else:
            raise RequestError(
                400,
                "'prompt' must be a non-empty string or list of token ids (one prompt per request)",
                "prompt",
            )
        if not ids:
            raise RequestError(400, "the prompt is empty", "prompt")
        if len(ids) >= self.deployment.max_model_len:
            raise RequestError(
                400,
                f"the prompt has {len(ids)} tokens; this model's maximum context length is "
                f"{self.deployment.max_model_len} tokens (prompt + output): shorten the prompt",
                "prompt",
            )
        return ids

    def _submit(self, ids: list[int], params: SamplingParams, request_id: str) -> RequestStream:
        if self.draining:
            raise RequestError(503, "the server is shutting down")
        try:
            return self.deployment.submit(
                ids, params, request_id=request_id, loop=asyncio.get_running_loop()
            )
        except DeploymentClosedError as error:
            raise RequestError(503, str(error)) from error
        except ValueError as error:
            raise RequestError(400, str(error)) from error

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``."""
        try:
            body = await self._body(request)
            ids = self._tokenize(body.get("prompt"))
            params = self._sampling(body, len(ids), default_max=16)
            stream = _field(body, "stream", (bool,), False)
            usage = _include_usage(body)
            request_id = f"cmpl-{uuid.uuid4().hex}"
            handle = self._submit(ids, params, request_id)
        except RequestError as error:
            return error.response()
        base = {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
        }

        def choice(text: str, reason: str | None) -> dict[str, Any]:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}

        if stream:
            return self._sse(
                handle,
                lambda out: {**base, "choices": [choice(out.text, out.finish_reason)]},
                None,
                base if usage else None,
            )
        total = await self._collect(handle, request)
        if total is None:
            return Response(status_code=499)
        return JSONResponse(
            {**base, "choices": [choice(total.text, total.finish_reason)], "usage": _usage(total)}
        )

    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/chat/completions`` (the prompt from the tokenizer's chat template)."""
        try:
            body = await self._body(request)
            messages = body.get("messages")
            if (
                not isinstance(messages, list)
                or not messages
                or not all(
                    isinstance(m, dict)
                    and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)
                    for m in messages
                )
            ):
                raise RequestError(
                    400,
                    '\'messages\' must be a non-empty list of {"role": str, "content": str}',
                    "messages",
                )
            tokenizer = self.deployment.engine.tokenizer
            if tokenizer is None or not getattr(tokenizer, "chat_template", None):
                raise RequestError(
                    400, "this model's tokenizer has no chat template; use /v1/completions"
                )
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            ids = self._tokenize(text, add_special_tokens=False)  # the template writes them
            params = self._sampling(body, len(ids), default_max=None)
            stream = _field(body, "stream", (bool,), False)
            usage = _include_usage(body)
            request_id = f"chatcmpl-{uuid.uuid4().hex}"
            handle = self._submit(ids, params, request_id)
        except RequestError as error:
            return error.response()
        base = {"id": request_id, "created": int(time.time()), "model": self.model_name}
        if stream:
            first = {
                **base,
                "object": "chat.completion.chunk",
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None,
                    }
                ],
            }

            def chunk(out: RequestOutput) -> dict[str, Any]:
                delta = {"content": out.text} if out.text else {}
                return {
                    **base,
                    "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": out.finish_reason}],
                }

            usage_base = {**base, "object": "chat.completion.chunk"} if usage else None
            return self._sse(handle, chunk, first, usage_base)
        total = await self._collect(handle, request)
        if total is None:
            return Response(status_code=499)
        message = {"role": "assistant", "content": total.text}
        choices = [{"index": 0, "message": message, "finish_reason": total.finish_reason}]
        return JSONResponse(
            {**base, "object": "chat.completion", "choices": choices, "usage": _usage(total)}
        )

    async def _collect(self, handle: RequestStream, request: Request) -> RequestOutput | None:
        """All of a request's outputs; None (and the request aborted) if the client left."""
        total = RequestOutput(handle.request_id, [], "", num_prompt_tokens=handle.num_prompt_tokens)

        async def gather() -> None:
            async for out in handle:
                total.new_token_ids += out.new_token_ids
                total.text += out.text
                total.finish_reason = out.finish_reason
                total.num_output_tokens = out.num_output_tokens

        task = asyncio.ensure_future(gather())
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                task.result()
                return total
            if await request.is_disconnected():
                self.deployment.abort(handle.request_id)
                await task
                return None

    def _sse(
        self,
        handle: RequestStream,
        render: Any,
        first: dict[str, Any] | None,
        usage_base: dict[str, Any] | None,
    ) -> StreamingResponse:
        """Server-sent events: one per generated token (its text may be empty while a
        multi-byte character or a possible stop string is pending), a usage chunk when asked
        (``stream_options.include_usage``), then ``[DONE]``."""
        deployment = self.deployment

        async def events() -> AsyncIterator[str]:
            finished = False
            last: RequestOutput | None = None
            try:
                if first is not None:
                    yield f"data: {json.dumps(first)}\n\n"
                async for out in handle:
                    finished, last = out.finished, out
                    if out.new_token_ids or out.text or out.finished:
                        yield f"data: {json.dumps(render(out))}\n\n"
                if usage_base is not None and last is not None:
                    last.num_prompt_tokens = handle.num_prompt_tokens
                    usage = {**usage_base, "choices": [], "usage": _usage(last)}
                    yield f"data: {json.dumps(usage)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                if not finished:  # the client went away mid-stream: free its KV blocks
                    logger.info("client left request %s; aborting it", handle.request_id)
                    deployment.abort(handle.request_id)

        return StreamingResponse(events(), media_type="text/event-stream")


def _include_usage(body: dict[str, Any]) -> bool:
    options = _field(body, "stream_options", (dict,), {})
    return bool(_field(options, "include_usage", (bool,), False))


def _usage(total: RequestOutput) -> dict[str, int]:
    return {
        "prompt_tokens": total.num_prompt_tokens,
        "completion_tokens": total.num_output_tokens,
        "total_tokens": total.num_prompt_tokens + total.num_output_tokens,
    }


def build_server(
    deployment: Deployment, host: str = "127.0.0.1", port: int = 8000, **uvicorn_options: Any
) -> Any:
    """A ``uvicorn.Server`` for ``deployment`` (not started). SIGINT/SIGTERM start a graceful
    shutdown: no new connections, open responses finish, then the deployment drains."""
    import uvicorn

    app = OpenAIServer(deployment, deployment.model_name).app
    options = {"log_level": "info", "timeout_graceful_shutdown": None, **uvicorn_options}
    return uvicorn.Server(uvicorn.Config(app, host=host, port=port, **options))


def bound_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening-ready TCP socket (port 0 picks a free one): pass to ``server.serve``."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock
