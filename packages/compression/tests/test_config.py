"""The compression_training block: DeepSpeed's configs accepted unchanged, bad ones named."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from slipstream.compression import CompressionConfig, LinearCompress, init_compression
from slipstream.compression.testing import LAYER_REDUCTION_DOCS, deepspeed_config, tiny_bert
from slipstream.kernels.config_schema import ConfigError, NotImplementedFeatureError


def _block(config: dict[str, Any]) -> CompressionConfig:
    return CompressionConfig.from_dict(config, "compression_training")


def test_deepspeed_test_config_is_accepted_unchanged() -> None:
    config = deepspeed_config()
    block = _block(config["compression_training"])
    assert block.enabled
    wq = block.weight_quantization
    assert wq.shared_parameters.quantization_type == "asymmetric"
    assert wq.different_groups["wq2"].params.target_bits == 4
    assert wq.different_groups["wq1"].modules == ["attention.self", "intermediate"]
    assert block.head_pruning.shared_parameters.num_heads == 12
    assert block.row_pruning.different_groups["rp1"].related_modules == [
        ["layer.\\w+.output.dense"]
    ]
    # Defaults from DeepSpeed's constants.
    assert block.activation_quantization.shared_parameters.schedule_offset == 50
    assert _block({}).sparse_pruning.shared_parameters.schedule_offset == 1000
    assert _block({}).head_pruning.shared_parameters.method == "topk"
    # The dict round-trips.
    assert _block(block.to_dict()).to_dict() == block.to_dict()
    # DeepSpeed's unit test: init_compression on a BERT makes Q/K/V compression-aware.
    model = init_compression(tiny_bert(), config)
    layer = model.bert.encoder.layer[0]  # type: ignore[union-attr]
    for name in ("query", "key", "value"):
        assert isinstance(getattr(layer.attention.self, name), LinearCompress)


def test_docs_layer_reduction_and_channel_blocks_are_accepted() -> None:
    block = _block(
        {
            "layer_reduction": LAYER_REDUCTION_DOCS,
            "channel_pruning": {
                "shared_parameters": {"enabled": True, "schedule_offset": 0, "method": "topk"},
                "different_groups": {
                    "cp1": {
                        "params": {"dense_ratio": 0.5},
                        "modules": ["layer....conv1"],
                        "related_modules": [["layer....conv2", "layer....bn1"]],
                    }
                },
            },
        }
    )
    assert block.layer_reduction.teacher_layer == [2, 4, 6, 8, 10]
    assert block.channel_pruning.different_groups["cp1"].modules == ["layer....conv1"]


def _wq(**shared: Any) -> dict[str, Any]:
    return {
        "weight_quantization": {
            "shared_parameters": {"enabled": True, **shared},
            "different_groups": {"wq1": {"params": {"start_bits": 8, "target_bits": 4}}},
        }
    }


BAD: list[tuple[dict[str, Any], str]] = [
    (
        {"weight_quantizaton": {}},
        r"unknown config key 'compression_training.weight_quantizaton'; did you mean "
        r"'compression_training.weight_quantization'",
    ),
    (_wq(quantization_type="sym"), r"quantization_type = \"sym\""),
    (_wq(rounding="up"), r"rounding = \"up\""),
    (_wq(quantize_groups=0), r"quantize_groups = 0"),
    (
        {
            "weight_quantization": {
                "different_groups": {"wq1": {"params": {"start_bits": 4, "target_bits": 8}}}
            }
        },
        r"target_bits = 8 is above .*start_bits = 4",
    ),
    (
        {"weight_quantization": {"different_groups": {"wq1": {"modules": ["x"]}}}},
        r"missing required config key 'compression_training.weight_quantization"
        r".different_groups.wq1.params'",
    ),
    (
        {"weight_quantization": {"different_groups": {"wq1": {"params": {"start_bits": 8}}}}},
        r"missing required config key .*wq1.params.target_bits",
    ),
    (
        {"weight_quantization": {"different_groups": {"wq1": {"parms": {}}}}},
        r"did you mean 'compression_training.weight_quantization.different_groups.wq1.params'",
    ),
    (
        {"sparse_pruning": {"different_groups": {"sp1": {"params": {"dense_ratio": 0}}}}},
        r"sp1.params.dense_ratio = 0",
    ),
    (
        {"head_pruning": {"shared_parameters": {"enabled": True}}},
        r"missing config key 'compression_training.head_pruning.shared_parameters.num_heads'",
    ),
    (
        {
            "row_pruning": {
                "different_groups": {
                    "rp1": {
                        "params": {"dense_ratio": 0.5},
                        "modules": ["a", "b"],
                        "related_modules": [["c"]],
                    }
                }
            }
        },
        r"related_modules has 1 entries and .*modules 2",
    ),
    (
        {"layer_reduction": {**LAYER_REDUCTION_DOCS, "keep_number_layer": 4}},
        r"teacher_layer names 5 layers but .*keep_number_layer = 4",
    ),
    (
        {"activation_quantization": {"shared_parameters": {"range_calibration": "minmax"}}},
        r"range_calibration = \"minmax\"",
    ),
]


@pytest.mark.parametrize("config,message", BAD)
def test_bad_configs_raise_named_errors(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _block(copy.deepcopy(config))


def test_snip_momentum_is_recognised_but_not_implemented() -> None:
    with pytest.raises(
        NotImplementedFeatureError, match=r"sparse_pruning.shared_parameters.method"
    ):
        _block(
            {
                "sparse_pruning": {
                    "shared_parameters": {
                        "enabled": True,
                        "schedule_offset": 30,
                        "schedule_offset_end": 90,
                        "schedule_offset_stride": 15,
                        "method": "snip_momentum",
                        "block_pattern": "4x1",
                        "dense_ratio": 0.4,
                        "excluded_modules": ["classifier", "pooler"],
                    },
                    "different_groups": {},
                }
            }
        )


def test_patterns_that_match_nothing_are_named() -> None:
    config = {"compression_training": _wq()}
    config["compression_training"]["weight_quantization"]["different_groups"]["wq1"]["modules"] = [
        "attention.slef"
    ]
    with pytest.raises(ConfigError, match=r"wq1.modules = \['attention.slef'\] matches no"):
        init_compression(tiny_bert(), config)
