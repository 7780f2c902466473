"""Swap payload checksums: a flipped bit or an overwritten payload raises SwapFileCorruptError."""

from __future__ import annotations

import pytest
import torch

from slipstream.offload.aio.errors import SwapFileCorruptError
from slipstream.offload.checksum import (
    ALGORITHM,
    ChecksumUnavailableError,
    file_checksum,
    new_hasher,
    tensor_checksum,
)
from slipstream.offload.swap import HEADER_BYTES, SwapSpace


@pytest.fixture(params=[True, False], ids=["direct", "buffered"])
def space(request, make_engine, tmp_path):
    engine = make_engine(block_size=128 * 1024, queue_depth=4, o_direct=request.param)
    with SwapSpace(tmp_path, engine, name="optim", rank=0) as swap:
        yield swap


def _flip(space: SwapSpace, key: str, offset: int) -> None:
    with open(space.path / f"{key}.swap", "r+b") as handle:
        handle.seek(HEADER_BYTES + offset)
        byte = handle.read(1)[0]
        handle.seek(HEADER_BYTES + offset)
        handle.write(bytes([byte ^ 0x10]))


@pytest.mark.parametrize("offset", [0, 4097 * 4 - 1])
def test_flipped_payload_bit_is_detected(space, offset) -> None:
    space.allocate("m", 4097, torch.float32)
    data = torch.randn(4097)
    space.write("m", data).wait()
    out = torch.zeros(4097)
    space.read("m", out).wait()  # intact: reads back clean
    assert torch.equal(out, data)
    _flip(space, "m", offset)
    request = space.read("m", out)
    with pytest.raises(SwapFileCorruptError, match="checksum") as info:
        request.wait()
    assert str(space.path / "m.swap") in str(info.value)
    with pytest.raises(SwapFileCorruptError):
        request.wait()  # raised again, like any failed request


def test_payload_overwritten_with_other_values_is_detected(space) -> None:
    """The issue's case: the file is rewritten between steps, header intact, sizes equal."""
    space.allocate("exp_avg", 8192, torch.bfloat16)
    space.write("exp_avg", torch.randn(8192).bfloat16()).wait()
    other = torch.full((8192,), 7.0).bfloat16()
    with open(space.path / "exp_avg.swap", "r+b") as handle:
        handle.seek(HEADER_BYTES)
        handle.write(other.view(torch.uint8).numpy().tobytes())
    with pytest.raises(SwapFileCorruptError, match="overwritten behind the engine"):
        space.read("exp_avg", torch.empty(8192, dtype=torch.bfloat16)).wait()
    # the latest write's checksum counts: writing again makes the key readable again
    space.write("exp_avg", other).wait()
    out = torch.empty(8192, dtype=torch.bfloat16)
    space.read("exp_avg", out).wait()
    assert torch.equal(out, other)


def test_verification_can_be_switched_off(make_engine, tmp_path) -> None:
    engine = make_engine(o_direct=False, verify_checksums=False)
    with SwapSpace(tmp_path, engine) as swap:
        swap.allocate("k", 5000, torch.float32)
        swap.write("k", torch.ones(5000)).wait()
        _flip(swap, "k", 0)
        out = torch.zeros(5000)
        swap.read("k", out).wait()  # garbage in, no error: what the switch trades away
        assert not torch.equal(out, torch.ones(5000))


def test_checksum_helpers(tmp_path) -> None:
    tensor = torch.arange(1000, dtype=torch.float32)
    value = tensor_checksum(tensor)
    assert value.startswith(f"{ALGORITHM}:")
    assert tensor_checksum(tensor.clone()) == value
    changed = tensor.clone()
    changed[999] = -1
    assert tensor_checksum(changed) != value
    assert tensor_checksum(tensor.bfloat16()) != tensor_checksum(tensor.half())
    crc = tensor_checksum(tensor, like="crc32:0")
    assert crc.startswith("crc32:") and tensor_checksum(tensor, like=crc) == crc
    path = tmp_path / "f"
    path.write_bytes(tensor.numpy().tobytes())
    assert file_checksum(path) == value
    assert file_checksum(path, like=crc) == crc
    with pytest.raises(ChecksumUnavailableError, match="unknown checksum algorithm"):
        new_hasher("md4:00")


def test_nvme_swapper_raises_for_a_state_overwritten_between_steps(space) -> None:
    """Masters and Adam states on NVMe: a rewritten exp_avg file fails the next swap-in."""
    from slipstream.offload.nvme import NvmeStateSwapper
    from slipstream.offload.settings import OptimizerOffload

    params = [torch.nn.Parameter(torch.randn(4096)) for _ in range(2)]
    optimizer = torch.optim.AdamW(params, lr=0.01)
    for p in params:
        p.grad = torch.randn(4096)
    optimizer.step()
    settings = OptimizerOffload(device="nvme", nvme_path="x", sub_group_numel=4096)
    swapper = NvmeStateSwapper(optimizer, space, settings)
    swapper.evict_all()
    swapper.swap_in(params[:1])  # intact
    swapper.swap_out(params[:1])
    swapper.finish()
    file = space.path / "p1.exp_avg.swap"
    with open(file, "r+b") as handle:
        handle.seek(HEADER_BYTES + 100)
        handle.write(b"\xff" * 64)
    with pytest.raises(SwapFileCorruptError, match=r"p1\.exp_avg"):
        swapper.swap_in(params[1:])
