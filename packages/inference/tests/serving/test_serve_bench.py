"""tools/bench/serve_bench.py's in-process and static (init_inference) backends on a tiny model."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[4] / "tools" / "bench" / "serve_bench.py"


def _load():
    assert SCRIPT.exists(), f"{SCRIPT} is missing: the bench this test checks moved or was removed"
    spec = importlib.util.spec_from_file_location("serve_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["serve_bench"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_static_and_in_process_backends(tmp_path) -> None:
    """Static batches of 3 over 7 requests all at once: every request's own output length is
    counted, later batches wait (TTFT p99 above p50), per-step ITL is measured; the in-process
    engine on the same workload with the probe and the timeline."""
    bench = _load()
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
