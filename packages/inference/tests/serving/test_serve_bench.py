"""tools/bench/serve_bench.py's in-process and static (init_inference) backends on a tiny model."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")


def test_static_and_in_process_backends(tmp_path, bench_script) -> None:
    """Static batches of 3 over 7 requests all at once: every request's own output length is
    counted, later batches wait (TTFT p99 above p50), per-step ITL is measured; the in-process
    engine on the same workload with the probe and the timeline."""
    bench = bench_script("serve_bench")
    out = tmp_path / "runs.jsonl"
    argv = ["--model", "tiny", "--device", "cpu", "--num-requests", "7", "--rate", "inf",
            "--prompt-len", "8:24", "--output-len", "4:9", "--static-batch", "3",
            "--backend", "static", "in-process", "--probe", "--timeline",
            str(tmp_path / "timeline.json"), "--no-decode-bound", "--json", str(out)]  # fmt: skip
    try:
        assert bench.main(argv) == 0
    finally:  # --probe installed Triton's JIT cache hook for the process
        knobs = getattr(__import__("triton"), "knobs", None)
        if knobs is not None:
            knobs.runtime.jit_cache_hook = None
    runs = {run["backend"]: run for run in map(json.loads, out.read_text().splitlines())}
    args = bench.argparse.Namespace(
        seed=0, lengths="uniform", prompt_len="8:24", output_len="4:9", num_requests=7,
        shared_prefix=0, rate=float("inf"),
    )  # fmt: skip
    expected_tokens = sum(bench.make_workload(args, 512).output_lens)
    static, engine = runs["static-init_inference"], runs["slipstream-in-process"]
    assert static["static_batch"] == 3 and static["failed"] == 0
    assert static["output_tokens"] == engine["output_tokens"] == expected_tokens
    assert static["ttft_p99_s"] > static["ttft_p50_s"] > 0
    assert static["itl_p50_s"] is not None and static["itl_p50_s"] > 0
    assert engine["failed"] == 0 and "probe" in engine and "timeline" in engine
