"""Tests of slipstream.config: defaults, every error class, the batch triple, features, loading."""

from __future__ import annotations

import base64
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from slipstream.config import (
    RECOGNISED_FEATURES,
    AutoValueError,
    ConfigError,
    NotImplementedFeatureError,
    SlipstreamConfig,
    load_config,
    resolve_batch_sizes,
    strip_json_comments,
)

BASE = {"train_micro_batch_size_per_gpu": 2}


def load(extra: dict[str, Any], world_size: int = 1) -> SlipstreamConfig:
    return load_config({**BASE, **extra}, world_size=world_size)


# ----------------------------------------------------------------------------- defaults


def test_defaults_equal_deepspeeds_documented_values() -> None:
    # Values from DeepSpeed's runtime/constants.py, precision_config.py, zero/config.py,
    # zero/offload_config.py and docs/_pages/config-json.md.
    config = load({})
    assert config.steps_per_print == 10
    assert config.gradient_clipping == 0.0
    assert config.wall_clock_breakdown is False
    assert config.dump_state is False
    assert config.prescale_gradients is False
    assert config.gradient_predivide_factor == 1.0
    assert config.communication_data_type is None
    assert config.zero_allow_untested_optimizer is False
    assert config.zero_force_ds_cpu_optimizer is True
    assert config.optimizer is None and config.scheduler is None
    assert config.dataloader_drop_last is False

    fp16 = config.fp16
    assert fp16.enabled is False
    assert fp16.auto_cast is False
    assert fp16.loss_scale == 0
    assert fp16.initial_scale_power == 16
    assert fp16.loss_scale_window == 1000
    assert fp16.hysteresis == 2
    assert fp16.consecutive_hysteresis is False
    assert fp16.min_loss_scale == 1
    assert fp16.fp16_master_weights_and_grads is False
    assert config.bf16.enabled is False
    assert config.bf16.immediate_grad_update is False

    zero = config.zero_optimization
    assert zero.stage == 0
    assert zero.contiguous_gradients is True
    assert zero.reduce_scatter is True
    assert zero.reduce_bucket_size == 500_000_000
    assert zero.allgather_partitions is True
    assert zero.allgather_bucket_size == 500_000_000
    assert zero.overlap_comm is None
    assert zero.load_from_fp32_weights is True
    assert zero.sub_group_size == 1_000_000_000
    assert zero.stage3_prefetch_bucket_size == 50_000_000
    assert zero.stage3_param_persistence_threshold == 100_000
    assert zero.stage3_max_live_parameters == 1_000_000_000
    assert zero.stage3_max_reuse_distance == 1_000_000_000
    assert zero.stage3_gather_16bit_weights_on_model_save is False
    assert zero.ignore_unused_parameters is True
    assert zero.round_robin_gradients is False
    assert zero.zero_hpz_partition_size == 1
    assert zero.offload_param is None and zero.offload_optimizer is None

    assert config.comms_logger.enabled is False
    assert config.comms_logger.prof_all is True
    assert config.comms_logger.prof_ops == []
    assert config.amd_specific.rocm_mem_pool_init is False
    assert config.amd_specific.rocm_stream_priority == 0


def test_offload_block_defaults() -> None:
    config = load(
        {"zero_optimization": {"offload_param": {}, "offload_optimizer": {"device": "none"}}}
    )
    param = config.zero_optimization.offload_param
    optim = config.zero_optimization.offload_optimizer
    assert param is not None and optim is not None
    assert (param.device, param.buffer_count, param.buffer_size, param.max_in_cpu) == (
        "none",
        5,
        100_000_000,
        1_000_000_000,
    )
    assert (optim.device, optim.buffer_count, optim.ratio, optim.pin_memory) == (
        "none",
        4,
        1.0,
        False,
    )


def test_fp16_block_values_and_5e8_style_ints() -> None:
    config = load(
        {
            "fp16": {
                "enabled": True,
                "loss_scale": 128,
                "initial_scale_power": 12.0,
                "hysteresis": 4,
            },
            "zero_optimization": {"stage": 0, "reduce_bucket_size": 2e8},
            "gradient_clipping": 1,
        }
    )
    assert config.fp16.loss_scale == 128.0 and isinstance(config.fp16.loss_scale, float)
    assert config.fp16.initial_scale_power == 12 and isinstance(
        config.fp16.initial_scale_power, int
    )
    assert config.zero_optimization.reduce_bucket_size == 200_000_000
    assert config.gradient_clipping == 1.0 and isinstance(config.gradient_clipping, float)


# ------------------------------------------------------------------ communication dtype


@pytest.mark.parametrize(
    ("spelling", "dtype"),
    [
        ("fp32", torch.float32),
        ("FP32", torch.float32),
        ("float32", torch.float32),
        ("fp16", torch.float16),
        ("half", torch.float16),
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        (None, None),
    ],
)
def test_communication_data_type(spelling: str | None, dtype: torch.dtype | None) -> None:
    config = load({"communication_data_type": spelling})
    assert config.communication_data_type == dtype


