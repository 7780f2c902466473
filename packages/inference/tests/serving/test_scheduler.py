"""Scheduler and paged KV cache invariants, without a model: token budget, chunked prefill,
prefix sharing, and no leaked blocks after any mix of finish / cancel / preempt."""

from __future__ import annotations

import random

import pytest

from slipstream.inference.serving.block_pool import BlockPool
from slipstream.inference.serving.request import Request, RequestStatus, SamplingParams
from slipstream.inference.serving.scheduler import Scheduler, SchedulerOutput

BLOCK = 4


def _scheduler(num_blocks: int = 64, budget: int = 16, seqs: int = 8, caching: bool = True):
    return Scheduler(
        num_blocks=num_blocks,
        block_size=BLOCK,
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        max_model_len=64,
        enable_prefix_caching=caching,
    )


def _request(rid: str, prompt: list[int], max_tokens: int = 4, eos: int | None = None) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), eos_token_id=eos)


def _check_blocks(scheduler: Scheduler) -> None:
    """Every block's reference count equals the number of block tables naming it."""
    pool = scheduler.kv.pool
    counts = [0] * pool.num_blocks
    for table in scheduler.kv.block_tables.values():
        for block in table:
            counts[block] += 1
    assert counts == pool.ref_counts
    assert pool.num_free == sum(1 for c in counts if c == 0)
    assert set(scheduler.kv.block_tables) == {r.request_id for r in scheduler.running}


def _run_step(scheduler: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list[Request]]:
    out = scheduler.schedule()
    for chunk in out.chunks:  # every chunk has room for its tokens
        assert len(chunk.block_table) * BLOCK >= chunk.start + len(chunk.token_ids)
    sampled = {c.request_id: token for c in out.chunks if c.samples}
    return out, scheduler.update(out, sampled)


def test_long_prompt_is_split_and_fused_with_decodes() -> None:
    scheduler = _scheduler(budget=8)
    scheduler.add_request(_request("short", [1, 2, 3], max_tokens=10))
    out, _ = _run_step(scheduler)
    assert [(c.request_id, len(c.token_ids), c.samples) for c in out.chunks] == [("short", 3, True)]
    scheduler.add_request(_request("long", list(range(100, 120)), max_tokens=2))
    sizes = []
    while "long" in scheduler.requests and scheduler.requests["long"].num_output_tokens == 0:
        out, _ = _run_step(scheduler)
        assert out.num_tokens <= 8
        sizes.append([(c.request_id, len(c.token_ids)) for c in out.chunks])
    # The decode of "short" rides along every step; the 20-token prompt fills the rest: 7+7+6.
    assert sizes == [
        [("short", 1), ("long", 7)],
        [("short", 1), ("long", 7)],
        [("short", 1), ("long", 6)],
    ]


def test_prefix_blocks_are_shared_and_freed() -> None:
    scheduler = _scheduler()
    prefix = list(range(10, 22))  # three full blocks
    scheduler.add_request(_request("a", [*prefix, 1, 2], max_tokens=1))
    _run_step(scheduler)
    assert "a" not in scheduler.requests  # finished after one token: blocks freed but cached
    assert scheduler.kv.pool.num_free == 64
    scheduler.add_request(_request("b", [*prefix, 3], max_tokens=3))
    scheduler.add_request(_request("c", [*prefix, 4, 5, 6, 7, 8], max_tokens=3))
    out, _ = _run_step(scheduler)
    b, c = scheduler.requests["b"], scheduler.requests["c"]
    assert b.num_cached_prompt_tokens == 12 and c.num_cached_prompt_tokens == 12
    assert [len(chunk.token_ids) for chunk in out.chunks] == [1, 5]
    table_b, table_c = scheduler.kv.block_tables["b"], scheduler.kv.block_tables["c"]
    assert table_b[:3] == table_c[:3]
    assert all(scheduler.kv.pool.ref_counts[block] == 2 for block in table_b[:3])
    _check_blocks(scheduler)
    scheduler.finish("b", RequestStatus.FINISHED_ABORTED)
    assert all(scheduler.kv.pool.ref_counts[block] == 1 for block in table_c[:3])
    while scheduler.num_unfinished:
        _run_step(scheduler)
    assert scheduler.kv.pool.num_free == 64 and not scheduler.kv.block_tables


def test_fully_cached_prompt_still_computes_its_last_token() -> None:
    scheduler = _scheduler()
    prompt = list(range(8))  # exactly two blocks
    scheduler.add_request(_request("a", prompt, max_tokens=1))
    _run_step(scheduler)
    scheduler.add_request(_request("b", prompt, max_tokens=1))
    out, _ = _run_step(scheduler)
    assert out.chunks[0].start == 4 and out.chunks[0].token_ids == prompt[4:]


def test_cache_full_queues_then_preempts_with_recompute() -> None:
    # 6 blocks of 4 = 24 token slots; two requests growing to 20 tokens each cannot both fit.
    scheduler = Scheduler(
        num_blocks=6,
        block_size=BLOCK,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        max_model_len=24,
        enable_prefix_caching=False,
    )
    scheduler.add_request(_request("a", list(range(10)), max_tokens=10))
    scheduler.add_request(_request("b", list(range(50, 60)), max_tokens=10))
    preempted, outputs = [], {}
    for _ in range(100):
        if not scheduler.num_unfinished:
            break
        out, finished = _run_step(scheduler)
        _check_blocks(scheduler)
        preempted += out.preempted
        outputs.update({r.request_id: r for r in finished})
    assert preempted == ["b"]
    assert outputs["b"].num_preemptions == 1 and outputs["b"].num_output_tokens == 10
    assert outputs["a"].num_output_tokens == 10
    assert scheduler.kv.pool.num_free == 6


