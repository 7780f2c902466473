"""Every real DeepSpeed config in the shared corpus loads, or fails with a clear, expected reason."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from slipstream.config import (
    AutoValueError,
    ConfigError,
    NotImplementedFeatureError,
    SlipstreamConfig,
    load_config,
)
from slipstream.runtime.optimizers import build_optimizer

REPO = Path(__file__).resolve().parents[3]
# Locally the corpus lives at <repo>/shared; CI clones the repo with shared/ beside it.
CANDIDATES = [
    REPO / "shared" / "configs" / "deepspeed-corpus",
    REPO.parent / "shared" / "configs" / "deepspeed-corpus",
]
CORPUS = next((path for path in CANDIDATES if path.is_dir()), None)
FILES = sorted(CORPUS.glob("*.json")) if CORPUS else []
WORLD_SIZES = (1, 2, 4, 8)

pytestmark = pytest.mark.skipif(
    CORPUS is None,
    reason="the shared DeepSpeed config corpus is not available (looked in: "
    + ", ".join(str(path) for path in CANDIDATES)
    + ")",
)

# The outcome each known config must have, read off the file by hand:
#   ("load", None): loads for at least one data-parallel world size in WORLD_SIZES.
#   ("no_batch", None): a template with no batch size; loads once one is added.
#   ("not_implemented", key): NotImplementedFeatureError whose message names `key`.
#   ("auto", None): AutoValueError (Hugging Face "auto" placeholders).
EXPECTED: dict[str, tuple[str, str | None]] = {
    "ds_deepspeed_autotuning_config_templates_template_zero0.json": ("no_batch", None),
    "ds_deepspeed_autotuning_config_templates_template_zero1.json": ("no_batch", None),
    "ds_deepspeed_autotuning_config_templates_template_zero2.json": ("no_batch", None),
    "ds_deepspeed_autotuning_config_templates_template_zero3.json": ("no_batch", None),
    "ds_examples_sdma_allgather_ds_config_zero3.json": ("load", None),
    "ds_tests_accelerator_ds_config.json": ("load", None),
    # offload_param at stage 0 does nothing (warned), as in DeepSpeed
    "ds_tests_hybrid_engine_hybrid_engine_config.json": ("load", None),
    "ds_tests_model_BingBertSquad_deepspeed_bsz24_fp16_config.json": ("load", None),
    "ds_tests_model_BingBertSquad_deepspeed_bsz24_fp16_zero2_config.json": ("load", None),
    "ds_tests_model_BingBertSquad_deepspeed_bsz24_fp32_config.json": ("load", None),
    "ds_tests_model_Megatron_GPT2_ds_config_func_bs4_zero1.json": ("load", None),
    "ds_tests_model_Megatron_GPT2_ds_config_func_bs4_zero2.json": ("load", None),
    # the deprecated cpu_offload switch: optimizer offload to the CPU
    "ds_tests_model_Megatron_GPT2_ds_config_func_bs4_zero2_offload.json": ("load", None),
    "ds_tests_model_Megatron_GPT2_ds_config_func_bs8_no_zero.json": ("load", None),
    # partition_activations + contiguous_memory_optimization: no-ops with one tensor-parallel rank
    "ds_tests_model_Megatron_GPT2_ds_config_func_bs8_zero0_gas3.json": ("load", None),
    "ds_tests_model_Megatron_GPT2_ds_config_func_bs8_zero1.json": ("load", None),
    # partition_activations + contiguous_memory_optimization: no-ops with one tensor-parallel rank
    "ds_tests_model_Megatron_GPT2_ds_config_func_bs8_zero2.json": ("load", None),
    # partition_activations + contiguous_memory_optimization: no-ops with one tensor-parallel rank
    "ds_tests_model_Megatron_GPT2_ds_config_func_bs8_zero2_gas3.json": ("load", None),
    # the deprecated cpu_offload switch: optimizer offload to the CPU
    "ds_tests_model_Megatron_GPT2_ds_config_func_bs8_zero2_offload.json": ("load", None),
    "ds_tests_model_Megatron_GPT2_ds_config_func_scheduler.json": ("load", None),
    # disable_allgather: parsed and never read by DeepSpeed; accepted and ignored (logged)
    "ds_tests_model_Megatron_GPT2_ds_config_perf_bs16.json": ("load", None),
    # disable_allgather: parsed and never read by DeepSpeed; accepted and ignored (logged)
    "ds_tests_model_Megatron_GPT2_ds_config_perf_bs32.json": ("load", None),
    # disable_allgather: parsed and never read by DeepSpeed; accepted and ignored (logged)
    "ds_tests_model_Megatron_GPT2_ds_config_perf_bs8.json": ("load", None),
    "ds_tests_torch_compile_ds_config_z2.json": ("load", None),
    "ds_tests_torch_compile_ds_config_z3.json": ("load", None),
    "ds_tests_torch_compile_ds_config_z3_deepcompile_no_persist.json": (
        "not_implemented",
        "compile",
    ),
    "ds_tests_unit_ds_batch_config.json": ("load", None),
    "hf_examples_deepspeed_config_templates_zero_stage1_config.json": ("auto", None),
    "hf_examples_deepspeed_config_templates_zero_stage2_config.json": ("auto", None),
    "hf_examples_deepspeed_config_templates_zero_stage2_offload_config.json": ("auto", None),
    "hf_examples_deepspeed_config_templates_zero_stage3_config.json": ("auto", None),
    "hf_examples_deepspeed_config_templates_zero_stage3_offload_config.json": ("auto", None),
    "hf_tests_deepspeed_ds_config_zero2.json": ("auto", None),
    "hf_tests_deepspeed_ds_config_zero3.json": ("auto", None),
}


def _load_any_world_size(source: Any) -> tuple[SlipstreamConfig | None, int | None, list[str]]:
    """Try each world size; return the first config that loads, and the batch errors seen."""
    batch_errors = []
    for world in WORLD_SIZES:
        try:
            return load_config(source, world_size=world), world, batch_errors
        except NotImplementedFeatureError:
            raise
        except ConfigError as error:
            # Only the batch triple depends on the world size; anything else is final.
            if "data-parallel world size" not in str(error):
                raise
            batch_errors.append(str(error))
    return None, None, batch_errors


def _check_loaded(config: SlipstreamConfig, world: int, raw: dict[str, Any]) -> None:
    assert config.raw == raw
    assert (
        config.train_batch_size
        == config.train_micro_batch_size_per_gpu * config.gradient_accumulation_steps * world
    )
    for key in (
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
    ):
        if key in raw:
            assert getattr(config, key) == raw[key]
    assert config.fp16.enabled == raw.get("fp16", {}).get("enabled", False)
    assert config.gradient_clipping == raw.get("gradient_clipping", 0.0)
    assert config.steps_per_print == raw.get("steps_per_print", 10)
    if "optimizer" in raw:
        assert config.optimizer is not None
        assert config.optimizer.type == raw["optimizer"]["type"]
        assert config.optimizer.params == raw["optimizer"].get("params", {})
        # The block must also build (BingBert's bias_correction: false, for one).
        optimizer = build_optimizer(config.optimizer, [torch.nn.Parameter(torch.ones(4))])
        assert isinstance(optimizer, torch.optim.Optimizer)


def test_corpus_is_classified() -> None:
    names = {path.name for path in FILES}
    assert names, f"no JSON files in {CORPUS}"
    assert set(EXPECTED) <= names, f"missing from the corpus: {sorted(set(EXPECTED) - names)}"


@pytest.mark.parametrize("path", FILES, ids=[path.name for path in FILES])
def test_corpus_config(path: Path) -> None:
    raw = json.loads(path.read_text())
    outcome, key = EXPECTED.get(path.name, ("any", None))

    if outcome == "auto":
        with pytest.raises(AutoValueError) as info:
            load_config(path, world_size=1)
        assert info.value.paths, "an AutoValueError must list the keys set to auto"
        assert all(_lookup(raw, p) == "auto" for p in info.value.paths)
        assert "Hugging Face" in str(info.value)
        return

    if outcome == "not_implemented":
        with pytest.raises(NotImplementedFeatureError) as info:
            _load_any_world_size(path)
        assert key is not None and key in str(info.value)
        assert "not implemented yet in this release" in str(info.value)
        return

    if outcome == "no_batch":
        with pytest.raises(ConfigError, match="sets no batch size"):
            load_config(path, world_size=1)
        raw = {**raw, "train_micro_batch_size_per_gpu": 1}
        config, world, _ = _load_any_world_size(raw)
        assert config is not None and world is not None
        _check_loaded(config, world, raw)
        return

    try:
        config, world, batch_errors = _load_any_world_size(path)
    except (NotImplementedFeatureError, AutoValueError):
        if outcome == "load":
            raise
        return  # an unclassified config may name a feature this release lacks
    assert config is not None and world is not None, (
        f"{path.name} loads at none of the world sizes {WORLD_SIZES}: {batch_errors}"
    )
    _check_loaded(config, world, raw)


def _lookup(data: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        data = data[part]
    return data