def test_communication_data_type_errors_and_dumps_short_names() -> None:
    with pytest.raises(ConfigError) as info:
        load({"communication_data_type": "fp8"})
    assert 'communication_data_type = "fp8"' in str(info.value)
    assert '"fp32", "fp16" or "bf16"' in str(info.value)
    assert (
        load({"communication_data_type": "BFloat16"}).to_dict()["communication_data_type"] == "bf16"
    )


# ----------------------------------------------------------------------- mixed precision


def test_fp16_and_bf16_together_is_an_error() -> None:
    with pytest.raises(ConfigError) as info:
        load({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert "fp16.enabled and bf16.enabled are both true" in str(info.value)
    assert not isinstance(info.value, NotImplementedFeatureError)


def test_bfloat16_is_an_alias_of_bf16() -> None:
    assert load({"bfloat16": {"enabled": True}}).bf16.enabled is True
    with pytest.raises(ConfigError, match="'bf16' and 'bfloat16' set the same option"):
        load({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}})
    with pytest.raises(ConfigError, match="both true"):
        load({"fp16": {"enabled": True}, "bfloat16": {"enabled": True}})


@pytest.mark.parametrize(
    ("block", "key"),
    [
        ({"fp16": {"fp16_master_weights_and_grads": True}}, "fp16.fp16_master_weights_and_grads"),
        ({"bf16": {"bf16_master_weights_and_grads": True}}, "bf16.bf16_master_weights_and_grads"),
        ({"bf16": {"bf16_optimizer_states": True}}, "bf16.bf16_optimizer_states"),
    ],
)
def test_unimplemented_precision_options(block: dict[str, Any], key: str) -> None:
    with pytest.raises(NotImplementedFeatureError) as info:
        load(block)
    assert info.value.path == key
    assert "not implemented yet in this release" in str(info.value)


@pytest.mark.parametrize(
    ("fp16", "expected"),
    [
        ({"loss_scale": -1}, "fp16.loss_scale = -1"),
        ({"hysteresis": 0}, "fp16.hysteresis = 0"),
        ({"loss_scale_window": 0}, "fp16.loss_scale_window = 0"),
        ({"min_loss_scale": 0.0}, "fp16.min_loss_scale = 0.0"),
        ({"initial_scale_power": 2.5}, "fp16.initial_scale_power = 2.5"),
        ({"loss_scale": float("inf")}, "fp16.loss_scale = Infinity"),
    ],
)
def test_fp16_bad_values(fp16: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load({"fp16": fp16})
    assert str(info.value).startswith(expected)


# ------------------------------------------------------------------------ bad values


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (
            {"gradient_clipping": -1.0},
            "gradient_clipping = -1.0 (number) is not valid: expected a number >= 0",
        ),
        (
            {"steps_per_print": 0},
            "steps_per_print = 0 (integer) is not valid: expected an integer >= 1",
        ),
        ({"gradient_predivide_factor": 0}, "gradient_predivide_factor = 0 (integer) is not valid"),
        (
            {"wall_clock_breakdown": "false"},
            'wall_clock_breakdown = "false" (string) is not valid: expected a boolean',
        ),
        (
            {"train_batch_size": 8.5},
            "train_batch_size = 8.5 (number) is not valid: expected an integer",
        ),
        (
            {"amd_specific": {"rocm_stream_priority": "high"}},
            'amd_specific.rocm_stream_priority = "high"',
        ),
        ({"comms_logger": {"prof_ops": "all_reduce"}}, 'comms_logger.prof_ops = "all_reduce"'),
    ],
)
def test_wrong_types_and_values_name_the_key_and_value(
    extra: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load(extra)
    assert str(info.value).startswith(expected)


def test_unknown_top_level_key_suggests_the_closest() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_sise": 8}, world_size=1)
    assert str(info.value) == (
        "unknown config key 'train_batch_sise'; did you mean 'train_batch_size'?"
    )
    # Recognised feature keys are suggested too.
    with pytest.raises(ConfigError, match="did you mean 'tensorboard'"):
        load({"tensorbord": {"enabled": False}})
    with pytest.raises(ConfigError, match=r"did you mean 'zero_optimization.reduce_bucket_size'"):
        load({"zero_optimization": {"reduce_bucket_sise": 1}})
    with pytest.raises(ConfigError, match=r"did you mean 'fp16.loss_scale_window'"):
        load({"fp16": {"loss_scale_windw": 100}})


def test_unknown_key_far_from_any_valid_key() -> None:
    with pytest.raises(ConfigError) as info:
        load({"qqqqqqqq": 1})
    assert "unknown config key 'qqqqqqqq'" in str(info.value)
    assert "docs/config.md" in str(info.value)


# ------------------------------------------------------------------------------- "auto"


def test_auto_placeholders_are_listed_with_the_explanation() -> None:
    data = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        "zero_optimization": {"stage": 0, "reduce_bucket_size": "auto"},
    }
    with pytest.raises(AutoValueError) as info:
        load_config(data, world_size=1)
    assert info.value.paths == [
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "optimizer.params.lr",
        "zero_optimization.reduce_bucket_size",
    ]
    message = str(info.value)
    assert "Hugging Face Trainer/Accelerate" in message
    assert "Set a concrete value" in message


