"""The op registry: selection by device/dtype/priority, fallback warnings, forcing, errors."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from slipstream.kernels.registry import (
    OP_BACKEND_ENV,
    OpRegistry,
    OpUnavailableError,
    UnknownOpError,
    forced_backends,
    get_op,
    list_ops,
)

LOGGER = "slipstream.kernels.registry"


def reference_impl(x: int) -> str:
    return f"reference({x})"


def fast_impl(x: int) -> str:
    return f"fast({x})"


def half_impl(x: int) -> str:
    return f"half({x})"


class CountingProbe:
    """An availability probe that records how often it was asked."""

    def __init__(self, available: bool, reason: str = "") -> None:
        self.calls = 0
        self.result = (available, reason)

    def __call__(self) -> tuple[bool, str]:
        self.calls += 1
        return self.result


@pytest.fixture(autouse=True)
def _no_forced_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(OP_BACKEND_ENV, raising=False)


def _registry(fast_probe: CountingProbe | None = None) -> OpRegistry:
    registry = OpRegistry()
    registry.register("scale", "reference", reference_impl, device_types=("*",))
    registry.register(
        "scale", "fast", fast_impl, device_types=("cuda", "xpu"), priority=10, available=fast_probe
    )
    return registry


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING
    ]


def test_highest_priority_backend_for_the_device_wins() -> None:
    registry = _registry()
    assert registry.get("scale", "cuda") is fast_impl
    assert registry.get("scale", torch.device("cuda", 1)) is fast_impl
    assert registry.get("scale", "cpu") is reference_impl  # fast does not run on cpu
    assert registry.select("scale", "cpu") == ("reference", reference_impl)
    assert registry.backends("scale") == ["fast", "reference"]


def test_equal_priority_goes_to_the_earlier_registration() -> None:
    registry = OpRegistry()
    registry.register("op", "first", reference_impl, device_types=("cpu",), priority=5)
    registry.register("op", "second", fast_impl, device_types=("cpu",), priority=5)
    assert registry.get("op", "cpu") is reference_impl


def test_unavailable_backend_falls_back_and_warns_once_per_device(
    caplog: pytest.LogCaptureFixture,
) -> None:
    probe = CountingProbe(False, "triton is not installed")
    registry = _registry(probe)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert registry.get("scale", "cuda") is reference_impl
        assert registry.get("scale", "cuda", torch.float16) is reference_impl
        assert registry.get("scale", "cuda", torch.float32) is reference_impl
    messages = _warnings(caplog)
    assert len(messages) == 1
    assert "'fast'" in messages[0] and "triton is not installed" in messages[0]
    assert "'reference'" in messages[0] and "cuda" in messages[0]
    assert probe.calls == 1  # probed once, then cached

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert registry.get("scale", "xpu") is reference_impl
    assert len(_warnings(caplog)) == 2  # a new device type gets its own warning
    assert "xpu" in _warnings(caplog)[1]


def test_no_warning_when_the_unavailable_backend_does_not_target_the_device(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = _registry(CountingProbe(False, "nope"))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        registry.get("scale", "cpu")
    assert _warnings(caplog) == []


def test_dtype_restricted_backend_is_chosen_only_for_its_dtypes() -> None:
    registry = _registry()
    registry.register(
        "scale",
        "half",
        half_impl,
        device_types=("cuda",),
        dtypes=(torch.float16, torch.bfloat16),
        priority=20,
    )
    assert registry.get("scale", "cuda", torch.bfloat16) is half_impl
    assert registry.get("scale", "cuda", torch.float32) is fast_impl
    assert registry.get("scale", "cuda") is fast_impl  # no dtype given: restricted ones skipped


def test_lazy_loader_imports_on_first_use(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = "slipstream_lazy_backend_for_test"
    (tmp_path / f"{module}.py").write_text("def run(x):\n    return x * 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)
    registry = OpRegistry()
    registry.register("double", "reference", f"{module}:run", device_types=("cpu",))
    assert module not in sys.modules
    assert registry.get("double", "cpu")(21) == 42
    assert module in sys.modules


def test_failed_lazy_import_counts_as_unavailable(caplog: pytest.LogCaptureFixture) -> None:
    registry = _registry()
    registry.register(
        "scale", "broken", "slipstream_no_such_module_xyz:run", device_types=("cpu",), priority=99
    )
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert registry.get("scale", "cpu") is reference_impl
    (message,) = _warnings(caplog)
    assert "'broken'" in message and "ModuleNotFoundError" in message
    available, reason = registry.availability("scale", "broken")
    assert not available and "slipstream_no_such_module_xyz" in reason


def test_probe_that_raises_counts_as_unavailable() -> None:
    def exploding_probe() -> tuple[bool, str]:
        raise RuntimeError("driver too old")

    registry = _registry()
    registry.register(
        "scale", "fragile", fast_impl, device_types=("cpu",), priority=50, available=exploding_probe
    )
    assert registry.get("scale", "cpu") is reference_impl
    available, reason = registry.availability("scale", "fragile")
    assert not available and "driver too old" in reason


def test_forced_backend_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = _registry()
    monkeypatch.setenv(OP_BACKEND_ENV, "scale=reference, other=fast")
    assert forced_backends() == {"scale": "reference", "other": "fast"}
    assert registry.get("scale", "cuda") is reference_impl
    monkeypatch.delenv(OP_BACKEND_ENV)
    assert registry.get("scale", "cuda") is fast_impl


def test_forced_backend_that_is_unavailable_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = _registry(CountingProbe(False, "no compiler"))
    monkeypatch.setenv(OP_BACKEND_ENV, "scale=fast")
    with pytest.raises(
        OpUnavailableError, match=r"forces op 'scale' to backend 'fast'.*no compiler"
    ):
        registry.get("scale", "cuda")


def test_forced_backend_that_does_not_exist_or_fit_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    registry = _registry()
    monkeypatch.setenv(OP_BACKEND_ENV, "scale=triton")
    with pytest.raises(OpUnavailableError, match=r"no such backend.*fast, reference"):
        registry.get("scale", "cuda")
    monkeypatch.setenv(OP_BACKEND_ENV, "scale=fast")
    with pytest.raises(OpUnavailableError, match="does not support device type 'cpu'"):
        registry.get("scale", "cpu")


@pytest.mark.parametrize("value", ["scale", "scale=", "=fast", "scale=fast,broken"])
def test_malformed_forcing_is_an_error(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(OP_BACKEND_ENV, value)
    with pytest.raises(ValueError, match="is not 'op=backend'"):
        forced_backends()


def test_unknown_op_lists_known_ops() -> None:
    registry = _registry()
    with pytest.raises(UnknownOpError, match=r"unknown op 'scal'.*registered ops: scale") as info:
        registry.get("scal", "cpu")
    assert isinstance(info.value, KeyError)
    assert not str(info.value).startswith("'")  # readable, not KeyError's quoted repr


def test_no_backend_for_device_or_none_available() -> None:
    registry = OpRegistry()
    registry.register("gpu_only", "fast", fast_impl, device_types=("cuda",))
    with pytest.raises(OpUnavailableError, match="no backend for device type 'cpu'"):
        registry.get("gpu_only", "cpu")
    registry.register(
        "dead", "a", fast_impl, device_types=("cpu",), available=CountingProbe(False, "reason A")
    )
    with pytest.raises(OpUnavailableError, match=r"no backend is available.*a: reason A"):
        registry.get("dead", "cpu")


def test_registration_errors_and_replacement() -> None:
    registry = _registry()
    with pytest.raises(ValueError, match="already has a backend 'fast'"):
        registry.register("scale", "fast", half_impl, device_types=("cuda",))
    assert registry.get("scale", "cuda") is fast_impl
    registry.register("scale", "fast", half_impl, device_types=("cuda",), priority=10, replace=True)
    assert registry.get("scale", "cuda") is half_impl  # cached selection was invalidated
    with pytest.raises(ValueError, match=r"must look like 'package.module:attribute'"):
        registry.register("x", "y", "no_colon_here", device_types=("cpu",))
    with pytest.raises(ValueError, match="device_types must not be empty"):
        registry.register("x", "y", fast_impl, device_types=())


def test_list_ops_rows() -> None:
    registry = _registry(CountingProbe(False, "not built"))
    rows = {(r.op, r.backend): r for r in registry.list_ops("cuda")}
    fast, reference = rows[("scale", "fast")], rows[("scale", "reference")]
    assert (fast.available, fast.reason, fast.selected) == (False, "not built", False)
    assert fast.device_types == ("cuda", "xpu") and fast.priority == 10
    assert (reference.available, reference.selected, reference.device_types) == (True, True, ("*",))


def test_builtin_module_is_imported_on_first_query(tmp_path, monkeypatch) -> None:
    module = "slipstream_builtin_ops_for_test"
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)
    (tmp_path / f"{module}.py").write_text(
        "import builtins\n"
        "builtins._slipstream_test_registry.register(\n"
        "    'late', 'reference', abs, device_types=('*',)\n"
        ")\n"
    )
    registry = OpRegistry(builtin_module=module)
    monkeypatch.setattr("builtins._slipstream_test_registry", registry, raising=False)
    assert registry.ops() == ["late"]
    assert registry.get("late", "cpu") is abs


def test_default_registry_serves_every_builtin_reference() -> None:
    from slipstream.kernels.ops.rms_norm.reference import rms_norm

    assert get_op("rms_norm", "cpu", torch.float32) is rms_norm
    rows = [r for r in list_ops("cpu") if r.backend == "reference"]
    expected = {"adam", "cross_entropy", "layer_norm", "rms_norm", "rotary_embedding", "softmax"}
    assert expected <= {r.op for r in rows}
    assert all(r.available and r.selected for r in rows if r.op in expected)
    with pytest.raises(UnknownOpError, match="rms_norm"):
        get_op("no_such_op", "cpu")
