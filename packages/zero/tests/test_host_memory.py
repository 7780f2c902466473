"""HostArena: exact-size host tensors carved from power-of-two blocks."""

from __future__ import annotations

import pytest
import torch

from slipstream.zero.host_memory import HostArena


class _PlainArena(HostArena):
    """The arena's packing over plain memory (no GPU here to page-lock with)."""

    def __init__(self, expected_bytes: int) -> None:
        super().__init__(pin=False, expected_bytes=expected_bytes)
        self.pin = True
        self.sizes: list[int] = []

    def _new_block(self, nbytes: int) -> torch.Tensor:
        self.sizes.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)


def test_unpinned_arena_is_plain_empty() -> None:
    arena = HostArena(pin=False, expected_bytes=1 << 20)
    t = arena.empty((3, 5), torch.float32)
    assert t.shape == (3, 5) and t.dtype == torch.float32
    assert t.untyped_storage().nbytes() == 60  # a storage of its own, exact
    assert arena.reserved_bytes == 0


def test_views_are_exact_aligned_and_independent() -> None:
    arena = _PlainArena(expected_bytes=100_000)
    assert arena.block_bytes == 131072  # next power of two of the hint
    shapes = [((7, 3), torch.float32), ((1000,), torch.bfloat16), ((5,), torch.float64)]
    tensors = [arena.empty(shape, dtype) for shape, dtype in shapes]
    for (shape, dtype), t in zip(shapes, tensors):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert (t.data_ptr() - t.untyped_storage().data_ptr()) % 4096 == 0
    for i, t in enumerate(tensors):
        t.fill_(i + 1)
    for i, t in enumerate(tensors):
        assert torch.all(t == i + 1)  # no view overlaps another
    assert len(arena.sizes) == 1
    assert arena.requested_bytes == 84 + 2000 + 40


def test_first_fit_packs_tails_and_oversized_requests_get_their_own_block() -> None:
    mib = 1 << 20
    arena = _PlainArena(expected_bytes=4 * mib)
    assert arena.block_bytes == 4 * mib
    a = arena.empty((3 * mib,), torch.uint8)  # block 1: 1 MiB left
    b = arena.empty((2 * mib,), torch.uint8)  # does not fit there: block 2, 2 MiB left
    c = arena.empty((mib,), torch.uint8)  # fits block 1's tail
    d = arena.empty((9 * mib,), torch.uint8)  # larger than a block: its own 16 MiB
    e = arena.empty((2 * mib,), torch.uint8)  # block 2's tail
    assert arena.sizes == [4 * mib, 4 * mib, 16 * mib]
    assert c.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    assert e.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert d.numel() == 9 * mib
    # what the old one-allocation-per-tensor path would have reserved: 4+2+1+16+2 MiB
    assert arena.reserved_bytes == 24 * mib < 25 * mib


def test_block_size_is_bounded() -> None:
    assert HostArena(pin=False).block_bytes == 1 << 16
    assert HostArena(pin=False, expected_bytes=10**12).block_bytes == 1 << 30


def test_empty_tensor() -> None:
    arena = _PlainArena(expected_bytes=0)
    assert arena.empty((0, 4), torch.float32).shape == (0, 4)
    assert arena.sizes == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device")
def test_pinned_arena_on_a_gpu() -> None:
    """Pinned, asynchronous both ways, and far less page-locked memory than one pinned
    tensor per shard (13b-like shapes at 1/16 scale)."""
    sizes = [320 * 5120, 5120 * 5120 // 16, 2 * 13824 * 5120 // 16, 13824 * 5120 // 16] * 4
    arena = HostArena(pin=True, expected_bytes=4 * sum(sizes))
    hosts = [arena.empty((n,), torch.float32) for n in sizes]
    assert all(h.is_pinned() for h in hosts)
    rounded = sum(1 << (4 * n - 1).bit_length() for n in sizes)
    assert arena.reserved_bytes < 0.8 * rounded
    assert arena.reserved_bytes < 1.25 * arena.requested_bytes + (1 << 30)
    device = [torch.randn(n, device="cuda") for n in sizes]
    for h, d in zip(hosts, device):
        h.copy_(d, non_blocking=True)
    torch.cuda.synchronize()
    back = [h.to("cuda", non_blocking=True) for h in hosts]
    assert all(torch.equal(b, d) for b, d in zip(back, device))