# ------------------------------------------------------------------------------ ZeRO


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_1_to_3_load(stage: int) -> None:
    assert load({"zero_optimization": {"stage": stage}}).zero_optimization.stage == stage


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("zero_quantized_nontrainable_weights", True),
    ],
)
def test_unbuilt_zero_plus_plus_keys_are_not_implemented(key: str, value: Any) -> None:
    with pytest.raises(NotImplementedFeatureError) as info:
        load({"zero_optimization": {"stage": 3, key: value}})
    assert info.value.path == f"zero_optimization.{key}"
    assert "slipstream-zero" in str(info.value)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("zero_quantized_weights", True),
        ("zero_quantized_gradients", True),
        ("mics_shard_size", 4),
        ("zero_hpz_partition_size", 8),
        ("mics_hierarchical_params_gather", True),
    ],
)
def test_zero_plus_plus_and_mics_load_at_stage_3_only(key: str, value: Any) -> None:
    assert getattr(load({"zero_optimization": {"stage": 3, key: value}}).zero_optimization, key)
    with pytest.raises(ConfigError, match=r"needs zero_optimization\.stage 3") as info:
        load({"zero_optimization": {"stage": 2, key: value}})
    assert info.value.path == f"zero_optimization.{key}"


def test_mics_shard_size_zero_is_refused() -> None:
    with pytest.raises(ConfigError, match="expected -1"):
        load({"zero_optimization": {"stage": 3, "mics_shard_size": 0}})


def test_zero_stage_outside_0_to_3_is_a_value_error() -> None:
    for bad in (4, "2", 2.0, True):
        with pytest.raises(ConfigError) as info:
            load({"zero_optimization": {"stage": bad}})
        assert not isinstance(info.value, NotImplementedFeatureError)
        assert "expected one of 0, 1, 2, 3" in str(info.value)


@pytest.mark.parametrize(
    "zero",
    [
        {"offload_optimizer": {"device": "cpu"}},
        {"offload_param": {"device": "nvme", "nvme_path": "/nvme"}},
        {"cpu_offload": True},
        {"cpu_offload_param": True},
    ],
)
def test_offload_at_stage_0_is_inert_and_warned(
    zero: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    # DeepSpeed reads the offload blocks only at stages 1-3; so does Slipstream, saying so.
    with caplog.at_level(logging.WARNING):
        config = load({"zero_optimization": {"stage": 0, **zero}})
    assert config.zero_optimization.stage == 0
    assert "no effect at stage 0" in caplog.text
    assert next(iter(zero)) in caplog.text


def test_zenflow_is_not_implemented() -> None:
    with pytest.raises(NotImplementedFeatureError) as info:
        load({"zero_optimization": {"zenflow": {"topk_ratio": 0.1, "select_interval": "auto"}}})
    assert info.value.path == "zero_optimization.zenflow"


@pytest.mark.parametrize(
    ("zero", "key", "error"),
    [
        ({"stage": 2, "offload_param": {"device": "cpu"}}, "offload_param.device", ConfigError),
        ({"stage": 1, "cpu_offload_param": True}, "offload_param.device", ConfigError),
        (
            {"stage": 3, "offload_param": {"device": "nvme"}},
            "offload_param.nvme_path",
            ConfigError,
        ),
        (
            {"stage": 2, "offload_optimizer": {"device": "nvme"}},
            "offload_optimizer.nvme_path",
            ConfigError,
        ),
        (
            {
                "stage": 2,
                "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "ratio": 0.5},
            },
            "offload_optimizer.ratio",
            NotImplementedFeatureError,
        ),
        (
            {"stage": 3, "offload_optimizer": {"device": "cpu", "super_offload": True}},
            "offload_optimizer.super_offload",
            NotImplementedFeatureError,
        ),
    ],
)
def test_offload_settings_that_cannot_run_name_the_key(
    zero: dict[str, Any], key: str, error: type[Exception]
) -> None:
    with pytest.raises(error) as info:
        load({"zero_optimization": zero})
    assert info.value.path == f"zero_optimization.{key}"  # type: ignore[attr-defined]


def test_partial_offload_ratio_reaches_the_offload_settings() -> None:
    pytest.importorskip("slipstream.offload")
    from slipstream.runtime.zero_setup import zero_settings

    block = {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.25}}
    settings = zero_settings(load({"zero_optimization": block}))
    assert settings.offload_optimizer is not None
    assert settings.offload_optimizer.ratio == 0.25


def test_cpu_step_memory_keys_reach_the_offload_settings() -> None:
    pytest.importorskip("slipstream.offload")
    from slipstream.runtime.zero_setup import zero_settings

    block = {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "cpu_stores": "stream", "cpu_prefetch": 2048},
    }
    settings = zero_settings(load({"zero_optimization": block}))
    assert settings.offload_optimizer is not None
    assert settings.offload_optimizer.cpu_stores == "stream"
    assert settings.offload_optimizer.cpu_prefetch == 2048
    block["offload_optimizer"]["cpu_prefetch"] = -1
    with pytest.raises(ConfigError) as info:
        load({"zero_optimization": block})
    assert info.value.path == "zero_optimization.offload_optimizer.cpu_prefetch"


