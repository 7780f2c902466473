"""Accelerator detection, the env override, and the CPU accelerator's API."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from slipstream.kernels.accelerator import (
    ACCELERATOR_ENV,
    CpuAccelerator,
    CudaAccelerator,
    NullStream,
    RocmAccelerator,
    available_accelerators,
    cpu_info,
    get_accelerator,
    parse_gcn_arch,
    set_accelerator,
)

pytestmark = pytest.mark.usefixtures("fresh_accelerator")


def _pretend_gpu(monkeypatch: pytest.MonkeyPatch, hip: str | None) -> None:
    """Make torch report a usable GPU of a CUDA (hip=None) or ROCm build, without touching one."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", hip)


def _no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_cpu_is_detected_without_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_gpu(monkeypatch)
    acc = get_accelerator()
    assert isinstance(acc, CpuAccelerator)
    assert (acc.name, acc.device_type) == ("cpu", "cpu")
    assert (acc.communication_backend, acc.backend_library) == ("gloo", "gloo")
    assert acc.device() == torch.device("cpu")
    assert acc.device(3) == torch.device("cpu")
    assert acc.device_count() == 1
    assert acc.current_device_index() == 0
    assert acc.version() is None
    assert acc.is_bf16_supported() and acc.is_fp16_supported()
    assert acc.supported_dtypes() == [torch.float32, torch.bfloat16, torch.float16]
    assert get_accelerator() is acc  # cached


def test_rocm_build_is_detected_as_rocm(monkeypatch: pytest.MonkeyPatch) -> None:
    _pretend_gpu(monkeypatch, hip="6.2.41133")
    assert available_accelerators() == ["rocm", "cpu"]
    acc = get_accelerator()
    assert isinstance(acc, RocmAccelerator)
    assert acc.name == "rocm"
    assert acc.device_type == "cuda"  # torch keeps the cuda device type on ROCm
    assert acc.communication_backend == "nccl"  # RCCL answers to the nccl backend name
    assert acc.backend_library == "rccl"
    assert acc.version() == "6.2.41133"


def test_cuda_build_is_detected_as_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    _pretend_gpu(monkeypatch, hip=None)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    acc = get_accelerator()
    assert type(acc) is CudaAccelerator
    assert (acc.name, acc.device_type, acc.backend_library) == ("cuda", "cuda", "nccl")
    assert acc.version() == "12.4"


def test_env_override_picks_cpu_even_with_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _pretend_gpu(monkeypatch, hip=None)
    monkeypatch.setenv(ACCELERATOR_ENV, "CPU")
    assert isinstance(get_accelerator(), CpuAccelerator)


@pytest.mark.parametrize("requested", ["cuda", "rocm"])
def test_env_override_for_missing_gpu_names_what_is_available(
    monkeypatch: pytest.MonkeyPatch, requested: str
) -> None:
    _no_gpu(monkeypatch)
    monkeypatch.setenv(ACCELERATOR_ENV, requested)
    with pytest.raises(RuntimeError, match=rf"{requested!r}.*available: cpu"):
        get_accelerator()


def test_env_override_cuda_on_rocm_build_suggests_rocm(monkeypatch: pytest.MonkeyPatch) -> None:
    _pretend_gpu(monkeypatch, hip="6.2")
    monkeypatch.setenv(ACCELERATOR_ENV, "cuda")
    with pytest.raises(RuntimeError, match=r"ROCm build.*'rocm'"):
        get_accelerator()


def test_env_override_unknown_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ACCELERATOR_ENV, "tpu")
    with pytest.raises(ValueError, match=r"'tpu'.*cuda, rocm, cpu"):
        get_accelerator()


def test_set_accelerator_by_name_instance_and_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_gpu(monkeypatch)
    set_accelerator("rocm")
    assert isinstance(get_accelerator(), RocmAccelerator)
    mine = CpuAccelerator()
    set_accelerator(mine)
    assert get_accelerator() is mine
    set_accelerator(None)
    assert get_accelerator() is not mine
    with pytest.raises(ValueError, match="unknown accelerator 'gpu'"):
        set_accelerator("gpu")


def test_parse_gcn_arch() -> None:
    assert parse_gcn_arch("gfx942:sramecc+:xnack-") == "gfx942"
    assert parse_gcn_arch("gfx90a") == "gfx90a"


def test_cpu_rng_state_round_trip_through_safetensors(tmp_path) -> None:
    acc = CpuAccelerator()
    acc.manual_seed(1234)
    first = torch.rand(8)
    acc.manual_seed(1234)
    assert torch.equal(torch.rand(8), first)  # manual_seed really seeds the CPU generator

    state = acc.get_rng_state()
    assert set(state) == {"cpu"}
    save_file(state, str(tmp_path / "rng.safetensors"))
    expected = torch.rand(8)
    torch.rand(100)  # move the generator on
    acc.set_rng_state(load_file(str(tmp_path / "rng.safetensors")))
    assert torch.equal(torch.rand(8), expected)


def test_set_rng_state_without_cpu_entry_is_an_error() -> None:
    with pytest.raises(KeyError, match="no 'cpu' entry"):
        CpuAccelerator().set_rng_state({"device": torch.zeros(4, dtype=torch.uint8)})


