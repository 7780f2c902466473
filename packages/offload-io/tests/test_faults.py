"""Failures: bad swap paths, full disks, O_DIRECT refusals, I/O errors, short transfers,
corruption and cleanup after exit or SIGTERM.

Injected errors go through ``AsyncIOEngine._inject_error`` (the test seam: the first piece of
the next request fails inside the backend worker as if the syscall had returned that errno).
"""

from __future__ import annotations

import errno
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch

from slipstream.offload.aio import engine as engine_module
from slipstream.offload.aio.engine import SHORT_ONCE
from slipstream.offload.aio.errors import (
    DirectIOUnsupportedError,
    DiskFullError,
    OffloadIOError,
    SwapPathError,
)
from slipstream.offload.pinned import aligned_empty
from slipstream.offload.swap import SwapSpace

MiB = 1024 * 1024
SRC = Path(__file__).resolve().parents[1] / "src"
REPO = Path(__file__).resolve().parents[3]
PYTHONPATH = os.pathsep.join(
    [str(REPO / "kernels" / "src"), str(REPO / "packages" / "comm" / "src"), str(SRC)]
)


def _mount_tmpfs(folder: Path, options: str) -> None:
    folder.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip() or 'mount failed'})")


def _umount(folder: Path) -> None:
    subprocess.run(["umount", str(folder)], check=False)