def test_offload_blocks_and_the_deprecated_switches_are_read() -> None:
    config = load({"zero_optimization": {"stage": 2, "cpu_offload": True}})
    block = config.zero_optimization.optimizer_offload()
    assert block is not None and block.device == "cpu"
    config = load(
        {
            "zero_optimization": {
                "stage": 3,
                "cpu_offload_param": True,
                "cpu_offload_use_pin_memory": True,
                "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"},
            },
            "aio": {"thread_count": 2, "block_size": 262144},
        }
    )
    param = config.zero_optimization.param_offload()
    assert param is not None and param.device == "cpu" and param.pin_memory
    optimizer = config.zero_optimization.optimizer_offload()
    assert optimizer is not None and optimizer.nvme_path == "/nvme"
    assert config.aio.intra_op_parallelism == 2 and config.aio.block_size == 262144


def test_aio_block_is_checked() -> None:
    with pytest.raises(NotImplementedFeatureError) as info:
        load({"aio": {"use_gds": True}})
    assert info.value.path == "aio.use_gds"
    with pytest.raises(ConfigError, match="multiple of 4096"):
        load({"aio": {"block_size": 1000}})
    assert load({"aio": {"block_size": 1000, "o_direct": False}}).aio.block_size == 1000
    with pytest.raises(ConfigError, match="queue_depht"):
        load({"aio": {"queue_depht": 4}})


def test_offload_device_values_are_checked() -> None:
    with pytest.raises(ConfigError, match='expected one of "none", "cpu", "nvme"'):
        load({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}})
    with pytest.raises(ConfigError, match="expected a number <= 1"):
        load({"zero_optimization": {"offload_optimizer": {"ratio": 1.5}}})


def test_stage0_warns_once_about_keys_without_effect(caplog: pytest.LogCaptureFixture) -> None:
    zero = {
        "stage": 0,
        "reduce_bucket_size": 1e7,  # used by stage-0 data parallelism: no warning
        "allgather_bucket_size": 7e6,
        "overlap_comm": True,
        "stage3_prefetch_bucket_size": 1e6,
        "reduce_scatter": True,  # DeepSpeed's default value: nothing changes, no warning
        "offload_param": {"device": "none"},
        "cpu_offload": False,
    }
    with caplog.at_level(logging.WARNING, logger="slipstream.config"):
        config = load({"zero_optimization": zero})
    records = [r for r in caplog.records if "no effect at stage 0" in r.getMessage()]
    assert len(records) == 1
    message = records[0].getMessage()
    assert "allgather_bucket_size, overlap_comm, stage3_prefetch_bucket_size" in message
    assert "reduce_bucket_size" not in message.replace("allgather_bucket_size", "")
    assert "reduce_scatter" not in message and "offload_param" not in message
    assert config.zero_optimization.reduce_bucket_size == 10_000_000


def test_stage0_without_extra_keys_does_not_warn(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="slipstream.config"):
        load({"zero_optimization": {"stage": 0, "reduce_bucket_size": 1000}})
    assert not [r for r in caplog.records if "no effect" in r.getMessage()]


