"""The CPU step's worker thread: jobs one at a time, oldest or (overlap_forward) newest first."""

from __future__ import annotations

import threading

import pytest

from slipstream.zero.offload import StepWorker


@pytest.mark.parametrize(("lifo", "expected"), [(False, [0, 1, 2, 3]), (True, [0, 3, 2, 1])])
def test_order_of_queued_jobs(lifo: bool, expected: list[int]) -> None:
    worker = StepWorker(lifo=lifo)
    gate, started = threading.Event(), threading.Event()
    ran: list[int] = []

    def job(n: int) -> None:
        if n == 0:
            started.set()
            gate.wait()  # the others queue behind the first
        ran.append(n)

    futures = [worker.submit(lambda: job(0))]
    assert started.wait(timeout=10)
    futures += [worker.submit(lambda n=n: job(n)) for n in range(1, 4)]
    gate.set()
    for future in futures:
        future.result(timeout=10)
    assert ran == expected
    worker.shutdown()


def test_errors_reach_the_waiter_and_shutdown_runs_what_is_queued() -> None:
    worker = StepWorker()
    gate = threading.Event()
    ran: list[int] = []

    def fail() -> None:
        raise ValueError("bucket 3 failed")

    worker.submit(gate.wait)
    failing = worker.submit(fail)
    last = worker.submit(lambda: ran.append(1))
    gate.set()
    with pytest.raises(ValueError, match="bucket 3"):
        failing.result(timeout=10)
    worker.shutdown()
    assert last.done() and ran == [1]
    with pytest.raises(RuntimeError, match="shut down"):
        worker.submit(lambda: None)


def test_newest_first_takes_the_newest_landed_job() -> None:
    # overlap_forward after backward: the newest bucket may still be on its way to the host.
    # The worker takes the newest job that is ready, and the oldest while none is.
    worker = StepWorker(lifo=True)
    gate, started = threading.Event(), threading.Event()
    landed = {1: True, 2: True, 3: False, 4: False}
    ran: list[int] = []

    def job(n: int) -> None:
        if n == 0:
            started.set()
            gate.wait()
        ran.append(n)
        if n == 2:
            landed[4] = True  # lands while job 2 runs: the newest, taken next

    futures = [worker.submit(lambda: job(0))]
    assert started.wait(timeout=10)
    futures += [worker.submit(lambda n=n: job(n), lambda n=n: landed[n]) for n in range(1, 5)]
    gate.set()
    for future in futures:
        future.result(timeout=10)
    # 2 (newest landed), then 4 (landed meanwhile), then 1 (landed), then 3 (none landed:
    # the oldest left).
    assert ran == [0, 2, 4, 1, 3]
    worker.shutdown()


def test_switch_interval_holds_while_the_worker_runs_and_is_restored() -> None:
    # offload_optimizer.gil_switch_interval_us: the worker's GIL waits are bounded by Python's
    # switch interval; the engine sets it while the worker runs and puts it back at shutdown.
    import sys

    before = sys.getswitchinterval()
    worker = StepWorker(switch_interval_s=2e-4)
    assert sys.getswitchinterval() == before  # nothing changes until a job starts the thread
    seen: list[float] = []
    worker.submit(lambda: seen.append(sys.getswitchinterval())).result(timeout=10)
    assert seen == [pytest.approx(2e-4)]
    worker.shutdown()
    assert sys.getswitchinterval() == pytest.approx(before)
    untouched = StepWorker()  # 0: Python's interval is left alone
    untouched.submit(lambda: seen.append(sys.getswitchinterval())).result(timeout=10)
    untouched.shutdown()
    assert seen[-1] == pytest.approx(before)


def _merge_run(lifo: bool, cap: int, landed: dict[int, bool], fail: bool = False):
    """Jobs 1-5 (10 elements each; job 4 steps with another function) queued behind a job
    that holds the worker; what each call stepped, in order, and the Futures."""
    from slipstream.zero.offload import BucketPart

    worker = StepWorker(lifo=lifo, merge_numel=cap)
    gate, started = threading.Event(), threading.Event()
    calls: list[list[int]] = []
    prepared: list[int] = []

    def step(indices: list[int]) -> None:
        if fail and len(indices) > 1:
            raise ValueError("merged step failed")
        calls.append(list(indices))

    def other(indices: list[int]) -> None:
        calls.append([-i for i in indices])

    def first() -> None:
        started.set()
        gate.wait()

    futures = [worker.submit(first)]
    assert started.wait(timeout=10)
    for n in range(1, 6):
        how = other if n == 4 else step
        part = BucketPart(lambda n=n: prepared.append(n), how, [n], 10)
        futures.append(
            worker.submit(
                lambda n=n, how=how: (prepared.append(n), how([n])), lambda n=n: landed[n], part
            )
        )
    gate.set()
    worker.shutdown()
    return calls, prepared, futures, worker.calls


def test_merged_jobs_share_one_step_call() -> None:
    # merge_bucket_size: the job taken next brings the jobs that would follow it while they
    # have landed, share its step function and keep within the element cap; each one's
    # prepare runs, then one step over all their indices.
    every = {n: True for n in range(1, 6)}
    calls, prepared, futures, count = _merge_run(False, 25, dict(every))
    # 1+2 (3 would pass 25 elements), 3 (4 steps otherwise), 4, 5.
    assert calls == [[1, 2], [3], [-4], [5]] and prepared == [1, 2, 3, 4, 5]
    assert all(f.done() and f.exception() is None for f in futures) and count == 5
    # Oldest first: a job that has not landed ends the merge (it is taken next, as before).
    calls, *_ = _merge_run(False, 100, {**every, 2: False})
    assert calls == [[1], [2, 3], [-4], [5]]
    # Newest landed first (overlap_forward after backward): 5, then down from 3.
    calls, *_ = _merge_run(True, 100, dict(every))
    assert calls == [[5], [-4], [3, 2, 1]]
    # Off (0): one call per job, whatever has landed.
    calls, *_ = _merge_run(False, 0, dict(every))
    assert calls == [[1], [2], [3], [-4], [5]]


def test_a_merged_call_that_fails_fails_each_of_its_jobs() -> None:
    calls, _, futures, _ = _merge_run(False, 100, {n: True for n in range(1, 6)}, fail=True)
    for merged in futures[1:4]:  # jobs 1-3 shared the call
        with pytest.raises(ValueError, match="merged step failed"):
            merged.result(timeout=10)
    assert futures[4].exception() is None and futures[5].exception() is None
    assert calls == [[-4], [5]]