def test_cpu_streams_are_program_order_no_ops() -> None:
    acc = CpuAccelerator()
    stream = acc.create_stream()
    assert isinstance(stream, NullStream) and stream.priority == 0
    assert acc.Stream is NullStream
    assert acc.create_stream(priority=-1).priority == -1
    with acc.stream(stream) as entered:
        assert entered is stream
        value = torch.ones(3) * 2
    stream.synchronize()
    stream.wait_stream(acc.current_stream())
    assert stream.query()
    assert torch.equal(value, torch.full((3,), 2.0))


def test_cpu_memory_stats_read_zero_and_set_device_is_accepted() -> None:
    acc = CpuAccelerator()
    acc.set_device(3)  # every rank's local_rank is fine on CPU
    with pytest.raises(ValueError, match="-1"):
        acc.set_device(-1)
    acc.reset_peak_memory_stats()
    assert acc.memory_allocated() == acc.max_memory_allocated() == acc.memory_reserved() == 0
    acc.synchronize()


def test_amd_specific_is_a_noop_off_rocm() -> None:
    acc = CpuAccelerator()
    applied = acc.apply_amd_specific(mem_pool_init=True, stream_priority=-1)
    assert applied["mem_pool_init"] is False and applied["stream_priority"] is None
    assert "only on ROCm" in applied["note"]
    assert acc.default_stream_priority == 0
    assert acc.create_stream().priority == 0


def test_amd_specific_sets_stream_priority_on_rocm() -> None:
    acc = RocmAccelerator()  # constructing one touches no device
    applied = acc.apply_amd_specific(mem_pool_init=False, stream_priority=-1)
    assert applied == {"mem_pool_init": False, "stream_priority": -1, "note": "applied on ROCm"}
    assert acc.default_stream_priority == -1


def test_cpu_info_reads_x86_flags(tmp_path) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text(
        "processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu sse4_2 avx avx2 avx512f\n\n"
        "processor\t: 1\nmodel name\t: Test CPU 9000\nflags\t\t: fpu sse4_2 avx avx2 avx512f\n"
    )
    info = cpu_info(str(path))
    assert info.model_name == "Test CPU 9000"
    assert info.simd == ("sse4_2", "avx", "avx2", "avx512f")
    assert info.logical_cores >= info.usable_cores >= 1


def test_cpu_info_reads_arm_features(tmp_path) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text("processor\t: 0\nFeatures\t: fp asimd asimdhp sve\nCPU part\t: 0xd40\n")
    assert cpu_info(str(path)).simd == ("asimd", "asimdhp", "sve")


def test_cpu_info_without_proc_file(tmp_path) -> None:
    info = cpu_info(str(tmp_path / "missing"))
    assert info.model_name and info.simd == ()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_gpu_accelerator_end_to_end() -> None:
    acc = get_accelerator()
    assert acc.device_type == "cuda" and acc.name in ("cuda", "rocm")
    assert acc.device_count() >= 1
    assert acc.arch(0).startswith("sm_" if acc.name == "cuda" else "gfx")
    assert acc.total_memory(0) > 0 and acc.device_name(0)

    acc.manual_seed(7)
    state = acc.get_rng_state()
    assert set(state) == {"cpu", "device"}
    expected = torch.rand(16, device=acc.device())
    torch.rand(1000, device=acc.device())
    acc.set_rng_state(state)
    assert torch.equal(torch.rand(16, device=acc.device()), expected)

    before = acc.memory_allocated()
    block = torch.empty(1 << 20, dtype=torch.uint8, device=acc.device())
    assert acc.memory_allocated() >= before + (1 << 20)
    del block

    stream = acc.create_stream(priority=-1)
    with acc.stream(stream):
        value = torch.ones(4, device=acc.device()) * 3
    stream.synchronize()
    assert value.sum().item() == 12.0


@pytest.mark.parametrize(
    ("mem_pool_init", "stream_priority", "message"),
    [
        ("yes", 0, "rocm_mem_pool_init must be true or false, got str 'yes'"),
        (True, 1.5, "rocm_stream_priority must be an integer"),
        (False, True, "rocm_stream_priority must be an integer"),
    ],
)
def test_amd_specific_validates_arguments_everywhere(mem_pool_init, stream_priority, message):
    for acc in (CpuAccelerator(), RocmAccelerator()):  # a bad config fails on CPU too
        with pytest.raises(TypeError, match=message):
            acc.apply_amd_specific(mem_pool_init=mem_pool_init, stream_priority=stream_priority)
    assert RocmAccelerator().default_stream_priority == 0  # nothing applied on error


@pytest.mark.gpu
@pytest.mark.skipif(torch.version.hip is None or not torch.cuda.is_available(), reason="ROCm")
def test_amd_specific_warms_the_allocator_and_sets_priority_on_rocm() -> None:
    acc = RocmAccelerator()
    acc.empty_cache()
    before = acc.memory_reserved()
    applied = acc.apply_amd_specific(mem_pool_init=True, stream_priority=-1)
    assert applied["mem_pool_init"] is True
    assert acc.memory_reserved() >= before + 20 * 1024 * 1024  # the block stays cached
    assert acc.memory_allocated() == 0 or acc.memory_allocated() < acc.memory_reserved()
    assert acc.create_stream().priority == -1