def test_zero_stage3_aliases_and_deprecated_names() -> None:
    config = load(
        {
            "zero_optimization": {
                "prefetch_bucket_size": 123,
                "stage3_gather_fp16_weights_on_model_save": True,
                "max_live_parameters": 5e5,
            }
        }
    )
    zero = config.zero_optimization
    assert zero.stage3_prefetch_bucket_size == 123
    assert zero.stage3_gather_16bit_weights_on_model_save is True
    assert zero.stage3_max_live_parameters == 500_000
    with pytest.raises(ConfigError, match="set the same option"):
        load({"zero_optimization": {"prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 2}})
    with pytest.raises(ConfigError, match=r"zero_optimization.sub_group_size = -1"):
        load({"zero_optimization": {"sub_group_size": -1}})


def test_legacy_boolean_zero_optimization(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="slipstream.config"):
        assert load({"zero_optimization": False}).zero_optimization.stage == 0
    assert any("deprecated" in r.getMessage() for r in caplog.records)
    legacy = load({"zero_optimization": True, "allgather_size": 5e8}).zero_optimization
    assert legacy.stage == 1 and legacy.allgather_bucket_size == 500_000_000


# ------------------------------------------------------------------ optimizer, scheduler


def test_optimizer_and_scheduler_blocks() -> None:
    config = load(
        {
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95]}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
        }
    )
    assert config.optimizer is not None and config.optimizer.type == "AdamW"
    assert config.optimizer.params == {"lr": 1e-4, "betas": [0.9, 0.95]}
    assert config.scheduler is not None and config.scheduler.params == {"warmup_num_steps": 10}
    assert load({"optimizer": None}).optimizer is None
    assert load({"optimizer": {"type": "Adam"}}).optimizer.params == {}  # type: ignore[union-attr]


def test_optimizer_errors() -> None:
    with pytest.raises(ConfigError, match=r"missing required config key 'optimizer.type'"):
        load({"optimizer": {"params": {"lr": 1}}})
    with pytest.raises(ConfigError, match=r"optimizer.type = \"\""):
        load({"optimizer": {"type": ""}})
    with pytest.raises(ConfigError, match=r"scheduler.params = \[\]"):
        load({"scheduler": {"type": "WarmupLR", "params": []}})
    with pytest.raises(ConfigError, match=r"did you mean 'optimizer.params'"):
        load({"optimizer": {"type": "Adam", "param": {}}})


# --------------------------------------------------------------- recognised features

# Independent of the table under test: for every recognised key, a value that must be
# accepted (inert) and one that must be refused (active), taken from DeepSpeed's docs.
# NONE marks a key that has no inert form, or no active one.
NONE = object()
FEATURE_CASES: dict[str, tuple[Any, Any]] = {
    "flops_profiler": ({"enabled": False, "profile_step": 1}, {"enabled": True}),
    "quantize_training": ({"enabled": False}, {"enabled": True}),
    "weight_quantization": ({"enabled": False}, {"post_init_quant": {}}),
    "eigenvalue": ({"enabled": False}, {"enabled": True}),
    "elasticity": ({"enabled": False}, {"enabled": True}),
    "autotuning": ({"enabled": False}, {"enabled": True}),
    "sparse_attention": (NONE, {"mode": "fixed"}),
    "data_types": ({"grad_accum_dtype": "fp32"}, {"grad_accum_dtype": "bf16"}),
    "compile": ({"deepcompile": False}, {"deepcompile": True}),
    "hybrid_engine": ({"enabled": False, "max_out_tokens": 512}, {"enabled": True}),
    "nebula": ({"enabled": False}, {"enabled": True}),
    "datastates_ckpt": (False, {"host_cache_size": 16}),
    "casync_ckpt": (False, {}),
    "torch_autocast": ({"enabled": False}, {"enabled": True, "dtype": "bfloat16"}),
    "expert_parallel": ({"enabled": False, "autoep_size": 4}, {"enabled": True}),
    "seq_parallel_communication_data_type": ("fp32", "bf16"),
    "seq_parallel_comm_data_type": ("FP32", "fp16"),
    "use_data_before_expert_parallelism": (False, True),
    "disable_allgather": (True, NONE),
    "sparse_gradients": (False, True),
    "memory_breakdown": (False, True),
    "graph_harvesting": (False, True),
    "disable_python_gc": (False, True),
    "managed_gradient_accumulation": (True, False),
    "gradient_allreduce_op": ("mean", "sum"),
    "log_level": (None, "debug"),
    "timers": (
        {"throughput": {"enabled": True, "synchronized": True}},
        {"throughput": {"enabled": False}},
    ),
    "vocabulary_size": (50257, NONE),
    "allgather_size": (500000000, NONE),
    "amp": ({"enabled": False}, {"enabled": True, "opt_level": "O1"}),
    "fp32_allreduce": (False, True),
}
RETIRED = {"amp", "fp32_allreduce"}


def test_pipeline_blocks_are_typed_by_slipstream_pipeline() -> None:
    # Implemented now: parsed into the pipeline package's blocks, not "not implemented yet".
    config = load(
        {
            "pipeline": {"stages": 4, "schedule": "zero_bubble"},
            "activation_checkpointing": {"cpu_checkpointing": True},
        }
    )
    assert config.pipeline.stages == 4 and config.pipeline.schedule == "zero_bubble"
    assert config.activation_checkpointing.cpu_checkpointing is True
    with pytest.raises(ConfigError, match=r"pipeline\.schedule"):
        load({"pipeline": {"schedule": "2f2b"}})


def test_feature_cases_cover_the_whole_table() -> None:
    assert set(FEATURE_CASES) == set(RECOGNISED_FEATURES)


@pytest.mark.parametrize(
    "key", sorted(k for k, (inert, _) in FEATURE_CASES.items() if inert is not NONE)
)
def test_inert_feature_values_are_accepted_and_kept(key: str) -> None:
    inert, _ = FEATURE_CASES[key]
    config = load({key: inert})
    assert config.features == {key: inert}
    assert config.to_dict()[key] == inert


@pytest.mark.parametrize(
    "key", sorted(k for k, (_, active) in FEATURE_CASES.items() if active is not NONE)
)
def test_active_feature_values_are_refused(key: str) -> None:
    _, active = FEATURE_CASES[key]
    expected = ConfigError if key in RETIRED else NotImplementedFeatureError
    with pytest.raises(expected) as info:
        load({key: active})
    message = str(info.value)
    assert message.startswith(key) or f": {key} = " in message
    if key in RETIRED:
        assert not isinstance(info.value, NotImplementedFeatureError)
    else:
        assert "recognised but not implemented yet in this release" in message
        assert RECOGNISED_FEATURES[key].provider in message  # type: ignore[operator]


def test_several_active_features_are_reported_together() -> None:
    with pytest.raises(NotImplementedFeatureError) as info:
        load(
            {
                "flops_profiler": {"enabled": True},
                "use_data_before_expert_parallelism": True,
                "nebula": {"enabled": False},
            }
        )
    message = str(info.value)
    assert "flops_profiler = " in message and "use_data_before_expert_parallelism = true" in message
    assert "nebula" not in message
    assert "slipstream-moe" in message


def test_deepspeed_leniencies(caplog: pytest.LogCaptureFixture) -> None:
    # Legacy keys DeepSpeed parses and never reads: accepted, ignored, with a logged notice.
    with caplog.at_level(logging.INFO, logger="slipstream.config.features"):
        config = load({"disable_allgather": True, "vocabulary_size": 50257})
    assert config.features == {"disable_allgather": True, "vocabulary_size": 50257}
    assert "disable_allgather: a legacy DeepSpeed key, accepted and ignored" in caplog.text
    assert "vocabulary_size: a legacy DeepSpeed key" in caplog.text
    with caplog.at_level(logging.INFO, logger="slipstream.config.blocks"):
        load({"optimizer": {"type": "Adam", "legacy_fusion": True}})
    assert "optimizer.legacy_fusion: a legacy DeepSpeed key, accepted and ignored" in caplog.text
    # DeepSpeed tests the flag for truth: 0/1 stand for false/true, nothing else does.
    assert load({"zero_allow_untested_optimizer": 1}).zero_allow_untested_optimizer is True
    assert load({"zero_allow_untested_optimizer": 0}).zero_allow_untested_optimizer is False
    with pytest.raises(ConfigError, match=r"zero_allow_untested_optimizer = 2"):
        load({"zero_allow_untested_optimizer": 2})
    # The AMD guide's boolean stream priority: true is high priority (-1), false the default.
    amd = load({"amd_specific": {"rocm_mem_pool_init": True, "rocm_stream_priority": True}})
    assert amd.amd_specific.rocm_stream_priority == -1
    assert amd.amd_specific.rocm_mem_pool_init is True
    assert load({"amd_specific": {"rocm_stream_priority": False}}).amd_specific == (
        load({}).amd_specific
    )
    assert (
        load({"amd_specific": {"rocm_stream_priority": -2}}).amd_specific.rocm_stream_priority == -2
    )


def test_feature_values_are_shape_checked() -> None:
    with pytest.raises(ConfigError, match=r"tensorboard.enabled = \"yes\""):
        load({"tensorboard": {"enabled": "yes"}})
    with pytest.raises(
        ConfigError, match=r"did you mean 'activation_checkpointing.partition_activations'"
    ):
        load({"activation_checkpointing": {"partition_activation": False}})
    with pytest.raises(ConfigError, match=r"disable_allgather = 0 \(integer\)"):
        load({"disable_allgather": 0})
    with pytest.raises(ConfigError, match=r"flops_profiler = true .*an object"):
        load({"flops_profiler": True})


# --------------------------------------------------------------------------- batch triple


@pytest.mark.parametrize(
    ("given", "world", "expected"),
    [
        # (train, micro, gas), data-parallel world size, hand-computed (train, micro, gas)
        ((32, 4, None), 2, (32, 4, 4)),
        ((32, None, 2), 2, (32, 8, 2)),
        ((None, 4, 2), 2, (16, 4, 2)),
        ((32, None, None), 4, (32, 8, 1)),
        ((None, 4, None), 3, (12, 4, 1)),
        ((16, 4, 2), 2, (16, 4, 2)),
        ((24, 3, None), 1, (24, 3, 8)),
    ],
)
def test_batch_triple_derivation(
    given: tuple[int | None, int | None, int | None], world: int, expected: tuple[int, int, int]
) -> None:
    assert tuple(resolve_batch_sizes(*given, world_size=world)) == expected
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    data = {key: value for key, value in zip(keys, given) if value is not None}
    config = load_config(data, world_size=world)
    assert (
        config.train_batch_size,
        config.train_micro_batch_size_per_gpu,
        config.gradient_accumulation_steps,
    ) == expected


def test_inconsistent_triple_shows_the_arithmetic() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(
            {
                "train_batch_size": 32,
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 2,
            },
            world_size=2,
        )
    assert str(info.value).startswith(
        "train_batch_size 32 != train_micro_batch_size_per_gpu 4 × gradient_accumulation_steps 2"
        " × data-parallel world size 2 = 16."
    )


@pytest.mark.parametrize(
    ("given", "world", "expected"),
    [
        (
            (30, 4, None),
            2,
            "cannot derive gradient_accumulation_steps: train_batch_size 30 is not divisible by "
            "train_micro_batch_size_per_gpu 4 × data-parallel world size 2 = 8.",
        ),
        (
            (30, None, 4),
            1,
            "cannot derive train_micro_batch_size_per_gpu: train_batch_size 30 is not divisible "
            "by gradient_accumulation_steps 4 × data-parallel world size 1 = 4.",
        ),
        (
            (30, None, None),
            4,
            "cannot derive train_micro_batch_size_per_gpu: train_batch_size 30 is not divisible "
            "by data-parallel world size 4.",
        ),
        # DeepSpeed's floor division would give 0 accumulation steps here.
        (
            (8, 4, None),
            4,
            "train_batch_size 8 is not divisible by train_micro_batch_size_per_gpu 4 × data-parallel world size 4 = 16.",
        ),
    ],
)
def test_indivisible_derivation_shows_the_arithmetic(
    given: tuple[int | None, int | None, int | None], world: int, expected: str
) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(*given, world_size=world)
    assert expected in str(info.value)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ((None, None, None), "the config sets no batch size"),
        ((None, None, 4), "gradient_accumulation_steps alone is not enough"),
        ((0, None, None), "train_batch_size must be a positive integer, got 0"),
        ((None, -2, None), "train_micro_batch_size_per_gpu must be a positive integer, got -2"),
        ((8, None, 0), "gradient_accumulation_steps must be a positive integer, got 0"),
    ],
)
def test_missing_or_non_positive_batch_sizes(
    given: tuple[int | None, int | None, int | None], expected: str
) -> None:
    with pytest.raises(ConfigError, match=expected):
        resolve_batch_sizes(*given, world_size=1)


