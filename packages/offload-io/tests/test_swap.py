"""Swap files: layout, round trips, header checks and cleanup."""

from __future__ import annotations

import os
import re
import struct
import zlib

import pytest
import torch

from slipstream.offload.aio.errors import SwapFileCorruptError
from slipstream.offload.pinned import aligned_empty
from slipstream.offload.swap import HEADER_BYTES, MAGIC, SwapSpace


@pytest.fixture(params=[True, False], ids=["direct", "buffered"])
def space(request, make_engine, tmp_path):
    engine = make_engine(block_size=128 * 1024, queue_depth=4, o_direct=request.param)
    with SwapSpace(tmp_path, engine, name="optim", rank=3) as swap:
        yield swap


def test_folder_name_and_layout(space, tmp_path) -> None:
    assert space.path.parent == tmp_path and space.path.is_dir()
    assert re.fullmatch(rf"slipstream-optim-rank3-{os.getpid()}-[0-9a-f]{{8}}", space.path.name)
    space.allocate("exp_avg.0", 1000, torch.bfloat16)
    file = space.path / "exp_avg.0.swap"
    header = file.read_bytes()[:HEADER_BYTES]
    fields = struct.Struct("<8sI32sQQ")
    magic, version, dtype, numel, nbytes = fields.unpack_from(header)
    assert magic == MAGIC
    assert (version, dtype.rstrip(b"\0"), numel, nbytes) == (1, b"bfloat16", 1000, 2000)
    (crc,) = struct.unpack_from("<I", header, fields.size)
    assert crc == zlib.crc32(header[: fields.size])
    padded = 4096 if space.engine.settings.o_direct else 2000
    assert file.stat().st_size == HEADER_BYTES + padded
    assert space.nbytes() == HEADER_BYTES + padded
    assert os.stat(file).st_blocks * 512 >= HEADER_BYTES + padded  # really reserved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_round_trip_keys(space, dtype) -> None:
    sizes = {"a": 1, "b": 4097, "c": 300_001}
    tensors = {}
    for index, (key, numel) in enumerate(sizes.items()):
        space.allocate(key, numel, dtype)
        gen = torch.Generator().manual_seed(index)
        tensors[key] = (torch.randn(numel, generator=gen) * 50).to(dtype)
    requests = [space.write(key, tensor) for key, tensor in tensors.items()]
    for request in requests:
        request.wait()
    outs = {key: aligned_empty(t.numel(), dtype).zero_() for key, t in tensors.items()}
    requests = [space.read(key, out) for key, out in outs.items()]
    for request in requests:
        request.wait()
    for key in sizes:
        assert torch.equal(outs[key], tensors[key])
    assert sorted(space.keys()) == ["a", "b", "c"]


def test_overwrite_key(space) -> None:
    space.allocate("p", 5000, torch.float32)
    space.write("p", torch.ones(5000)).wait()
    space.write("p", torch.full((5000,), 2.0)).wait()
    out = torch.zeros(5000)
    space.read("p", out).wait()
    assert torch.equal(out, torch.full((5000,), 2.0))


@pytest.mark.parametrize("key", ["", "../x", "a/b", ".hidden", "-x", "a b", "x" * 201, "é"])
def test_bad_keys(space, key) -> None:
    with pytest.raises(ValueError, match="invalid swap key"):
        space.allocate(key, 10, torch.float32)


def test_allocation_checks(space) -> None:
    space.allocate("k", 10, torch.float32)
    with pytest.raises(ValueError, match="already allocated"):
        space.allocate("k", 10, torch.float32)
    with pytest.raises(ValueError, match=r"torch.float16 × 10.*torch.float32 × 10"):
        space.write("k", torch.zeros(10, dtype=torch.float16))
    with pytest.raises(ValueError, match="× 11"):
        space.read("k", torch.zeros(11))
    with pytest.raises(KeyError, match="not allocated"):
        space.write("other", torch.zeros(10))


def _corrupt(space, key: str, position: int) -> None:
    file = space.path / f"{key}.swap"
    data = bytearray(file.read_bytes())
    data[position] ^= 0x40
    file.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("position", "message"),
    [
        (0, "magic"),
        (8, "format version"),  # version field: also breaks the checksum
        (20, "checksum"),  # inside the dtype name
        (60, "checksum"),  # the crc itself
    ],
)
def test_corrupt_header_is_detected(space, position, message) -> None:
    space.allocate("w", 2048, torch.float32)
    space.write("w", torch.randn(2048)).wait()
    _corrupt(space, "w", position)
    with pytest.raises(SwapFileCorruptError, match=message) as info:
        space.read("w", torch.zeros(2048))
    assert str(space.path / "w.swap") in str(info.value)


def test_header_for_other_shape_is_detected(space) -> None:
    space.allocate("x", 100, torch.float32)
    # A well-formed header with another shape (a stale file from another run, say).
    header = SwapSpace._header(torch.float32, 99, 396)
    with open(space.path / "x.swap", "r+b") as handle:
        handle.write(header)
    with pytest.raises(SwapFileCorruptError, match="numel 99 != 100"):
        space.read("x", torch.zeros(100))


