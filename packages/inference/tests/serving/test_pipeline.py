"""The Python API: pipeline batches, streaming, stop strings, seeded sampling, and a persistent
deployment fed from several threads."""

from __future__ import annotations

import threading

import pytest

from slipstream.inference.serving import SamplingParams, pipeline
from slipstream.inference.serving.deployment import DeploymentClosedError
from slipstream.inference.serving.detokenizer import IncrementalDetokenizer

PROMPTS = ["hello world", "the quick brown fox jumps", "a"]


@pytest.fixture(scope="module")
def pipe(model, tokenizer):
    return pipeline(model, tokenizer=tokenizer, num_blocks=64, max_num_batched_tokens=16)


def test_pipeline_batch_matches_one_at_a_time_and_stream(pipe, tokenizer) -> None:
    together = pipe(PROMPTS, max_new_tokens=10, ignore_eos=True)
    for prompt, response in zip(PROMPTS, together):
        alone = pipe(prompt, max_new_tokens=10, ignore_eos=True)[0]
        assert response.token_ids == alone.token_ids
        assert response.generated_text == tokenizer.decode(
            response.token_ids, skip_special_tokens=True
        )
        assert response.prompt_length == len(tokenizer(prompt)["input_ids"])
        assert response.generated_length == 10 and response.finish_reason == "length"
        streamed = "".join(pipe.stream(prompt, max_new_tokens=10, ignore_eos=True))
        assert streamed == response.generated_text
    assert pipe.engine.scheduler.kv.pool.num_free == 64


def test_stop_string_truncates_and_finishes(pipe) -> None:
    full = pipe("hello world", max_new_tokens=12, ignore_eos=True)[0].generated_text
    stop = full[4:6]
    assert stop and stop not in full[:5]
    cut = pipe("hello world", max_new_tokens=12, ignore_eos=True, stop=[stop])[0]
    assert cut.finish_reason == "stop" and cut.generated_text == full[: full.index(stop)]


def test_detokenizer_holds_back_a_possible_stop_prefix(tokenizer) -> None:
    ids = tokenizer("abcXYd")["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, ["XYZ"])
    deltas = [detok.update(ids[: n + 1], finished=False)[0] for n in range(len(ids))]
    # "X" and "XY" may start "XYZ": held until "d" shows they do not.
    assert deltas == ["a", "b", "c", "", "", "XYd"]


def test_seeded_sampling_is_reproducible_in_any_batch(pipe) -> None:
    params = {"max_new_tokens": 8, "temperature": 0.9, "top_p": 0.9, "top_k": 20, "seed": 3}
    alone = pipe("hello world", **params)[0].token_ids
    batched = pipe(["the quick", "hello world", "x"], **params)[1].token_ids
    assert alone == batched


def test_deployment_serves_threads_and_drains_on_shutdown(model, tokenizer) -> None:
    deployment = pipeline(model, tokenizer=tokenizer, num_blocks=64).serve()
    expected = {
        p: r.token_ids
        for p, r in zip(
            PROMPTS,
            pipeline(model, tokenizer=tokenizer, num_blocks=64)(
                PROMPTS, max_new_tokens=6, ignore_eos=True
            ),
        )
    }
    results: dict[str, list[int]] = {}

    def client(prompt: str) -> None:
        tokens = []
        for out in deployment.submit(prompt, SamplingParams(max_tokens=6, ignore_eos=True)):
            tokens += out.new_token_ids
        results[prompt] = tokens

    threads = [threading.Thread(target=client, args=(p,)) for p in PROMPTS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert results == expected
    with pytest.raises(ValueError, match="at most 256 tokens"):
        deployment.submit("a" * 300)
    in_flight = deployment.submit("hello", SamplingParams(max_tokens=20, ignore_eos=True))
    deployment.shutdown(drain=True)
    outs = list(in_flight)
    assert outs[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in outs) == 20
    with pytest.raises(DeploymentClosedError):
        deployment.submit("hello")


def test_engine_failure_reaches_every_caller(model, tokenizer) -> None:
    deployment = pipeline(model, tokenizer=tokenizer, num_blocks=16).serve()

    def broken_step() -> list:
        raise RuntimeError("kernel exploded")

    deployment.engine.step = broken_step  # type: ignore[method-assign]
    stream = deployment.submit("hello")
    with pytest.raises(RuntimeError, match="kernel exploded"):
        list(stream)
    assert not deployment.healthy
    with pytest.raises(RuntimeError, match="serving loop failed"):
        deployment.submit("hello")
    deployment.shutdown()


def test_config_and_cli_errors_name_the_key() -> None:
    from slipstream.inference.serving import ServingConfig
    from slipstream.inference.serving.cli import main as serve_main

    assert ServingConfig.from_dict({"dtype": "auto"}, "serving").dtype == "auto"
    with pytest.raises(ValueError, match=r"did you mean 'serving\.block_size'"):
        ServingConfig.from_dict({"blok_size": 16}, "serving")
    with pytest.raises(ValueError, match=r"serving\.block_size = 24"):
        ServingConfig.from_dict({"block_size": 24}, "serving")
    # Refused before any model is loaded.
    with pytest.raises(SystemExit, match=r"--tp 2 needs 2 processes.*WORLD_SIZE=1"):
        serve_main(["no/such-model", "--tp", "2"])
