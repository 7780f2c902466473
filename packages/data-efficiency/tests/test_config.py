"""The data_efficiency and legacy curriculum_learning blocks: DeepSpeed's examples, named errors."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from slipstream.data import CurriculumLearningConfig, DataEfficiencyConfig
from slipstream.kernels.config_schema import ConfigError

# DeepSpeedExamples training/data_efficiency/gpt_finetuning/config/ds_config_gpt_base_random_ltd.json
GPT_RANDOM_LTD: dict[str, Any] = {
    "enabled": True,
    "data_routing": {
        "enabled": True,
        "random_ltd": {
            "enabled": True,
            "total_layer_num": 12,
            "random_ltd_layer_num": 10,
            "random_ltd_layer_id": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
            "model_mask_name": "attention_mask",
            "model_type": "decoder",
            "hidden_state_order": "batch_seq_dim",
            "random_ltd_schedule": {
                "min_value": 128,
                "max_value": 1024,
                "schedule_type": "fixed_linear",
                "schedule_config": {"require_steps": 400, "seq_per_step": 8},
            },
        },
    },
}
# .../vit_finetuning/config/ds_config_cifar_random_ltd.json (model_mask_name null)
VIT_RANDOM_LTD = copy.deepcopy(GPT_RANDOM_LTD)
VIT_RANDOM_LTD["data_routing"]["random_ltd"].update(model_mask_name=None)
VIT_RANDOM_LTD["data_routing"]["random_ltd"]["random_ltd_schedule"] = {
    "min_value": 32,
    "max_value": 197,
    "schedule_type": "fixed_linear",
    "schedule_config": {"require_steps": 3910, "seq_per_step": 8},
}
# .../gpt_finetuning/finetune/ds_config_gpt2-medium_2clmetrics_TEMPLATE.json, its placeholders
# filled as ds_finetune_gpt2_run.sh fills them.
TWO_METRICS: dict[str, Any] = {
    "enabled": True,
    "seed": 1234,
    "data_routing": {"enabled": False, "random_ltd": {"enabled": False}},
    "data_sampling": {
        "enabled": True,
        "num_workers": 0,
        "curriculum_learning": {
            "enabled": True,
            "data_cluster_path": "/tmp/cl_cluster",
            "curriculum_metrics": {
                "seqlen": {
                    "index_to_sample_path": "/data/seqlen/seqlen_index_to_sample_percentile_merged",
                    "index_to_metric_path": "/data/seqlen/seqlen_index_to_metric",
                    "difficulty_type": "percentile",
                    "clustering_type": "schedule_based",
                    "min_difficulty": 1,
                    "max_difficulty": 100,
                    "schedule_type": "fixed_root",
                    "schedule_config": {
                        "total_curriculum_step": 2000,
                        "difficulty_step": 1,
                        "root_degree": 2,
                    },
                },
                "voc": {
                    "index_to_sample_path": "/data/voc/voc_index_to_sample",
                    "index_to_metric_path": "/data/voc/voc_index_to_metric",
                    "difficulty_type": "value",
                    "clustering_type": "schedule_based",
                    "min_difficulty": 1,
                    "max_difficulty": 100,
                    "schedule_type": "fixed_root",
                    "schedule_config": {
                        "total_curriculum_step": 2000,
                        "difficulty_step": 1,
                        "root_degree": 2,
                    },
                },
            },
        },
    },
}
# DeepSpeed's curriculum learning tutorial (the legacy block).
LEGACY = {
    "enabled": True,
    "curriculum_type": "seqlen",
    "min_difficulty": 8,
    "max_difficulty": 1024,
    "schedule_type": "fixed_linear",
    "schedule_config": {"total_curriculum_step": 15000, "difficulty_step": 8},
}


@pytest.mark.parametrize("block", [GPT_RANDOM_LTD, VIT_RANDOM_LTD, TWO_METRICS])
def test_deepspeed_examples_are_accepted_unchanged(block: dict[str, Any]) -> None:
    config = DataEfficiencyConfig.from_dict(copy.deepcopy(block), "data_efficiency")
    assert DataEfficiencyConfig.from_dict(config.to_dict()) == config


def test_example_values_are_read() -> None:
    config = DataEfficiencyConfig.from_dict(TWO_METRICS)
    assert config.sampling_curriculum_enabled and not config.random_ltd_enabled
    metrics = config.data_sampling.curriculum_learning.curriculum_metrics
    assert metrics["seqlen"].difficulty_type == "percentile"
    assert metrics["voc"].schedule_config.root_degree == 2
    ltd = DataEfficiencyConfig.from_dict(GPT_RANDOM_LTD)
    assert ltd.random_ltd_enabled
    schedule = ltd.data_routing.random_ltd.random_ltd_schedule
    assert schedule is not None and schedule.schedule_config.require_steps == 400
    legacy = CurriculumLearningConfig.from_dict(LEGACY)
    assert legacy.schedule_params()["schedule_config"] == LEGACY["schedule_config"]


def _with(block: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(block)
    *parents, last = path.split(".")
    node = out
    for key in parents:
        node = node[key]
    node[last] = value
    return out


_SEQLEN = "data_sampling.curriculum_learning.curriculum_metrics.seqlen"
_LTD = "data_routing.random_ltd"


@pytest.mark.parametrize(
    ("block", "path", "value", "match"),
    [
        (TWO_METRICS, f"{_SEQLEN}.difficulty_type", "rank", r"seqlen\.difficulty_type"),
        (TWO_METRICS, f"{_SEQLEN}.schedule_type", "cosine", r"seqlen\.schedule_type"),
        (TWO_METRICS, f"{_SEQLEN}.schedule_config.root_degree", None, r"root_degree"),
        (TWO_METRICS, f"{_SEQLEN}.index_to_sample_path", None, r"index_to_sample_path"),
        (TWO_METRICS, f"{_SEQLEN}.max_difficulty", 150, r"percentile <= 100"),
        (TWO_METRICS, f"{_SEQLEN}.min_difficulty", 101, r"above"),
        (TWO_METRICS, "data_sampling.dynamic_batching", {"enabled": True}, r"dynamic_batching"),
        (GPT_RANDOM_LTD, f"{_LTD}.random_ltd_layer_num", 9, r"random_ltd_layer_num"),
        (GPT_RANDOM_LTD, f"{_LTD}.hidden_state_order", "bsh", r"hidden_state_order"),
        (GPT_RANDOM_LTD, f"{_LTD}.random_ltd_schedule.min_value", 2048, r"min_value"),
        (GPT_RANDOM_LTD, f"{_LTD}.random_ltd_schedule.min_value", 4, r"min_value = 4 is below .*seq_per_step = 8.*keep 0 tokens"),
        (GPT_RANDOM_LTD, f"{_LTD}.random_ltd_schedule.schedule_type", "fixed_root", r"schedule_type"),
        (GPT_RANDOM_LTD, f"{_LTD}.random_ltd_schedul", {}, r"did you mean"),
        (GPT_RANDOM_LTD, f"{_LTD}.layer_token_lr_schedule", {"enabled": True}, r"total_layer_tokens"),
    ],
)  # fmt: skip
def test_bad_values_name_the_key(block: dict, path: str, value: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        DataEfficiencyConfig.from_dict(_with(block, path, value), "data_efficiency")


@pytest.mark.parametrize(
    ("path", "value", "match"),
    [
        ("schedule_type", "fixed_discrete", r"schedule_config\.difficulty"),
        ("schedule_config.difficulty_step", 0, r"difficulty_step"),
        ("min_difficulty", -1, r"min_difficulty"),
        ("min_difficulty", 4, r"min_difficulty = 4 is below .*difficulty_step = 8.*0-token"),
    ],
)
def test_legacy_bad_values_name_the_key(path: str, value: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        CurriculumLearningConfig.from_dict(_with(LEGACY, path, value), "curriculum_learning")
    with pytest.raises(ConfigError, match="max_difficulty"):
        CurriculumLearningConfig.from_dict({"enabled": True, "min_difficulty": 8}, "c")
