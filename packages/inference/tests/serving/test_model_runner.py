"""Ragged batching over the paged cache equals one-request-at-a-time Hugging Face greedy
generation, token for token (fp32), with chunked prefill, prefix sharing and preemption."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from slipstream.inference.adapters import UnsupportedModelError
from slipstream.inference.serving import SamplingParams, ServingConfig, ServingEngine
from slipstream.inference.serving.decode_graphs import graph_buckets
from slipstream.inference.serving.scheduler import ScheduledChunk
from slipstream.inference.serving.step_inputs import (
    BlockTableRows,
    build_step_inputs,
    ints_length,
)
from slipstream.inference.testing import tiny_hf_model

NEW_TOKENS = 12


def _prompts(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    shared = torch.randint(4, vocab, (20,), generator=generator).tolist()
    lengths = [3, 17, 41, 30, 9]
    prompts = [torch.randint(4, vocab, (n,), generator=generator).tolist() for n in lengths]
    return [*prompts, [*shared, 5, 6], [*shared, 7]]  # two share a 20-token prefix


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    ("model_type", "config"),
    [
        # Budget 24 splits the 41- and 30-token prompts across steps, fused with decodes.
        ("llama", {"max_num_batched_tokens": 24, "num_blocks": 64}),
        # 10 blocks of 16 cannot hold all seven requests: preemption with recompute.
        ("llama", {"max_num_batched_tokens": 64, "num_blocks": 10, "max_model_len": 160}),
        ("qwen2", {"max_num_batched_tokens": 32, "num_blocks": 64}),
        # The fused decoder's other families: learned positions and LayerNorm; MoE experts.
        ("gpt2", {"max_num_batched_tokens": 32, "num_blocks": 64}),
        ("mixtral", {"max_num_batched_tokens": 32, "num_blocks": 64}),
    ],
    ids=["llama-splitfuse", "llama-preempt", "qwen2", "gpt2", "mixtral"],
)
def test_batched_serving_equals_hf_greedy(make_model, model_type: str, config: dict) -> None:
    model = make_model(model_type)
    prompts = _prompts(model.config.vocab_size)
    expected = [_hf_greedy(model, prompt) for prompt in prompts]
    engine = ServingEngine(model, None, ServingConfig(**config))
    outputs = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [out.new_token_ids for out in outputs] == expected
    assert all(out.finish_reason == "length" for out in outputs)
    assert engine.scheduler.kv.pool.num_free == engine.scheduler.kv.pool.num_blocks
    if config["num_blocks"] == 10:
        assert engine.stats.preemptions > 0
    else:
        assert outputs[-1].num_cached_tokens == 16  # one full block of the shared prefix


@pytest.mark.parametrize("family", ["phi3", "opt", "falcon"])
def test_other_fused_families_equal_hf_greedy(family: str) -> None:
    """Phi-3 (fused QKV and gate/up in HF), OPT (learned positions at offset 2, biases),
    Falcon (multi-query attention, parallel residual) through the same paged forward."""
    model = tiny_hf_model(family)
    prompts = _prompts(model.config.vocab_size)
    expected = [_hf_greedy(model, prompt) for prompt in prompts]
    config = ServingConfig(max_num_batched_tokens=32, num_blocks=64, max_num_seqs=4)
    engine = ServingEngine(model, None, config)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [out.new_token_ids for out in outputs] == expected


def test_sliding_window_past_max_model_len_is_refused() -> None:
    with pytest.raises(ValueError, match=r"sliding window of 8 tokens.*max_model_len <= 8"):
        ServingEngine(tiny_hf_model("mistral"), None, ServingConfig(num_blocks=64))


def test_decode_graph_path_equals_hf_greedy(make_model) -> None:
    """Decode-only steps through the graph path (padding to buckets, static buffers), with the
    capture a plain function so that it runs on the CPU: same tokens as HF, one capture per
    bucket, and padding never leaks a block."""
    model = make_model("llama")
    prompts = _prompts(model.config.vocab_size)
    expected = [_hf_greedy(model, prompt) for prompt in prompts]
    captured: list[int] = []
    replays: list[int] = []

    def capture(step):
        captured.append(1)

        def replay():  # reruns the step from the static buffers
            replays.append(1)
            return step()

        return replay

    config = ServingConfig(max_num_batched_tokens=24, num_blocks=64, max_num_seqs=5)
    engine = ServingEngine(model, None, config, capture=capture)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.buckets == [1, 2, 4, 5]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [out.new_token_ids for out in outputs] == expected
    # Every bucket was captured once, at start (on padding rows only), never while serving.
    assert len(captured) == len(graphs.graphs) == len(graphs.buckets)
    assert len(replays) >= len(graphs.buckets) + NEW_TOKENS - 1  # decode steps went through
    assert engine.scheduler.kv.pool.num_free == engine.scheduler.kv.pool.num_blocks


def test_graph_buckets_and_padded_inputs() -> None:
    assert graph_buckets(256)[:6] == [1, 2, 4, 8, 16, 32] and graph_buckets(256)[-1] == 256
    assert graph_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    chunks = [
        ScheduledChunk("a", [11], start=20, block_table=[3, 5], samples=True),
        ScheduledChunk("b", [12], start=3, block_table=[7], samples=True),
        ScheduledChunk("c", [13], start=16, block_table=[1, 2], samples=True),
    ]
    eager = build_step_inputs(chunks, 16, scratch_block=9)
    padded = build_step_inputs(chunks, 16, pad_to=4, table_width=6, scratch_block=9)
    e = eager.views(eager.longs, eager.ints)
    p = padded.views(padded.longs, padded.ints)
    # The real rows are built identically; the padding row decodes into the scratch block.
    for name in ("input_ids", "positions", "slots", "seq_lens", "sample_rows"):
        assert p[name][:3].tolist() == e[name].tolist(), name
    assert e["positions"].tolist() == [20, 3, 16]
    assert e["slots"].tolist() == [5 * 16 + 4, 7 * 16 + 3, 2 * 16 + 0]
    assert p["block_tables"].shape == (4, 6) and p["block_tables"][:3, :2].tolist() == (
        e["block_tables"].tolist()
    )
    assert p["block_tables"][3].tolist() == [9] * 6 and p["slots"][3] == 9 * 16
    assert p["seq_lens"][3] == 1 and p["query_start_loc"].tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="pad_to=2"):
        build_step_inputs(chunks, 16, pad_to=2)


@pytest.mark.parametrize("pad_to", [None, 8])
def test_step_buffers_keep_kernel_views_16_byte_aligned(pad_to: int | None) -> None:
    """seq_lens and query_start_loc start at 16-byte offsets for any seqs x width (Triton
    compiles once per pointer alignment), and read the same as without the padding."""
    for seqs in range(1, 6):
        for width in range(1, 6):
            chunks = [
                ScheduledChunk(str(i), [4] * (i + 1), 16 * (width - 1), list(range(width)), True)
                for i in range(seqs)
            ]
            inputs = build_step_inputs(chunks, 16, pad_to=pad_to, scratch_block=9)
            assert inputs.ints.numel() == ints_length(inputs.num_seqs, inputs.table_width)
            views = inputs.views(inputs.longs, inputs.ints)
            for name in ("block_tables", "seq_lens", "query_start_loc"):
                assert views[name].storage_offset() * 4 % 16 == 0, (seqs, width, name)
            real = views["seq_lens"][:seqs].tolist()
            assert real == [16 * (width - 1) + i + 1 for i in range(seqs)]
            starts = views["query_start_loc"].tolist()
            assert starts[: seqs + 1] == [sum(range(1, i + 1)) for i in range(seqs + 1)]
            assert views["block_tables"][:seqs].tolist() == [list(range(width))] * seqs


def test_warmup_runs_in_the_scratch_block_only(model) -> None:
    """The GPU start-up warm-up (the full budget as 16 sequences, one token less as 3, a
    one-block prompt, decodes of 1, 16 and 3 sequences) writes only the scratch block: the
    cache the pool hands out stays untouched. Its steps cover each Triton class (1, multiple
    of 16, other) of the token count, sampled rows and block-table width."""
    engine = ServingEngine(model, None, ServingConfig(num_blocks=16, max_num_batched_tokens=40))
    runner = engine.runner
    before = [cache[:-1].clone() for cache in runner.key_cache]
    assert runner.warmup(40) == [32, 31, 16, 1, 16, 3]
    for cache, saved in zip(runner.key_cache, before):
        assert torch.equal(cache[:-1], saved) and cache[-1].abs().sum() > 0
    for tokens, seqs, width_class in ((2048, 16, 16), (2047, 3, 3)):
        plan = runner._warmup_chunks(tokens, seqs, width_class)
        assert len(plan) == seqs and sum(count for count, _, _ in plan) == tokens
        widths = {width for _, _, width in plan}
        assert len(widths) == 1
        width = widths.pop()
        assert (width % 16 == 0) == (width_class == 16) and width != 1
        assert all(-(-(count + start) // 16) <= width for count, start, _ in plan)


def test_kept_block_table_rows_equal_rebuilt_ones() -> None:
    """A graph bucket's table kept across steps reads like one rebuilt each step, as requests
    leave, change rows and gain blocks (columns past a row's table are never read)."""
    rows = BlockTableRows(4, 6, scratch_block=9)
    steps = [
        [("a", [3, 5]), ("b", [7]), ("c", [1, 2])],
        [("a", [3, 5, 8]), ("c", [1, 2])],  # a gains a block, b leaves, c moves up a row
        [("c", [1, 2])],
    ]
    for step in steps:
        chunks = [ScheduledChunk(rid, [4], 5, list(table), True) for rid, table in step]
        fresh = build_step_inputs(chunks, 16, pad_to=4, table_width=6, scratch_block=9)
        kept = build_step_inputs(chunks, 16, pad_to=4, scratch_block=9, table_rows=rows)
        assert torch.equal(fresh.longs, kept.longs)
        f, k = fresh.views(fresh.longs, fresh.ints), kept.views(kept.longs, kept.ints)
        for row, (_, table) in enumerate(step):
            assert k["block_tables"][row, : len(table)].tolist() == table
        assert torch.equal(f["block_tables"][len(step) :], k["block_tables"][len(step) :])
        assert torch.equal(f["seq_lens"], k["seq_lens"])


def test_unsupported_architecture_is_refused() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPTNeoXConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=50
    )
    model = transformers.GPTNeoXForCausalLM(config)
    with pytest.raises(UnsupportedModelError, match="model_type 'gpt_neox'"):
        ServingEngine(model, None, ServingConfig(num_blocks=8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_batched_serving_equals_hf_greedy_on_gpu(make_model) -> None:
    """The Triton paged-attention kernel in the loop (fp32, IEEE dots), decode steps replayed
    from CUDA graphs and eagerly, and launched ahead (asynchronous scheduling): same tokens as
    HF."""
    model = make_model("llama").cuda()
    prompts = _prompts(model.config.vocab_size)
    expected = []
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt], device="cuda"),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        expected.append(out[0, len(prompt) :].tolist())
    for cuda_graph, ahead in ((True, False), (False, False), (True, True)):
        config = ServingConfig(
            max_num_batched_tokens=24,
            num_blocks=64,
            cuda_graph=cuda_graph,
            async_scheduling=ahead,
        )
        engine = ServingEngine(model, None, config)
        outputs = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
        assert [out.new_token_ids for out in outputs] == expected, (cuda_graph, ahead)
        graphs = engine.runner.graphs
        assert (graphs is not None and len(graphs.graphs) > 0) == cuda_graph
        assert (engine.stats.steps_ahead > 0) == ahead


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
@pytest.mark.parametrize("cuda_graph", [True, False])
def test_no_triton_compile_while_serving_after_warmup(cuda_graph: bool) -> None:
    """After the engine's start-up (decode-graph capture, warm-up), steps of any mix of prompt
    chunks and decodes launch only kernels already compiled: a compile mid-serving stalls every
    request for about half a second (the first prompt step of the H100 benchmark took 606 ms).
    Llama-8B's widths (4096-wide rows: one row per norm tile, GQA group 4), bf16, one layer."""
    transformers = pytest.importorskip("transformers")
    knobs = pytest.importorskip("triton.knobs")
    config = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=512, max_position_embeddings=1024,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).cuda().eval()
    serving = ServingConfig(
        max_num_batched_tokens=256, num_blocks=512, max_num_seqs=24, cuda_graph=cuda_graph
    )
    engine = ServingEngine(model, None, serving)
    compiled: list[str] = []

    def hook(**kwargs) -> bool:
        compiled.append(str(kwargs.get("repr", "?"))[:300])
        return False

    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    try:
        generator = torch.Generator().manual_seed(3)
        # Prompt lengths around block and tile edges; 24 requests over a 256-token budget give
        # split prompts, mixed prompt + decode steps and decode batches of many sizes.
        lengths = [1, 2, 15, 16, 17, 31, 33, 64, 65, 100, 130, 200, 255, 3, 47, 80, 9, 120]
        prompts = [torch.randint(4, 500, (n,), generator=generator).tolist() for n in lengths]
        outputs = engine.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
        assert all(len(out.new_token_ids) == 20 for out in outputs)
        for size in (1, 5, 16):  # decode-only batches of other sizes, eager when off-graph
            engine.generate(prompts[:size], SamplingParams(max_tokens=3, ignore_eos=True))
    finally:
        knobs.runtime.jit_cache_hook = previous
    assert compiled == []