def test_world_size_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="world size must be a positive integer"):
        load_config(BASE, world_size=0)


# ---------------------------------------------------------------------------- loading

DOC = {"train_batch_size": 8, "fp16": {"enabled": True}, "steps_per_print": 3}


def test_load_from_path_str_and_pathlike(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DOC))
    for source in (path, str(path)):
        config = load_config(source, world_size=2)
        assert config.train_micro_batch_size_per_gpu == 4
        assert config.steps_per_print == 3
        assert config.raw == DOC


def test_load_from_json_text_and_bytes() -> None:
    assert load_config(json.dumps(DOC), world_size=1).fp16.enabled is True
    assert load_config(json.dumps(DOC).encode(), world_size=1).train_batch_size == 8


@pytest.mark.parametrize("encode", [base64.b64encode, base64.urlsafe_b64encode])
def test_load_from_base64(encode: Any) -> None:
    # "~~~" makes the standard and URL-safe alphabets differ ('+'/'/' against '-'/'_').
    doc = {**DOC, "optimizer": {"type": "Adam", "params": {"note": "~~~???"}}}
    text = encode(json.dumps(doc).encode()).decode()
    config = load_config(text, world_size=1)
    assert config.optimizer is not None and config.optimizer.params == {"note": "~~~???"}


def test_dict_source_is_not_mutated_and_raw_is_a_copy() -> None:
    doc = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 0}}
    snapshot = json.loads(json.dumps(doc))
    config = load_config(doc, world_size=2)
    assert doc == snapshot
    assert config.raw == snapshot and config.raw is not doc
    config.raw["zero_optimization"]["stage"] = 5
    assert doc["zero_optimization"]["stage"] == 0


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "ds_config.json"
    for source in (missing, str(missing)):
        with pytest.raises(ConfigError) as info:
            load_config(source, world_size=1)
        assert "config file not found" in str(info.value)
        assert str(missing) in str(info.value)


