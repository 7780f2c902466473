"""The aio engine: settings, transfer planning, and round trips on both backends."""

from __future__ import annotations

import asyncio
import errno
import logging
import os

import pytest
import torch

from slipstream.offload.aio import asyncio_api
from slipstream.offload.aio import engine as engine_module
from slipstream.offload.aio.config import AioSettings
from slipstream.offload.aio.engine import AsyncIOEngine, plan_ops
from slipstream.offload.aio.errors import OffloadIOError
from slipstream.offload.pinned import aligned_empty

MiB = 1024 * 1024
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8)
NUMELS = (1, 4095, 4097, 3 * MiB + 7)


def random_tensor(numel: int, dtype: torch.dtype, *, aligned: bool, seed: int = 0) -> torch.Tensor:
    """A random tensor whose data_ptr is 4096-aligned or deliberately not."""
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        values = torch.randn(numel, generator=gen).to(dtype)
    else:
        values = torch.randint(-128, 128, (numel,), generator=gen, dtype=torch.int64).to(dtype)
    if aligned:
        out = aligned_empty(numel, dtype)
    else:
        out = aligned_empty(numel + 1, dtype)[1:]
    out.copy_(values)
    assert (out.data_ptr() % 4096 == 0) == aligned
    return out


def empty_like(tensor: torch.Tensor, *, aligned: bool) -> torch.Tensor:
    numel = tensor.numel()
    if aligned:
        out = aligned_empty(numel, tensor.dtype)
    else:
        out = aligned_empty(numel + 1, tensor.dtype)[1:]
    out.fill_(0)
    return out


# -- settings ------------------------------------------------------------------------------
def test_settings_defaults_match_deepspeed() -> None:
    s = AioSettings()
    assert (s.block_size, s.queue_depth, s.intra_op_parallelism) == (1048576, 8, 1)
    assert (s.single_submit, s.overlap_events, s.use_gds, s.o_direct) == (False, True, False, True)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("block_size", 0),
        ("block_size", -4096),
        ("queue_depth", 0),
        ("intra_op_parallelism", -1),
        ("queue_depth", 2.5),
        ("queue_depth", True),
        ("o_direct", "yes"),
    ],
)
def test_settings_reject_bad_values(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=key) as info:
        AioSettings(**{key: value})  # type: ignore[arg-type]
    assert repr(value) in str(info.value)


def test_block_size_alignment_only_matters_with_o_direct() -> None:
    with pytest.raises(ValueError, match=r"block_size must be a multiple of 4096.*1000"):
        AioSettings(block_size=1000)
    assert AioSettings(block_size=1000, o_direct=False).block_size == 1000


def test_use_gds_is_refused_clearly() -> None:
    with pytest.raises(NotImplementedError, match="use_gds"):
        AioSettings(use_gds=True)
    with pytest.raises(NotImplementedError, match="use_gds"):
        AioSettings.from_dict({"use_gds": True})


def test_from_dict() -> None:
    assert AioSettings.from_dict(None) == AioSettings()
    assert AioSettings.from_dict({}) == AioSettings()
    s = AioSettings.from_dict(
        {"block_size": 262144, "queue_depth": 4, "thread_count": 3, "single_submit": True}
    )
    assert (s.block_size, s.queue_depth, s.intra_op_parallelism, s.single_submit) == (
        262144,
        4,
        3,
        True,
    )
    assert AioSettings.from_dict({"intra_op_parallelism": 2}).intra_op_parallelism == 2
    with pytest.raises(ValueError, match="given twice"):
        AioSettings.from_dict({"thread_count": 2, "intra_op_parallelism": 2})
    with pytest.raises(ValueError, match="'queue_size'") as info:
        AioSettings.from_dict({"queue_size": 8})
    assert "queue_depth" in str(info.value) and "o_direct" in str(info.value)
    with pytest.raises(ValueError, match="block_size"):
        AioSettings.from_dict({"block_size": 100})