def test_truncated_file_is_detected(space) -> None:
    space.allocate("t", 10_000, torch.float32)
    os.truncate(space.path / "t.swap", HEADER_BYTES + 100)
    with pytest.raises(SwapFileCorruptError, match="file size"):
        space.read("t", torch.zeros(10_000))
    (space.path / "t.swap").unlink()
    with pytest.raises(SwapFileCorruptError, match="missing"):
        space.read("t", torch.zeros(10_000))


def test_close_removes_everything(make_engine, tmp_path) -> None:
    engine = make_engine()
    space = SwapSpace(tmp_path, engine)
    space.allocate("a", 100_000, torch.float32)
    request = space.write("a", torch.randn(100_000))
    space.close()  # waits for the write, then removes the folder
    assert request.done()
    assert not space.path.exists()
    assert list(tmp_path.iterdir()) == []
    space.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        space.allocate("b", 1, torch.float32)


def test_garbage_collection_removes_folder(make_engine, tmp_path) -> None:
    import gc

    space = SwapSpace(tmp_path, make_engine())
    path = space.path
    del space
    gc.collect()
    assert not path.exists()


def test_nvme_swapper_checks_the_drive_has_room_up_front(space, monkeypatch) -> None:
    from collections import namedtuple

    from slipstream.offload import nvme
    from slipstream.offload.aio.errors import DiskFullError
    from slipstream.offload.nvme import NvmeStateSwapper
    from slipstream.offload.settings import OptimizerOffload

    params = [torch.nn.Parameter(torch.zeros(4096)), torch.nn.Parameter(torch.zeros(8))]
    optimizer = torch.optim.AdamW(params)
    swapper = NvmeStateSwapper(optimizer, space, OptimizerOffload(device="nvme", nvme_path="x"))
    # The tiny tensor stays in memory; the big one needs its master and two Adam states.
    assert swapper.check_room(2) == 4096 * 4 * 3
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(nvme.shutil, "disk_usage", lambda path: usage(1 << 30, 0, 100_000))
    assert swapper.check_room(2) == 49_152  # fits in 100,000 bytes for one rank...
    with pytest.raises(DiskFullError) as caught:  # ...not for three on the same drive
        swapper.check_room(2, ranks_sharing=3)
    message = str(caught.value)
    assert str(space.path) in message and "147,456 bytes" in message
    assert "100,000 bytes free" in message and "nvme_path" in message


class _LaggingWrite:
    """A write that reports itself unfinished until someone waits for it (a slow drive)."""

    def __init__(self, request) -> None:
        self._request = request
        self._waited = False

    def done(self) -> bool:
        return self._waited

    def wait(self) -> None:
        self._request.wait()
        self._waited = True


@pytest.mark.parametrize(
    ("buffer_count", "pipeline_read", "most_writing"),
    [(4, True, 2), (4, False, 3), (2, True, 0), (6, True, 4)],
)
def test_nvme_swapper_bounds_the_sub_groups_in_memory(
    space, monkeypatch, buffer_count, pipeline_read, most_writing
) -> None:
    """With a drive slower than the step, at most ``buffer_count`` sub-groups are in memory
    (stepping, read ahead, being written); the step waits for the oldest write instead."""
    from slipstream.offload.host_optimizer import HostOptimizer
    from slipstream.offload.nvme import NvmeStateSwapper
    from slipstream.offload.settings import OptimizerOffload

    numel, count = 4096, 12  # one parameter per sub-group
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(count)]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    settings = OptimizerOffload(
        device="nvme",
        nvme_path="x",
        sub_group_numel=numel,
        buffer_count=buffer_count,
        pipeline_read=pipeline_read,
        pipeline_write=True,
    )
    optimizer = torch.optim.AdamW(params, lr=0.01)
    swapper = NvmeStateSwapper(optimizer, space, settings)
    assert swapper.max_writing == most_writing
    write = space.write
    monkeypatch.setattr(space, "write", lambda key, tensor: _LaggingWrite(write(key, tensor)))
    host = HostOptimizer(optimizer, settings, swapper=swapper, announce=False)
    swapper.evict_all()
    per_group = numel * 4 * 3  # master, exp_avg, exp_avg_sq
    seen: list[int] = []
    ref_opt = torch.optim.AdamW(reference, lr=0.01)
    for step in range(2):
        for p, q in zip(params, reference):
            p.grad = q.grad = torch.randn(numel, generator=torch.Generator().manual_seed(step))
        host.step(on_sub_group=lambda chunk: seen.append(swapper.resident_bytes))
        ref_opt.step()
        assert swapper.resident_bytes == 0  # the step ends with everything written
    # after each sub-group's step: itself, the one read ahead, and the writes still in flight
    assert max(seen) <= (1 + int(pipeline_read) + most_writing) * per_group
    assert max(seen) <= buffer_count * per_group or buffer_count < 1 + int(pipeline_read)
    with swapper.resident():
        for p, q in zip(params, reference):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
