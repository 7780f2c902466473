"""tools/bench/infer_bench.py's decode-step timing: the decode steps of one ``generate`` alone
(the prefill left out), the runner's own ``decode`` restored afterwards."""

from __future__ import annotations

import time

import pytest
import torch

from slipstream.inference import init_inference
from slipstream.inference.testing import tiny_hf_model

pytest.importorskip("transformers")


def test_timed_generate_times_the_decode_steps_only(bench_script) -> None:
    """A prefill made slow (a 1 s sleep) moves the wall time, not the per-step time (were the
    prefill in it, each of the four steps would take >= 0.25 s); generate's tokens are unchanged
    by the timing. No bound here compares two timings, so a loaded CI machine cannot fail it."""
    bench = bench_script("infer_bench")
    engine = init_inference(tiny_hf_model("llama"), replace_with_kernel_inject=True)
    runner = engine._runner
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(0))
    kwargs = {"max_new_tokens": 5, "do_sample": False, "eos_token_id": None}
    expected = engine.generate(ids, **kwargs)
    got: list[torch.Tensor] = []
    cpu = torch.device("cpu")
    wall, step = bench.timed_generate(
        engine, lambda: got.append(engine.generate(ids, **kwargs)), cpu
    )
    assert torch.equal(got[0], expected) and "decode" not in vars(runner)
    prefill = runner.prefill

    def slow_prefill(*args):
        time.sleep(1.0)
        return prefill(*args)

    runner.prefill = slow_prefill
    slow_wall, slow_step = bench.timed_generate(engine, lambda: engine.generate(ids, **kwargs), cpu)
    assert slow_wall >= 1.0 and 0 < wall
    assert 0 < slow_step < 0.15 and 0 < step < 0.15  # four decode steps of a tiny model
    # no decode step: zero
    assert bench.timed_generate(engine, lambda: engine.generate(ids, max_new_tokens=1), cpu)[1] == 0