def _plain(step):
    return step  # the decode-graph path's buffers and padding, replayed eagerly (CPU)


@pytest.mark.parametrize(
    ("config", "graphs"),
    [
        ({"max_num_batched_tokens": 24, "num_blocks": 64}, False),
        ({"max_num_batched_tokens": 24, "num_blocks": 64, "max_num_seqs": 5}, True),
        # 10 blocks of 16: preemption; the cache fills while steps are planned ahead.
        ({"max_num_batched_tokens": 64, "num_blocks": 10, "max_model_len": 160}, False),
    ],
    ids=["eager", "graphs", "preempt"],
)
def test_async_scheduling_equals_hf_greedy(make_model, config: dict, graphs: bool) -> None:
    """Steps launched before the previous step's tokens reach the host (their token ids read on
    the device) give HF's greedy tokens, with SplitFuse, prefix sharing, the decode-graph path
    and preemption; no block leaks."""
    model = make_model("llama")
    prompts = _prompts(model.config.vocab_size)
    expected = [_hf_greedy(model, prompt) for prompt in prompts]
    serving = ServingConfig(**config, async_scheduling=True)
    engine = ServingEngine(model, None, serving, capture=_plain if graphs else None)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [out.new_token_ids for out in outputs] == expected
    assert all(out.finish_reason == "length" for out in outputs)
    assert engine.stats.steps_ahead > NEW_TOKENS // 2  # the decode steps went ahead
    assert engine.scheduler.kv.pool.num_free == engine.scheduler.kv.pool.num_blocks


