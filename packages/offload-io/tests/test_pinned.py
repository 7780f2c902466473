"""Aligned host buffers and the buffer pool."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from slipstream.offload.pinned import PinnedBufferPool, aligned_empty


@pytest.mark.parametrize("alignment", [64, 4096, 65536])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float64])
@pytest.mark.parametrize("numel", [0, 1, 4097, 100_000])
def test_aligned_empty(numel: int, dtype: torch.dtype, alignment: int) -> None:
    tensor = aligned_empty(numel, dtype, alignment=alignment)
    assert tensor.data_ptr() % alignment == 0 or numel == 0
    assert tensor.numel() == numel and tensor.dtype == dtype
    assert tensor.device.type == "cpu" and tensor.is_contiguous()
    tensor.fill_(1)  # the whole range is writable memory
    assert int(tensor.double().sum().item()) == numel


def test_aligned_empty_survives_its_base_going_out_of_scope() -> None:
    tensor = aligned_empty(1 << 20, torch.float32)
    tensor.fill_(3.0)
    del_ptr = tensor.data_ptr()
    import gc

    gc.collect()
    assert tensor.data_ptr() == del_ptr and float(tensor[-1]) == 3.0


def test_aligned_empty_pin_without_cuda_is_plain_memory() -> None:
    tensor = aligned_empty(1000, torch.float16, pin=True)
    assert tensor.data_ptr() % 4096 == 0
    assert tensor.is_pinned() == torch.cuda.is_available()


def test_aligned_empty_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="power of two"):
        aligned_empty(10, torch.float32, alignment=3000)
    with pytest.raises(ValueError, match="numel"):
        aligned_empty(-1, torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        aligned_empty(10, torch.float64, alignment=4)


def test_pool_hands_out_distinct_aligned_buffers() -> None:
    pool = PinnedBufferPool(3, 10_000)
    assert (pool.count, pool.nbytes) == (3, 10_000)
    buffers = [pool.acquire() for _ in range(3)]
    assert len({b.data_ptr() for b in buffers}) == 3
    for buffer in buffers:
        assert buffer.dtype == torch.uint8 and buffer.numel() == 10_000
        assert buffer.data_ptr() % 4096 == 0
    assert pool.available() == 0
    for buffer in buffers:
        pool.release(buffer)
    assert pool.available() == 3


def test_pool_timeout_message() -> None:
    pool = PinnedBufferPool(1, 4096)
    held = pool.acquire()
    start = time.perf_counter()
    with pytest.raises(TimeoutError, match=r"no free buffer in the pool of 1 × 4,096 bytes"):
        pool.acquire(timeout=0.05)
    assert time.perf_counter() - start >= 0.04
    pool.release(held)
    assert pool.acquire(timeout=0).data_ptr() == held.data_ptr()


def test_pool_release_errors() -> None:
    pool = PinnedBufferPool(2, 4096)
    with pytest.raises(ValueError, match="not acquired from this pool"):
        pool.release(torch.empty(4096, dtype=torch.uint8))
    other = PinnedBufferPool(1, 4096).acquire()
    with pytest.raises(ValueError, match="not acquired from this pool"):
        pool.release(other)
    buffer = pool.acquire()
    pool.release(buffer)
    with pytest.raises(ValueError, match="released twice"):
        pool.release(buffer)
    assert pool.available() == 2


def test_pool_acquire_blocks_until_release() -> None:
    pool = PinnedBufferPool(1, 4096)
    held = pool.acquire()
    got: list[torch.Tensor] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(timeout=5)))
    waiter.start()
    time.sleep(0.05)
    assert not got  # still blocked
    pool.release(held)
    waiter.join(timeout=5)
    assert got and got[0].data_ptr() == held.data_ptr()


def test_pool_is_thread_safe() -> None:
    pool = PinnedBufferPool(3, 4096)
    in_use: set[int] = set()
    guard = threading.Lock()
    errors: list[str] = []

    def worker() -> None:
        for _ in range(300):
            buffer = pool.acquire(timeout=10)
            with guard:
                if buffer.data_ptr() in in_use:
                    errors.append("a buffer was handed out twice")
                in_use.add(buffer.data_ptr())
            with guard:
                in_use.discard(buffer.data_ptr())
            pool.release(buffer)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert pool.available() == 3


def test_pool_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="count"):
        PinnedBufferPool(0, 4096)
    with pytest.raises(ValueError, match="nbytes"):
        PinnedBufferPool(1, 0)