def test_settings_are_frozen() -> None:
    with pytest.raises((AttributeError, TypeError)):
        AioSettings().block_size = 4096  # type: ignore[misc]


# -- planning ------------------------------------------------------------------------------
def test_plan_aligned_body_direct_tail_staged() -> None:
    ops = plan_ops(8192, 3 * 4096 + 100, 4096, direct=True, block_size=8192)
    assert [(o.ptr, o.io_len, o.need, o.offset, o.staged) for o in ops] == [
        (8192, 8192, 8192, 4096, False),
        (8192 + 8192, 4096, 4096, 4096 + 8192, False),
        (8192 + 12288, 4096, 100, 4096 + 12288, True),
    ]


def test_plan_unaligned_is_all_staged_and_padded() -> None:
    ops = plan_ops(8193, 10000, 0, direct=True, block_size=8192)
    assert [(o.ptr, o.io_len, o.need, o.offset, o.staged) for o in ops] == [
        (8193, 8192, 8192, 0, True),
        (8193 + 8192, 4096, 1808, 8192, True),
    ]


def test_plan_buffered_is_exact() -> None:
    ops = plan_ops(7, 2500, 13, direct=False, block_size=1000)
    assert [(o.io_len, o.need, o.offset, o.staged) for o in ops] == [
        (1000, 1000, 13, False),
        (1000, 1000, 1013, False),
        (500, 500, 2013, False),
    ]
    assert plan_ops(7, 0, 0, direct=True, block_size=4096) == []