def test_directory_and_non_object_sources(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path, world_size=1)
    with pytest.raises(ConfigError, match="must be a JSON object"):
        load_config("[1, 2]", world_size=1)
    with pytest.raises(ConfigError, match="a dict, a path"):
        load_config(3, world_size=1)  # type: ignore[arg-type]


def test_invalid_json_reports_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    # Line 3 lacks a comma after `2`; the parser stops at the next key, column 3.
    path.write_text('{\n  "train_batch_size": 2\n  "steps_per_print": 1\n}\n')
    with pytest.raises(ConfigError) as info:
        load_config(path, world_size=1)
    message = str(info.value)
    assert f"invalid JSON in config file '{path}' at line 3, column 3" in message
    assert '"steps_per_print": 1' in message


def test_invalid_json_text_after_comments_keeps_positions() -> None:
    text = '{ /* a\n b */ "train_batch_size": 2, // c\n "x": }'
    with pytest.raises(ConfigError) as info:
        load_config(text, world_size=1)
    assert "at line 3, column 7" in str(info.value)


def test_invalid_json_line_numbers_count_leading_blank_lines() -> None:
    with pytest.raises(ConfigError, match="at line 3, column 22"):
        load_config('\n\n{"train_batch_size": }', world_size=1)


def test_duplicate_keys_are_errors() -> None:
    with pytest.raises(ConfigError, match="duplicate config key 'train_batch_size'"):
        load_config('{"train_batch_size": 2, "train_batch_size": 4}', world_size=1)


def test_comments_and_trailing_commas(tmp_path: Path) -> None:
    text = """{
      // batch settings
      "train_batch_size": 8, /* eight */
      "optimizer": {
        "type": "Adam", // trailing comment
        "params": {
          "url": "http://example.com//a/*b*/c",
          "quote": "a \\" // not a comment",
          "lr": 1e-3,
        },
      },
      /* a block
         over lines */
      "steps_per_print": 5,
    }
    """
    path = tmp_path / "ds.json"
    path.write_text(text)
    config = load_config(path, world_size=2)
    assert config.train_micro_batch_size_per_gpu == 4
    assert config.steps_per_print == 5
    assert config.optimizer is not None
    assert config.optimizer.params == {
        "url": "http://example.com//a/*b*/c",
        "quote": 'a " // not a comment',
        "lr": 1e-3,
    }


def test_strip_json_comments_preserves_strings_and_positions() -> None:
    text = '{"a": "//x", // gone\n "b": "/*y*/" /* gone */}'
    stripped = strip_json_comments(text)
    assert len(stripped) == len(text)
    assert stripped.count("\n") == 1
    assert json.loads(stripped) == {"a": "//x", "b": "/*y*/"}
    # A lone comma is not "trailing": invalid JSON stays invalid.
    with pytest.raises(json.JSONDecodeError):
        json.loads(strip_json_comments("[,]"))


def test_unterminated_block_comment() -> None:
    with pytest.raises(ConfigError, match=r"line 2, column 3: a '/\*' comment is never closed"):
        load_config('{"train_batch_size": 2,\n  /* oops\n}', world_size=1)