def test_async_scheduling_with_stops_and_aborts_equals_sync(make_model) -> None:
    """Requests that stop on a token (known only once sampled) or are cancelled between steps
    while the next step is already launched: the same outputs as without asynchronous
    scheduling (the extra token computed for them is dropped), and every block comes back."""
    model = make_model("llama")
    prompts = _prompts(model.config.vocab_size)
    greedy = [_hf_greedy(model, prompt) for prompt in prompts]
    # Stop on the 4th greedy token of prompt 1: prompt 1 stops there, others maybe on it too.
    params = SamplingParams(max_tokens=NEW_TOKENS, stop_token_ids=[greedy[1][3]], ignore_eos=True)

    def serve(async_scheduling: bool) -> tuple[dict[str, list[int]], dict[str, str], Any]:
        config = ServingConfig(
            max_num_batched_tokens=64, num_blocks=64, async_scheduling=async_scheduling
        )
        engine = ServingEngine(model, None, config)
        ids = [engine.add_request(prompt, params) for prompt in prompts]
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        reasons: dict[str, str] = {}
        steps = 0
        while engine.has_unfinished:
            outputs = engine.step()
            steps += 1
            if steps == 4:  # cancel one request mid-generation
                outputs.append(engine.abort(ids[2]))
            for out in outputs:
                if out is None:
                    continue
                tokens[out.request_id] += out.new_token_ids
                if out.finished:
                    reasons[out.request_id] = out.finish_reason
        engine.step()  # collects a step launched for requests that had all ended
        return tokens, reasons, engine

    sync_tokens, sync_reasons, _ = serve(False)
    async_tokens, async_reasons, engine = serve(True)
    assert async_tokens == sync_tokens
    assert async_reasons == sync_reasons
    assert "stop" in sync_reasons.values() and "abort" in sync_reasons.values()
    assert engine.stats.steps_ahead > 0
    assert engine.scheduler.kv.pool.num_free == engine.scheduler.kv.pool.num_blocks