# -- swap folder problems ------------------------------------------------------------------
def test_missing_root(make_engine, tmp_path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(SwapPathError, match="does not exist") as info:
        SwapSpace(missing, make_engine())
    assert str(missing) in str(info.value) and info.value.errno == errno.ENOENT
    assert "nvme_path" in str(info.value)


def test_root_is_a_file(make_engine, tmp_path) -> None:
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(SwapPathError, match="not a directory") as info:
        SwapSpace(file, make_engine())
    assert info.value.errno == errno.ENOTDIR


def test_read_only_directory_chmod(make_engine, tmp_path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        probe = folder / "probe"
        try:
            probe.mkdir()
        except PermissionError:
            pass
        else:
            probe.rmdir()
            pytest.skip("running as root: chmod 0o555 does not stop writes (see the /sys test)")
        with pytest.raises(SwapPathError, match="not writable") as info:
            SwapSpace(folder, make_engine())
        assert str(folder) in str(info.value) and info.value.errno == errno.EACCES
    finally:
        folder.chmod(0o755)


@pytest.mark.parametrize("root", ["/sys", "/proc/self"])
def test_unwritable_pseudo_file_system(make_engine, root) -> None:
    """/sys and /proc refuse new folders even for root (EPERM / ENOENT / EROFS)."""
    if not os.path.isdir(root):
        pytest.skip(f"{root} does not exist here")
    with pytest.raises(SwapPathError, match="not writable") as info:
        SwapSpace(root, make_engine())
    assert root in str(info.value)
    assert info.value.errno in (errno.EPERM, errno.EACCES, errno.EROFS, errno.ENOENT)


def test_read_only_mount(make_engine, tmp_path) -> None:
    folder = tmp_path / "romount"
    _mount_tmpfs(folder, "ro,size=1m")
    try:
        with pytest.raises(SwapPathError, match="Read-only file system") as info:
            SwapSpace(folder, make_engine(o_direct=False))
        assert info.value.errno == errno.EROFS and str(folder) in str(info.value)
    finally:
        _umount(folder)


# -- full disk -----------------------------------------------------------------------------
@pytest.mark.parametrize("o_direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EDQUOT], ids=["ENOSPC", "EDQUOT"])
def test_injected_disk_full_on_write(make_engine, tmp_path, o_direct, err) -> None:
    engine = make_engine(o_direct=o_direct, block_size=64 * 1024)
    tensor = torch.randn(100_000)
    engine._inject_error(err, op="write")
    request = engine.write(tensor, tmp_path / "f")
    with pytest.raises(DiskFullError) as info:
        request.wait()
    message = str(info.value)
    assert info.value.errno == err
    assert str(tmp_path / "f") in message
    assert "400,000 bytes" in message  # bytes needed
    assert "free" in message and "nvme_path" in message
    assert ("quota" in message) == (err == errno.EDQUOT)
    with pytest.raises(DiskFullError):
        request.wait()  # reported again, never turned into success
    # The seam fires once: the next write succeeds and the data is intact.
    engine.write(tensor, tmp_path / "f").wait()
    out = torch.zeros_like(tensor)
    engine.read(out, tmp_path / "f").wait()
    assert torch.equal(out, tensor)


def test_unwaited_failure_is_reported_by_wait_all(make_engine, tmp_path) -> None:
    engine = make_engine()
    engine._inject_error(errno.ENOSPC, op="write")
    engine.write(torch.randn(5000), tmp_path / "a")
    for index in range(3):  # later requests prune finished ones: the failure must survive
        engine.write(torch.randn(5000), tmp_path / f"b{index}").wait()
    with pytest.raises(DiskFullError):
        engine.wait_all()
    engine.wait_all()  # reported once by wait_all, not again
    engine.close()


def test_swap_write_disk_full(make_engine, tmp_path) -> None:
    engine = make_engine()
    with SwapSpace(tmp_path, engine) as space:
        space.allocate("k", 300_000, torch.float32)
        engine._inject_error(errno.ENOSPC, op="write")
        with pytest.raises(DiskFullError, match=r"k\.swap"):
            space.write("k", torch.randn(300_000)).wait()


def test_real_full_tmpfs(make_engine, tmp_path) -> None:
    """A 1 MiB tmpfs: allocate fails up front and cleans up; an engine write fails in wait()."""
    folder = tmp_path / "tiny"
    _mount_tmpfs(folder, "size=1m")
    try:
        engine = make_engine(o_direct=False)
        with SwapSpace(folder, engine) as space:
            with pytest.raises(DiskFullError) as info:
                space.allocate("big", 2 * MiB, torch.uint8)
            assert "needed 2,101,248 bytes" in str(info.value)  # header + payload
            assert info.value.errno == errno.ENOSPC
            assert not (space.path / "big.swap").exists()  # the partial file is removed
            space.allocate("small", 100_000, torch.uint8)  # and the space is usable again
            data = torch.randint(0, 256, (100_000,), dtype=torch.uint8)
            space.write("small", data).wait()
            out = torch.zeros_like(data)
            space.read("small", out).wait()
            assert torch.equal(out, data)
        request = engine.write(torch.zeros(2 * MiB, dtype=torch.uint8), folder / "raw")
        with pytest.raises(DiskFullError, match="no space left"):
            request.wait()
    finally:
        _umount(folder)


# -- O_DIRECT refused ----------------------------------------------------------------------
def test_einval_with_o_direct_means_unsupported(make_engine, tmp_path) -> None:
    engine = make_engine()
    engine._inject_error(errno.EINVAL, op="write")
    with pytest.raises(DirectIOUnsupportedError) as info:
        engine.write(torch.randn(5000), tmp_path / "f").wait()
    message = str(info.value)
    assert str(tmp_path / "f") in message
    assert "file system type 'ext4'" in message or "file system" in message
    assert '"o_direct": false' in message


def test_einval_without_o_direct_is_generic(make_engine, tmp_path) -> None:
    engine = make_engine(o_direct=False)
    engine._inject_error(errno.EINVAL, op="write")
    with pytest.raises(OffloadIOError) as info:
        engine.write(torch.randn(5000), tmp_path / "f").wait()
    assert type(info.value) is OffloadIOError


def test_o_direct_refused_at_open(make_engine, tmp_path, monkeypatch) -> None:
    engine = make_engine()
    real_open = os.open

    def no_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(engine_module.os, "open", no_direct)
    with pytest.raises(DirectIOUnsupportedError, match="rejected at open"):
        engine.write(torch.randn(10), tmp_path / "f")


def test_swap_space_probe_detects_no_o_direct(make_engine, tmp_path) -> None:
    engine = make_engine()
    engine._inject_error(errno.EINVAL, op="write")
    with pytest.raises(DirectIOUnsupportedError, match="o_direct"):
        SwapSpace(tmp_path, engine)
    assert list(tmp_path.iterdir()) == []  # the half-made folder is removed


# -- other I/O errors ----------------------------------------------------------------------
def test_read_error_names_path_offset_size(make_engine, tmp_path) -> None:
    engine = make_engine(block_size=64 * 1024)
    tensor = torch.randn(100_000)
    engine.write(tensor, tmp_path / "f", 8192).wait()
    engine._inject_error(errno.EIO, op="read")
    with pytest.raises(OffloadIOError) as info:
        engine.read(torch.zeros_like(tensor), tmp_path / "f", 8192).wait()
    message = str(info.value)
    assert type(info.value) is OffloadIOError and info.value.errno == errno.EIO
    assert str(tmp_path / "f") in message
    assert "offset 8,192" in message and "65,536 bytes" in message
    assert os.strerror(errno.EIO) in message


def test_errors_pickle() -> None:
    error = DiskFullError(errno.ENOSPC, "disk full at /x", "/x")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is DiskFullError and str(copy) == "disk full at /x" and copy.errno == 28
    assert isinstance(copy, OSError)


# -- short transfers -----------------------------------------------------------------------
@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("o_direct", [True, False], ids=["direct", "buffered"])
def test_short_transfer_is_completed(make_engine, tmp_path, o_direct, op) -> None:
    engine = make_engine(o_direct=o_direct, block_size=256 * 1024)
    tensor = torch.randn(200_003)
    engine._inject_error(SHORT_ONCE, op=op)
    engine.write(tensor, tmp_path / "f").wait()
    out = aligned_empty(tensor.numel(), torch.float32).zero_()
    engine._inject_error(SHORT_ONCE, op=op)
    engine.read(out, tmp_path / "f").wait()
    assert torch.equal(out, tensor)


@pytest.mark.parametrize("o_direct", [True, False], ids=["direct", "buffered"])
def test_python_backend_retries_every_short_syscall(tmp_path, monkeypatch, o_direct) -> None:
    """The OS may return fewer bytes than asked at any time: loop until complete."""
    from slipstream.offload.aio.config import AioSettings
    from slipstream.offload.aio.engine import AsyncIOEngine

    step = 4096 if o_direct else 1000
    calls = {"write": 0, "read": 0}
    real_pwritev, real_preadv = os.pwritev, os.preadv

    def short_pwritev(fd, buffers, offset):
        calls["write"] += 1
        return real_pwritev(fd, [buffers[0][:step]], offset)

    def short_preadv(fd, buffers, offset):
        calls["read"] += 1
        return real_preadv(fd, [buffers[0][:step]], offset)

    monkeypatch.setattr(engine_module.os, "pwritev", short_pwritev)
    monkeypatch.setattr(engine_module.os, "preadv", short_preadv)
    tensor = torch.randn(25_001)  # 100,004 bytes
    with AsyncIOEngine(AioSettings(o_direct=o_direct), backend="python") as engine:
        engine.write(tensor, tmp_path / "f").wait()
        out = torch.zeros_like(tensor)
        engine.read(out, tmp_path / "f").wait()
    assert torch.equal(out, tensor)
    assert calls["write"] >= 100_004 // step and calls["read"] >= 100_004 // step


# -- cleanup when the process ends ---------------------------------------------------------
def _child(body: str) -> subprocess.Popen[str]:
    script = textwrap.dedent(
        """
        import sys, time, signal
        from slipstream.offload.aio.config import AioSettings
        from slipstream.offload.aio.engine import AsyncIOEngine
        from slipstream.offload.swap import SwapSpace
        import torch
        """
    ) + textwrap.dedent(body)
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    return subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env
    )


def test_folder_removed_at_exit_without_close(tmp_path) -> None:
    child = _child(
        f"""
        engine = AsyncIOEngine(AioSettings(), backend="python")
        space = SwapSpace({str(tmp_path)!r}, engine)
        space.allocate("k", 1000, torch.float32)
        space.write("k", torch.ones(1000)).wait()
        print(space.path, flush=True)
        # exits without close()
        """
    )
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0
    path = Path(out.strip())
    assert path.parent == tmp_path and path.name.startswith("slipstream-swap-rank0-")
    assert not path.exists()


@pytest.mark.parametrize("previous", ["default", "python"])
def test_folder_removed_on_sigterm(tmp_path, previous) -> None:
    marker = tmp_path / f"marker-{uuid.uuid4().hex}"
    install = (
        f"signal.signal(signal.SIGTERM, lambda s, f: (open({str(marker)!r}, 'w').close(), "
        "sys.exit(3)))"
        if previous == "python"
        else ""
    )
    child = _child(
        f"""
        {install}
        engine = AsyncIOEngine(AioSettings(), backend="python")
        space = SwapSpace({str(tmp_path)!r}, engine)
        space.allocate("k", 1000, torch.float32)
        print(space.path, flush=True)
        time.sleep(60)
        """
    )
    assert child.stdout is not None
    path = Path(child.stdout.readline().strip())
    assert path.is_dir()
    child.send_signal(signal.SIGTERM)
    child.wait(timeout=30)
    assert not path.exists()
    if previous == "python":
        assert child.returncode == 3 and marker.exists()  # the previous handler still ran
    else:
        assert child.returncode == -signal.SIGTERM  # still dies of SIGTERM
