"""Tests of the config mechanism: parsing, every error class, aliases, "auto" and round trips."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import pytest

from slipstream.kernels.config_schema import (
    AutoValueError,
    ConfigBlock,
    ConfigError,
    NotImplementedFeatureError,
    config_fail,
    find_auto_values,
    key_path,
    not_implemented,
)


@dataclasses.dataclass(kw_only=True)
class Inner(ConfigBlock):
    device: Literal["none", "cpu", "nvme"] = "none"
    size: int = dataclasses.field(default=100, metadata={"ge": 0})


@dataclasses.dataclass(kw_only=True)
class Scaler(ConfigBlock):
    enabled: bool = False
    loss_scale: float = 0.0
    loss_scale_window: int = 1000
    min_loss_scale: float = dataclasses.field(default=1.0, metadata={"gt": 0})
    name: str = "dynamic"


@dataclasses.dataclass(kw_only=True)
class Outer(ConfigBlock):
    stage: Literal[0, 1, 2, 3] = 0
    fp16: Scaler = dataclasses.field(default_factory=Scaler)
    inner: Inner | None = None
    ids: list[int] = dataclasses.field(default_factory=list)
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    bucket: int = dataclasses.field(default=5, metadata={"aliases": ("old_bucket", "older_bucket")})
    threshold: int | None = None
    either: int | str = 0
    free: dict[str, Any] | None = dataclasses.field(default=None, metadata={"allow_auto": True})
    scale: float = dataclasses.field(
        default=1.0,
        metadata={"parser": lambda value, path: float(value) * 2, "serializer": lambda v: v / 2},
    )
    runtime_state: int = dataclasses.field(default=7, init=False)


@dataclasses.dataclass(kw_only=True)
class Checked(ConfigBlock):
    low: int = 0
    high: int = 10

    def validate(self, path: str) -> None:
        if self.low > self.high:
            config_fail(key_path(path, "low"), self.low, f"a value <= high ({self.high})")


@dataclasses.dataclass(kw_only=True)
class Required(ConfigBlock):
    type: str
    params: dict[str, Any] = dataclasses.field(default_factory=dict)


def test_error_classes_are_value_errors() -> None:
    assert issubclass(ConfigError, ValueError)
    assert issubclass(NotImplementedFeatureError, ConfigError)
    assert issubclass(AutoValueError, ConfigError)


def test_defaults_from_none_and_empty() -> None:
    assert Outer.from_dict(None) == Outer()
    assert Outer.from_dict({}) == Outer()
    assert Outer().fp16.loss_scale_window == 1000


def test_int_accepts_integral_floats_like_5e8() -> None:
    parsed = Outer.from_dict({"bucket": 5e8, "ids": [1, 2e0]})
    assert parsed.bucket == 500_000_000 and type(parsed.bucket) is int
    assert parsed.ids == [1, 2] and all(type(i) is int for i in parsed.ids)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(2.5, "an integer"), (True, "an integer"), ("3", "an integer"), (float("inf"), "an integer")],
)
def test_int_rejects_non_integers(value: Any, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        Outer.from_dict({"bucket": value})
    message = str(info.value)
    assert message.startswith("bucket = ")
    assert expected in message
    assert info.value.path == "bucket"


def test_float_accepts_int_and_rejects_bool_string_nan() -> None:
    parsed = Scaler.from_dict({"loss_scale": 128})
    assert parsed.loss_scale == 128.0 and type(parsed.loss_scale) is float
    for bad in (True, "1.0", float("nan")):
        with pytest.raises(ConfigError, match="loss_scale"):
            Scaler.from_dict({"loss_scale": bad})


def test_wrong_type_names_key_value_type_and_expectation() -> None:
    with pytest.raises(ConfigError) as info:
        Outer.from_dict({"fp16": {"enabled": "yes"}})
    assert str(info.value) == (
        'fp16.enabled = "yes" (string) is not valid: expected a boolean (true or false)'
    )
    with pytest.raises(ConfigError, match=r"fp16.enabled = 1 \(integer\)"):
        Outer.from_dict({"fp16": {"enabled": 1}})
    with pytest.raises(ConfigError, match=r"fp16.name = 3 \(integer\).*a string"):
        Outer.from_dict({"fp16": {"name": 3}})


def test_literal_choices() -> None:
    assert Outer.from_dict({"inner": {"device": "cpu"}}).inner == Inner(device="cpu")
    with pytest.raises(ConfigError) as info:
        Outer.from_dict({"inner": {"device": "gpu"}})
    assert str(info.value) == (
        'inner.device = "gpu" (string) is not valid: expected one of "none", "cpu", "nvme"'
    )
    # A JSON true or 1.0 is not the stage 1.
    for bad in (True, 1.0, "1", 4):
        with pytest.raises(ConfigError, match="stage"):
            Outer.from_dict({"stage": bad})
    assert Outer.from_dict({"stage": 1}).stage == 1


def test_optional_and_union() -> None:
    assert Outer.from_dict({"inner": None, "threshold": None}).inner is None
    assert Outer.from_dict({"threshold": 3}).threshold == 3
    assert Outer.from_dict({"either": "x"}).either == "x"
    assert Outer.from_dict({"either": 4}).either == 4
    with pytest.raises(ConfigError, match="expected an integer or a string"):
        Outer.from_dict({"either": [1]})
    with pytest.raises(ConfigError, match="expected an integer or null"):
        Outer.from_dict({"threshold": "x"})


def test_nested_block_errors_carry_the_full_path() -> None:
    with pytest.raises(ConfigError) as info:
        Outer.from_dict({"inner": {"size": -1}})
    assert str(info.value) == "inner.size = -1 (integer) is not valid: expected an integer >= 0"
    with pytest.raises(ConfigError, match=r"ids\[1\] = \"b\""):
        Outer.from_dict({"ids": [1, "b"]})
    with pytest.raises(ConfigError, match=r"fp16 = \[\] \(array\).*an object"):
        Outer.from_dict({"fp16": []})


def test_bounds() -> None:
    with pytest.raises(ConfigError, match=r"fp16.min_loss_scale = 0 .* a number > 0"):
        Outer.from_dict({"fp16": {"min_loss_scale": 0}})
    assert Outer.from_dict({"inner": {"size": 0}}).inner.size == 0


def test_unknown_key_suggests_closest_valid_key() -> None:
    with pytest.raises(ConfigError) as info:
        Outer.from_dict({"fp16": {"loss_scale_windw": 10}})
    assert str(info.value) == (
        "unknown config key 'fp16.loss_scale_windw'; did you mean 'fp16.loss_scale_window'?"
    )
    assert info.value.path == "fp16.loss_scale_windw"


def test_unknown_key_suggests_aliases_and_ignores_case() -> None:
    with pytest.raises(ConfigError, match="did you mean 'old_bucket'"):
        Outer.from_dict({"old_buckt": 1})
    with pytest.raises(ConfigError, match=r"did you mean 'fp16.enabled'"):
        Outer.from_dict({"fp16": {"Enabled": True}})


def test_unknown_key_without_close_match_lists_valid_keys() -> None:
    with pytest.raises(ConfigError) as info:
        Outer.from_dict({"inner": {"zzz": 1}})
    assert str(info.value) == (
        "unknown config key 'inner.zzz'. Valid keys at 'inner': device, size"
    )


def test_several_unknown_keys_are_reported_together() -> None:
    with pytest.raises(ConfigError) as info:
        Scaler.from_dict({"enabeld": True, "hysteresys": 2}, "fp16")
    message = str(info.value)
    assert "'fp16.enabeld'; did you mean 'fp16.enabled'?" in message
    assert "'fp16.hysteresys'" in message


def test_aliases() -> None:
    assert Outer.from_dict({"old_bucket": 9}).bucket == 9
    assert Outer.from_dict({"older_bucket": 9}).to_dict()["bucket"] == 9
    with pytest.raises(ConfigError) as info:
        Outer.from_dict({"bucket": 1, "old_bucket": 2})
    assert "'bucket' and 'old_bucket' set the same option" in str(info.value)


def test_auto_is_rejected_everywhere_with_the_explanation() -> None:
    data = {
        "stage": "auto",
        "fp16": {"enabled": "auto"},
        "params": {"lr": "auto", "betas": [0.9, "auto"]},
    }
    with pytest.raises(AutoValueError) as info:
        Outer.from_dict(data)
    assert info.value.paths == ["stage", "fp16.enabled", "params.lr", "params.betas[1]"]
    message = str(info.value)
    assert "Hugging Face Trainer/Accelerate" in message
    assert "Set a concrete value" in message
    assert isinstance(info.value, ConfigError)


def test_auto_in_a_nested_block_names_the_full_path() -> None:
    with pytest.raises(AutoValueError) as info:
        Scaler.from_dict({"loss_scale": "auto"}, "fp16")
    assert info.value.paths == ["fp16.loss_scale"]


def test_allow_auto_fields_keep_auto() -> None:
    assert Outer.from_dict({"free": {"interval": "auto"}}).free == {"interval": "auto"}


def test_find_auto_values() -> None:
    assert find_auto_values({"a": [1, {"b": " AUTO "}], "c": "automatic"}, "x") == ["x.a[1].b"]


def test_free_form_dict_is_copied_and_checked() -> None:
    params = {"lr": 1e-3, "betas": [0.9, 0.99]}
    parsed = Outer.from_dict({"params": params})
    assert parsed.params == params and parsed.params is not params
    with pytest.raises(ConfigError, match=r"params = 3 \(integer\).*an object"):
        Outer.from_dict({"params": 3})


def test_validate_hook_runs_with_the_block_path() -> None:
    with pytest.raises(ConfigError) as info:
        Checked.from_dict({"low": 11}, "limits")
    assert str(info.value) == (
        "limits.low = 11 (integer) is not valid: expected a value <= high (10)"
    )
    assert info.value.path == "limits.low"


def test_required_field() -> None:
    assert Required.from_dict({"type": "Adam"}).type == "Adam"
    with pytest.raises(ConfigError, match=r"missing required config key 'optimizer.type'"):
        Required.from_dict({"params": {}}, "optimizer")


def test_init_false_fields_are_not_config_keys() -> None:
    assert "runtime_state" not in Outer.config_keys()
    with pytest.raises(ConfigError, match="unknown config key 'runtime_state'"):
        Outer.from_dict({"runtime_state": 1})
    assert "runtime_state" not in Outer().to_dict()


def test_parser_and_serializer_metadata() -> None:
    parsed = Outer.from_dict({"scale": 3})
    assert parsed.scale == 6.0
    assert parsed.to_dict()["scale"] == 3.0


def test_to_dict_round_trips() -> None:
    original = Outer.from_dict(
        {
            "stage": 2,
            "fp16": {"enabled": True, "loss_scale_window": 500},
            "inner": {"device": "nvme", "size": 1e3},
            "ids": [3, 4],
            "params": {"lr": 0.1, "nested": {"a": [1, 2]}},
            "old_bucket": 11,
            "either": "s",
            "scale": 2,
        }
    )
    dumped = original.to_dict()
    assert dumped["fp16"]["loss_scale_window"] == 500
    assert dumped["inner"] == {"device": "nvme", "size": 1000}
    assert dumped["bucket"] == 11 and "old_bucket" not in dumped
    assert Outer.from_dict(dumped) == original


def test_non_mapping_and_non_dataclass() -> None:
    with pytest.raises(ConfigError, match=r"<config> = \[1\]"):
        Outer.from_dict([1])  # type: ignore[arg-type]

    class NotADataclass(ConfigBlock):
        pass

    with pytest.raises(TypeError, match="dataclass"):
        NotADataclass.from_dict({})


def test_config_fail_message() -> None:
    with pytest.raises(ConfigError) as info:
        config_fail("zero_optimization.stage", 7, "one of 0, 1, 2, 3")
    assert str(info.value) == (
        "zero_optimization.stage = 7 (integer) is not valid: expected one of 0, 1, 2, 3"
    )
    assert info.value.path == "zero_optimization.stage"


def test_not_implemented_message() -> None:
    with pytest.raises(NotImplementedFeatureError) as info:
        not_implemented("zero_optimization.stage", 2, "ZeRO stage 2", "slipstream-zero", "Use 0.")
    message = str(info.value)
    assert message.startswith("zero_optimization.stage = 2 asks for ZeRO stage 2")
    assert "not implemented yet in this release" in message
    assert "slipstream-zero" in message and message.endswith("Use 0.")


def test_key_path() -> None:
    assert key_path("", "fp16") == "fp16"
    assert key_path("fp16", "enabled") == "fp16.enabled"
    assert key_path("ids", 2) == "ids[2]"