# -- round trips ---------------------------------------------------------------------------
@pytest.mark.parametrize("o_direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("numel", NUMELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip(make_engine, tmp_path, dtype, numel, aligned, o_direct) -> None:
    if numel > MiB and dtype != torch.int8 and not aligned:
        numel = numel // 3  # keep the big unaligned fp cases a little smaller: same code path
    engine = make_engine(
        block_size=256 * 1024, queue_depth=4, intra_op_parallelism=2, o_direct=o_direct
    )
    source = random_tensor(numel, dtype, aligned=aligned, seed=numel)
    snapshot = source.clone()
    target = empty_like(source, aligned=aligned)
    path = tmp_path / "t.bin"
    offset = 3 * 4096
    request = engine.write(source, path, offset)
    request.wait()
    assert request.done()
    assert torch.equal(source, snapshot)  # the write did not touch the source

    nbytes = numel * source.element_size()
    padded = -(-nbytes // 4096) * 4096 if o_direct else nbytes
    assert path.stat().st_size == offset + padded
    raw = path.read_bytes()
    assert raw[offset : offset + nbytes] == source.view(torch.uint8).numpy().tobytes()
    assert raw[offset + nbytes :] == b"\x00" * (padded - nbytes)  # padding is zeros

    engine.read(target, path, offset).wait()
    assert torch.equal(target.view(torch.uint8), source.view(torch.uint8))


def test_buffered_allows_any_offset(make_engine, tmp_path) -> None:
    engine = make_engine(o_direct=False, block_size=1000)
    source = random_tensor(3001, torch.float16, aligned=False)
    engine.write(source, tmp_path / "f", 1234).wait()
    target = empty_like(source, aligned=True)
    engine.read(target, tmp_path / "f", 1234).wait()
    assert torch.equal(source, target)
    assert (tmp_path / "f").read_bytes()[:1234] == b"\x00" * 1234


@pytest.mark.parametrize(
    "submit",
    [{}, {"single_submit": True}, {"overlap_events": False}, {"queue_depth": 1}],
    ids=["batched", "single_submit", "no_overlap", "depth1"],
)
def test_many_requests_in_flight(make_engine, tmp_path, submit) -> None:
    settings = {"block_size": 64 * 1024, "queue_depth": 4, "intra_op_parallelism": 2, **submit}
    engine = make_engine(**settings)
    sources = [
        random_tensor(50_000 + i * 977, torch.float32, aligned=i % 2 == 0, seed=i) for i in range(8)
    ]
    slot = 1024 * 1024  # each tensor at its own aligned offset of one shared file
    writes = [engine.write(t, tmp_path / "shared", i * slot) for i, t in enumerate(sources)]
    writes += [engine.write(t, tmp_path / f"own{i}", 0) for i, t in enumerate(sources)]
    engine.wait_all()
    assert all(w.done() for w in writes)
    targets = [empty_like(t, aligned=i % 2 == 1) for i, t in enumerate(sources)]
    others = [empty_like(t, aligned=True) for t in sources]
    reads = [engine.read(t, tmp_path / "shared", i * slot) for i, t in enumerate(targets)]
    reads += [engine.read(t, tmp_path / f"own{i}", 0) for i, t in enumerate(others)]
    for request in reads:
        request.wait()
    for source, target, other in zip(sources, targets, others):
        assert torch.equal(source, target)
        assert torch.equal(source, other)


def test_write_does_not_truncate(make_engine, tmp_path) -> None:
    engine = make_engine()
    path = tmp_path / "f"
    big = random_tensor(4 * 4096, torch.int8, aligned=True)
    engine.write(big, path, 0).wait()
    small = random_tensor(10, torch.int8, aligned=True, seed=5)
    engine.write(small, path, 0).wait()
    data = path.read_bytes()
    assert len(data) == 4 * 4096
    assert data[:10] == small.numpy().tobytes()
    assert data[4096:] == big.numpy().tobytes()[4096:]


def test_zero_size_tensor(make_engine, tmp_path) -> None:
    engine = make_engine()
    request = engine.write(torch.empty(0), tmp_path / "z", 0)
    request.wait()
    assert request.done() and (tmp_path / "z").exists()
    engine.read(torch.empty(0), tmp_path / "z", 0).wait()


def test_request_checks(make_engine, tmp_path) -> None:
    engine = make_engine()
    with pytest.raises(ValueError, match="contiguous"):
        engine.write(torch.zeros(8, 8).t(), tmp_path / "f")
    with pytest.raises(ValueError, match="multiple of 4096"):
        engine.write(torch.zeros(8), tmp_path / "f", 100)
    with pytest.raises(OffloadIOError, match="must exist") as info:
        engine.read(torch.zeros(8), tmp_path / "missing")
    assert info.value.errno == errno.ENOENT
    assert str(tmp_path / "missing") in str(info.value)


def test_read_past_end_of_file_raises(make_engine, tmp_path) -> None:
    engine = make_engine()
    engine.write(random_tensor(4096, torch.int8, aligned=True), tmp_path / "f").wait()
    request = engine.read(torch.zeros(3 * 4096, dtype=torch.int8), tmp_path / "f")
    with pytest.raises(OffloadIOError, match="end of the file") as info:
        request.wait()
    with pytest.raises(OffloadIOError, match="end of the file"):
        request.wait()  # the error sticks
    assert info.value.errno == errno.EIO


def test_close_and_context_manager(backend, tmp_path) -> None:
    with AsyncIOEngine(backend=backend) as engine:
        request = engine.write(random_tensor(9000, torch.float32, aligned=True), tmp_path / "f")
    assert request.done()
    with pytest.raises(RuntimeError, match="closed"):
        engine.write(torch.zeros(4), tmp_path / "f")
    engine.close()  # idempotent


def test_auto_falls_back_with_one_warning(monkeypatch, caplog) -> None:
    def broken(*args, **kwargs):
        raise ImportError("no compiler here")

    monkeypatch.setattr("slipstream.offload.build.load_aio", broken)
    monkeypatch.setattr(engine_module, "_fallback_warned", False)
    with caplog.at_level(logging.WARNING, logger=engine_module.__name__):
        first = AsyncIOEngine(backend="auto")
        second = AsyncIOEngine(backend="auto")
    assert first.backend_name == second.backend_name == "python"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "no compiler here" in warnings[0].getMessage()
    assert "python -m slipstream.offload.build" in warnings[0].getMessage()
    with pytest.raises(ImportError, match="cpp aio backend is unavailable"):
        AsyncIOEngine(backend="cpp")
    first.close()
    second.close()


def test_unknown_backend() -> None:
    with pytest.raises(ValueError, match="'gpu'"):
        AsyncIOEngine(backend="gpu")


def test_auto_prefers_cpp(cpp_ready) -> None:
    if not cpp_ready:
        pytest.skip("no C++ compiler on PATH")
    with AsyncIOEngine() as engine:
        assert engine.backend_name == "cpp"


def test_build_module(cpp_ready, capsys) -> None:
    from slipstream.offload import build

    ok, _ = build.aio_probe()
    assert ok == cpp_ready
    if not cpp_ready:
        pytest.skip("no C++ compiler on PATH")
    assert build.main([]) == 0
    out = capsys.readouterr().out
    assert "slipstream_offload_aio: built at" in out
    assert os.path.isfile(out.split("built at ")[1].strip())


# -- asyncio API ---------------------------------------------------------------------------
@pytest.mark.parametrize("o_direct", [True, False], ids=["direct", "aiofiles"])
def test_asyncio_save_load(make_engine, tmp_path, o_direct) -> None:
    engine = make_engine(o_direct=o_direct)
    sources = [random_tensor(5000 + i, torch.bfloat16, aligned=i == 0, seed=i) for i in range(3)]
    targets = [empty_like(t, aligned=False) for t in sources]

    async def main() -> None:
        await asyncio.gather(
            *(
                asyncio_api.save_tensor(tmp_path / f"t{i}", t, engine=engine)
                for i, t in enumerate(sources)
            )
        )
        await asyncio.gather(
            *(
                asyncio_api.load_tensor(tmp_path / f"t{i}", t, engine=engine)
                for i, t in enumerate(targets)
            )
        )

    asyncio.run(main())
    for source, target in zip(sources, targets):
        assert torch.equal(source, target)
    if not o_direct:
        assert (tmp_path / "t1").stat().st_size == sources[1].numel() * 2


@pytest.mark.parametrize("o_direct", [True, False], ids=["direct", "aiofiles"])
def test_asyncio_load_errors(make_engine, tmp_path, o_direct) -> None:
    engine = make_engine(o_direct=o_direct)
    with pytest.raises(OffloadIOError):
        asyncio.run(asyncio_api.load_tensor(tmp_path / "missing", torch.zeros(4), engine=engine))
    (tmp_path / "short").write_bytes(b"\x01" * 10)
    with pytest.raises(OffloadIOError):
        asyncio.run(asyncio_api.load_tensor(tmp_path / "short", torch.zeros(8192), engine=engine))


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
def test_direct_read_of_unpadded_file(backend, tmp_path, aligned) -> None:
    """A file written without O_DIRECT has no padding: an O_DIRECT read still gets every byte."""
    source = random_tensor(4097, torch.float32, aligned=True)
    with AsyncIOEngine(AioSettings(o_direct=False), backend=backend) as buffered:
        buffered.write(source, tmp_path / "f").wait()
    assert (tmp_path / "f").stat().st_size == 4097 * 4
    target = empty_like(source, aligned=aligned)
    with AsyncIOEngine(AioSettings(block_size=8192), backend=backend) as direct:
        direct.read(target, tmp_path / "f").wait()
        assert torch.equal(source, target)
        short = empty_like(random_tensor(5000, torch.float32, aligned=True), aligned=aligned)
        with pytest.raises(OffloadIOError, match="end of the file"):
            direct.read(short, tmp_path / "f").wait()


def test_asyncio_default_engine(tmp_path) -> None:
    source = random_tensor(12_345, torch.float16, aligned=False)
    target = empty_like(source, aligned=True)
    asyncio.run(asyncio_api.save_tensor(tmp_path / "d", source))
    asyncio.run(asyncio_api.load_tensor(tmp_path / "d", target))
    assert torch.equal(source, target)
    assert asyncio_api.default_engine().settings.o_direct
    assert (tmp_path / "d").stat().st_size % 4096 == 0  # written with O_DIRECT padding
