"""The OpenAI-compatible server over real HTTP on 127.0.0.1: completions and chat, streaming
and not, concurrent clients, malformed requests, a client leaving mid-stream, graceful shutdown."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from slipstream.inference.serving import pipeline

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from slipstream.inference.serving.server import bound_socket, build_server  # noqa: E402

MODEL = "tiny-llama"
PROMPTS = ["hello world", "the quick brown fox", "a", "jumps over the lazy dog!", "zz top", "42"]


class RunningServer:
    """A uvicorn server on its own thread, on a free port of 127.0.0.1."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.deployment = pipeline(model, tokenizer=tokenizer, num_blocks=96).serve()
        self.deployment.model_name = MODEL
        self.server = build_server(self.deployment, log_level="warning")
        sock = bound_socket()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]})
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def server(model, tokenizer) -> Iterator[RunningServer]:
    running = RunningServer(model, tokenizer)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def expected(model, tokenizer) -> dict[str, str]:
    """Greedy completions of PROMPTS (12 tokens) from an in-process pipeline."""
    pipe = pipeline(model, tokenizer=tokenizer, num_blocks=96)
    return {
        p: r.generated_text
        for p, r in zip(PROMPTS, pipe(PROMPTS, max_new_tokens=12, ignore_eos=True))
    }


def _complete(url: str, prompt: str, **extra: Any) -> dict:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
    }
    response = httpx.post(f"{url}/v1/completions", json={**body, **extra}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _events(response: Any) -> list[Any]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_models_health_and_metrics(server: RunningServer) -> None:
    models = httpx.get(f"{server.url}/v1/models").json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 256
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    _complete(server.url, "hello")
    metrics = httpx.get(f"{server.url}/metrics").text
    for name in (
        "slipstream_num_requests_waiting",
        "slipstream_kv_cache_usage",
        "slipstream_generation_tokens_per_second",
        'slipstream_time_to_first_token_seconds_bucket{le="+Inf"}',
        "slipstream_inter_token_latency_seconds_count",
    ):
        assert name in metrics
    assert "slipstream_generation_tokens_total 0" not in metrics


def test_completion_streaming_and_not(server: RunningServer, expected: dict[str, str]) -> None:
    body = _complete(server.url, "hello world")
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["choices"][0]["text"] == expected["hello world"]
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 11, "completion_tokens": 12, "total_tokens": 23}
    request = {
        "model": MODEL,
        "prompt": "hello world",
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=request, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _events(response)
    assert events[-1] == "[DONE]" and events[-3]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["usage"] == body["usage"] and events[-2]["choices"] == []
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == expected["hello world"]
    assert len(events) == 12 + 2  # one event per generated token, then usage and [DONE]


def test_chat_completion_streaming_and_not(server: RunningServer, tokenizer) -> None:
    messages = [{"role": "user", "content": "hi there"}]
    request = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    body = httpx.post(f"{server.url}/v1/chat/completions", json=request, timeout=60).json()
    assert body["object"] == "chat.completion"
    content = body["choices"][0]["message"]["content"]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert body["usage"]["prompt_tokens"] == len(
        tokenizer(prompt, add_special_tokens=False)["input_ids"]
    )
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json={**request, "stream": True}, timeout=60
    ) as response:
        events = _events(response)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == content


def test_concurrent_clients(server: RunningServer, expected: dict[str, str]) -> None:
    results: dict[str, str] = {}

    def client(prompt: str) -> None:
        results[prompt] = _complete(server.url, prompt)["choices"][0]["text"]

    threads = [threading.Thread(target=client, args=(p,)) for p in PROMPTS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert results == expected


@pytest.mark.parametrize(
    ("path", "content", "status", "message"),
    [
        ("/v1/completions", b"{not json", 400, "not valid JSON"),
        ("/v1/completions", b"[1, 2]", 400, "must be a JSON object"),
        ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "'gpt-4' does not exist"),
        ("/v1/completions", {"prompt": "x"}, 400, "'model' is required"),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "a" * 300},
            400,
            "maximum context length is 256",
        ),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "ab", "max_tokens": 500},
            400,
            "max_tokens=500",
        ),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "ab", "max_tokens": "9"},
            400,
            "'max_tokens' must be",
        ),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "ab", "top_p": 0},
            400,
            "top_p=0.0 is invalid",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": 5}, 400, "'prompt' must be"),
        ("/v1/completions", {"model": MODEL, "prompt": "ab", "seed": -1}, 400, "seed=-1"),
        ("/v1/completions", {"model": MODEL, "prompt": [5, 100000]}, 400, "got [100000]"),
        ("/v1/completions", {"model": MODEL, "prompt": "ab", "n": 2}, 400, "'n' other than 1"),
        ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "'messages' must be"),
    ],
)
def test_malformed_requests_get_clear_4xx(server, path, content, status, message) -> None:
    kwargs = {"content": content} if isinstance(content, bytes) else {"json": content}
    response = httpx.post(f"{server.url}{path}", timeout=30, **kwargs)
    assert response.status_code == status
    assert message in response.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_client_leaving_mid_stream_aborts_the_request(server: RunningServer) -> None:
    aborted_before = server.deployment.metrics.requests["abort"]
    request = {
        "model": MODEL,
        "prompt": "hello",
        "max_tokens": 240,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=request, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # leave after the first event
    deadline = time.monotonic() + 20
    while server.deployment.num_in_flight or server.deployment.engine.has_unfinished:
        assert time.monotonic() < deadline, "the abandoned request kept running"
        time.sleep(0.02)
    assert server.deployment.metrics.requests["abort"] == aborted_before + 1
    pool = server.deployment.engine.scheduler.kv.pool
    assert pool.num_free == pool.num_blocks


def test_graceful_shutdown_drains_in_flight_streams(model, tokenizer) -> None:
    running = RunningServer(model, tokenizer)
    request = {
        "model": MODEL,
        "prompt": "hello",
        "max_tokens": 60,
        "ignore_eos": True,
        "stream": True,
    }
    events: list[Any] = []
    with httpx.stream(
        "POST", f"{running.url}/v1/completions", json=request, timeout=60
    ) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                break
        running.server.should_exit = True  # what SIGTERM / Ctrl-C does
        for line in lines:
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
    running.thread.join(timeout=30)
    assert not running.thread.is_alive()
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{running.url}/health", timeout=5)
    assert not running.deployment._thread.is_alive()  # the lifespan drained and stopped it


def test_client_leaving_a_non_streamed_request_aborts_it(
    server: RunningServer, monkeypatch
) -> None:
    engine = server.deployment.engine
    real_step = engine.step

    def slow_step() -> list:  # 250 tokens take over 2 s: the client leaves long before
        time.sleep(0.01)
        return real_step()

    monkeypatch.setattr(engine, "step", slow_step)
    aborted_before = server.deployment.metrics.requests["abort"]
    request = {"model": MODEL, "prompt": "hi", "max_tokens": 250, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=request, timeout=0.3)
    deadline = time.monotonic() + 20
    while server.deployment.num_in_flight:
        assert time.monotonic() < deadline, "the abandoned request kept running"
        time.sleep(0.02)
    assert server.deployment.metrics.requests["abort"] == aborted_before + 1