# ---------------------------------------------------------------------------- round trip


def test_to_dict_round_trips_through_load_config(caplog: pytest.LogCaptureFixture) -> None:
    original = load_config(
        {
            "train_batch_size": 16,
            "gradient_accumulation_steps": 2,
            "bf16": {"enabled": True},
            "communication_data_type": "fp32",
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
            "zero_optimization": {"stage": 0, "reduce_bucket_size": 1e6},
            "comms_logger": {"enabled": True, "prof_ops": ["all_reduce"]},
            "tensorboard": {"enabled": False},
        },
        world_size=2,
    )
    dumped = original.to_dict()
    assert dumped["communication_data_type"] == "fp32"
    assert dumped["train_micro_batch_size_per_gpu"] == 4
    assert dumped["tensorboard"] == {
        "enabled": False,
        "output_path": "",
        "job_name": "DeepSpeedJobName",
    }
    json.dumps(dumped)  # JSON-ready
    with caplog.at_level(logging.WARNING, logger="slipstream.config"):
        again = load_config(dumped, world_size=2)
    assert again == original
    assert again.to_dict() == dumped
    assert not caplog.records


def test_monitor_blocks_take_deepspeeds_keys_and_defaults() -> None:
    config = load(
        {
            "tensorboard": {"enabled": True, "output_path": "runs/", "job_name": "j"},
            "wandb": {"enabled": True, "team": "t", "group": "g"},
            "csv_monitor": {"enabled": True},
            "comet": {"enabled": True, "samples_log_interval": 8, "online": False},
        }
    )
    assert (config.tensorboard.enabled, config.tensorboard.output_path) == (True, "runs/")
    assert config.tensorboard.job_name == "j"
    assert (config.wandb.team, config.wandb.group, config.wandb.project) == ("t", "g", "deepspeed")
    assert (config.csv_monitor.output_path, config.csv_monitor.job_name) == (
        "",
        "DeepSpeedJobName",
    )
    assert (config.comet.samples_log_interval, config.comet.online) == (8, False)
    assert config.comet.mode is None and config.comet.api_key is None
    assert load({}).comet.samples_log_interval == 100
    with pytest.raises(ConfigError, match=r"comet.mode = \"maybe\""):
        load({"comet": {"mode": "maybe"}})
    with pytest.raises(ConfigError, match=r"did you mean 'wandb.project'"):
        load({"wandb": {"projct": "p"}})


def test_communication_data_type_error_says_what_null_means() -> None:
    # docs/config.md: null reduces in fp32; the message used to say it follows the precision.
    with pytest.raises(ConfigError) as info:
        load({"communication_data_type": "int8"})
    assert info.value.path == "communication_data_type"
    assert "null (the default: reduce in fp32" in str(info.value)
    assert "follow the training precision" not in str(info.value)


def test_leaf_module_reaches_zero_settings_and_bad_keys_name_their_path() -> None:
    from slipstream.runtime.zero_setup import zero_settings

    config = load(
        {
            "zero_optimization": {
                "stage": 3,
                "leaf_module": {"classes": ["Block"], "name_suffixes": [".mlp"]},
            }
        }
    )
    settings = zero_settings(config)
    assert settings.leaf_module_classes == ("Block",)
    assert settings.leaf_module_name_suffixes == (".mlp",) and settings.leaf_module_names == ()
    with pytest.raises(ConfigError, match=r"zero_optimization\.leaf_module\.class"):
        load({"zero_optimization": {"stage": 3, "leaf_module": {"class": ["Block"]}}})
    with pytest.raises(ConfigError, match=r"zero_optimization\.leaf_module\.names = 'x'"):
        load({"zero_optimization": {"stage": 3, "leaf_module": {"names": "x"}}})


def test_stage12_speed_keys_default_to_the_fast_path() -> None:
    """reduce_bucket_tail_size unset (5e7, none with offload), publish_transport "auto" (not
    an unfilled placeholder here) and average_in_reduce_scatter on reach ZeroSettings; set
    values win."""
    from slipstream.runtime.zero_setup import zero_settings

    settings = zero_settings(load({"zero_optimization": {"stage": 2}}))
    assert settings.reduce_bucket_tail_numel is None
    assert settings.tail_numel(offloaded=False) == 50_000_000
    assert settings.tail_numel(offloaded=True) == 0
    assert settings.publish_transport == "auto" and settings.average_in_reduce_scatter
    written = {
        "stage": 1,
        "publish_transport": "auto",
        "reduce_bucket_tail_size": 0,
        "average_in_reduce_scatter": False,
    }
    settings = zero_settings(load({"zero_optimization": written}))
    assert settings.tail_numel(offloaded=False) == 0
    assert settings.publish_transport == "auto" and not settings.average_in_reduce_scatter
    with pytest.raises(ConfigError, match=r"zero_optimization\.publish_transport"):
        load({"zero_optimization": {"stage": 2, "publish_transport": "nvlink"}})
    with pytest.raises(ConfigError, match=r"zero_optimization\.reduce_bucket_tail_size"):
        load({"zero_optimization": {"stage": 2, "reduce_bucket_tail_size": -1}})
