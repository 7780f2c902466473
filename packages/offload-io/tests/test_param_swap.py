"""ParamSwapStore: parameter shards swapped to files and read back around their use."""

from __future__ import annotations

import pytest
import torch

from slipstream.offload import ParamSwapStore
from slipstream.offload.swap import SwapSpace


@pytest.fixture(params=[True, False], ids=["direct", "buffered"])
def space(request, make_engine, tmp_path):
    engine = make_engine(block_size=128 * 1024, queue_depth=4, o_direct=request.param)
    with SwapSpace(tmp_path, engine, name="param", rank=0) as swap:
        yield swap


def _tensors(dtype: torch.dtype, sizes=(1, 5000, 70_001)) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(n, generator=gen) * 10).to(dtype) for n in sizes]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip(space, dtype) -> None:
    store = ParamSwapStore(space, max_in_cpu=0)
    tensors = _tensors(dtype)
    expected = [t.clone() for t in tensors]
    for index, tensor in enumerate(tensors):
        store.register(f"p{index}", tensor)
    store.finish()
    assert all(store.is_swapped(t) for t in tensors)
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    assert store.resident_numel == 0
    store.ensure(tensors)
    assert not any(store.is_swapped(t) for t in tensors)
    assert all(torch.equal(t, e) for t, e in zip(tensors, expected))
    store.release(tensors, dirty=False)  # clean: freed at once
    assert all(store.is_swapped(t) for t in tensors)
    store.ensure(tensors[1:2])
    assert torch.equal(tensors[1], expected[1]) and store.is_swapped(tensors[0])


def test_max_in_cpu_keeps_the_first_tensors_resident(space) -> None:
    store = ParamSwapStore(space, max_in_cpu=5001)
    tensors = _tensors(torch.float32)  # 1 + 5000 fit; 70_001 does not
    for index, tensor in enumerate(tensors):
        store.register(f"p{index}", tensor)
    store.finish()
    assert [store.is_swapped(t) for t in tensors] == [False, False, True]
    assert sorted(space.keys()) == ["p2"]  # kept tensors need no file
    store.release(tensors, dirty=True)
    store.finish()
    assert [store.is_swapped(t) for t in tensors] == [False, False, True]
    assert store.resident_numel == 5001


def test_dirty_write_back_is_visible_after_a_re_read(space) -> None:
    store = ParamSwapStore(space, max_in_cpu=0)
    tensors = _tensors(torch.bfloat16)
    for index, tensor in enumerate(tensors):
        store.register(f"p{index}", tensor)
    store.ensure(tensors)
    for tensor in tensors:
        tensor.add_(1.0)
    updated = [t.clone() for t in tensors]
    store.release(tensors, dirty=True)
    store.finish()  # the frees wait for the writes
    assert all(store.is_swapped(t) for t in tensors)
    store.ensure(tensors)
    assert all(torch.equal(t, u) for t, u in zip(tensors, updated))
    # A clean release after an edit would lose it: only dirty releases write.
    tensors[2].zero_()
    store.release(tensors, dirty=False)
    store.ensure(tensors)
    assert torch.equal(tensors[2], updated[2])


def test_ensure_during_a_dirty_write_keeps_the_memory(space) -> None:
    store = ParamSwapStore(space, max_in_cpu=0)
    (tensor,) = _tensors(torch.float32, sizes=(300_000,))
    store.register("p", tensor)
    store.ensure([tensor])
    tensor.mul_(2)
    expected = tensor.clone()
    store.release([tensor], dirty=True)
    store.ensure([tensor])  # the write may still be in flight: the bytes stay
    store.finish()
    assert not store.is_swapped(tensor)
    assert torch.equal(tensor, expected)
    store.release([tensor], dirty=False)
    store.finish()
    assert store.is_swapped(tensor)
    store.ensure([tensor])
    assert torch.equal(tensor, expected)


def test_prefetch_then_ensure(space) -> None:
    store = ParamSwapStore(space, max_in_cpu=0)
    tensors = _tensors(torch.float32)
    expected = [t.clone() for t in tensors]
    for index, tensor in enumerate(tensors):
        store.register(f"p{index}", tensor)
    store.finish()
    store.prefetch(tensors[1:])
    assert not store.is_swapped(tensors[1]) and store.is_swapped(tensors[0])
    store.ensure(tensors)
    assert all(torch.equal(t, e) for t, e in zip(tensors, expected))
    store.release(tensors, dirty=False)
    store.prefetch(tensors)
    store.release(tensors, dirty=False)  # released before use: the read is waited, then freed
    assert all(store.is_swapped(t) for t in tensors)


def test_registration_checks_and_close(space) -> None:
    store = ParamSwapStore(space, max_in_cpu=0)
    tensor = torch.ones(10_000)
    with pytest.raises(ValueError, match="own its whole storage"):
        store.register("view", tensor[:100])
    store.register("p", tensor)
    with pytest.raises(ValueError, match="already registered"):
        store.register("q", tensor)
    with pytest.raises(KeyError):
        store.ensure([torch.ones(3)])
    folder = space.path
    store.close()
    store.close()
    assert not folder.exists()
    with pytest.raises(RuntimeError, match="closed"):
        store.ensure([tensor])