def test_stop_conditions_and_validation() -> None:
    scheduler = _scheduler()
    scheduler.add_request(_request("eos", [1, 2], max_tokens=10, eos=7))
    _, finished = _run_step(scheduler, token=7)
    assert finished[0].status is RequestStatus.FINISHED_STOPPED
    with pytest.raises(ValueError, match="max_model_len=64"):
        scheduler.add_request(_request("long", list(range(64))))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="fewer than one request"):
        Scheduler(
            num_blocks=2, block_size=4, max_num_batched_tokens=8, max_num_seqs=2, max_model_len=64
        )


@pytest.mark.parametrize("caching", [True, False])
def test_random_workload_respects_budget_and_leaks_no_blocks(caching: bool) -> None:
    rng = random.Random(1234)
    budget = 12
    scheduler = _scheduler(num_blocks=20, budget=budget, seqs=5, caching=caching)
    prefixes = [[rng.randrange(50) for _ in range(8)] for _ in range(3)]
    next_id, preemptions, cancelled, done = 0, 0, 0, 0
    for step in range(600):
        if step < 450 and rng.random() < 0.35:
            prompt = rng.choice(prefixes)[: rng.randrange(9)] + [
                rng.randrange(50) for _ in range(rng.randrange(1, 30))
            ]
            scheduler.add_request(
                _request(f"r{next_id}", prompt, max_tokens=rng.randrange(1, 20), eos=3)
            )
            next_id += 1
        if scheduler.requests and rng.random() < 0.05:
            victim = rng.choice(sorted(scheduler.requests))
            scheduler.finish(victim, RequestStatus.FINISHED_ABORTED)
            cancelled += 1
        out = scheduler.schedule()
        assert out.num_tokens <= budget
        assert len(scheduler.running) <= 5
        assert len({c.request_id for c in out.chunks}) == len(out.chunks)
        for chunk in out.chunks:
            request = scheduler.requests[chunk.request_id]
            assert (
                chunk.token_ids
                == request.token_ids[chunk.start : chunk.start + len(chunk.token_ids)]
            )
            assert len(chunk.block_table) * BLOCK >= chunk.start + len(chunk.token_ids)
        sampled = {c.request_id: rng.randrange(50) for c in out.chunks if c.samples}
        done += len(scheduler.update(out, sampled))
        preemptions += len(out.preempted)
        _check_blocks(scheduler)
    assert scheduler.num_unfinished == 0, "every request finishes once arrivals stop"
    assert scheduler.kv.pool.num_free == 20 and not scheduler.kv.block_tables
    assert done + cancelled == next_id
    assert preemptions > 0 and cancelled > 0  # the mix really exercised both paths


def test_block_pool_lru_revives_and_evicts() -> None:
    pool = BlockPool(3)
    first = pool.allocate(2)
    pool.register(first[0], b"h0")
    pool.free(reversed(first))
    assert pool.lookup(b"h0") == first[0]
    pool.touch([first[0]])  # revived from the free queue
    assert pool.num_free == 2 and pool.ref_counts[first[0]] == 1
    pool.free([first[0]])
    pool.allocate(3)  # hands out every block, evicting the cached one
    assert pool.lookup(b"h0") is None
    with pytest.raises(RuntimeError, match="asked for 1 blocks with 0 free"):
        pool.allocate(1)


def test_schedule_ahead_plans_decodes_and_hashes_only_known_tokens() -> None:
    """Asynchronous scheduling: the step after a plan, planned before its tokens are sampled —
    one placeholder token per continuing request at the next position, requests the plan ends
    by length left out, nothing planned while requests wait; a block the unknown token
    completes is indexed for prefix caching only once that token is known."""
    scheduler = _scheduler()
    a = _request("a", list(range(1, 4)), max_tokens=4)  # 3 tokens: the 4th fills a block
    b = _request("b", [9, 8], max_tokens=1)  # ends by length with its first token
    scheduler.add_request(a)
    scheduler.add_request(b)
    plan = scheduler.schedule()
    ahead = scheduler.schedule_ahead(plan)
    assert ahead is not None and [c.request_id for c in ahead.chunks] == ["a"]
    chunk = ahead.chunks[0]
    assert (chunk.token_ids, chunk.start, chunk.samples) == ([0], 3, True)
    scheduler.update(plan, {"a": 77, "b": 5})  # b finishes; a's 4th token (position 3) is 77
    scheduler.update(ahead, {"a": 78})
    _check_blocks(scheduler)
    plan = scheduler.schedule()  # a's next decode indexes its now-known first block
    c = _request("c", [1, 2, 3, 77, 6])
    assert scheduler.kv.computed_blocks(c) == scheduler.kv.block_table(a)[:1]
    # Nothing is planned ahead while a request waits (the regular step admits it).
    scheduler.add_request(_request("d", [4, 4]))
    assert scheduler.schedule_ahead(plan) is None
