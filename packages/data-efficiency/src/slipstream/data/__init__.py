"""Data efficiency: curriculum learning, difficulty-based sampling and random-LTD.

DeepSpeed's Data Efficiency Library as plain objects over a model, a dataset and an
optimizer; the umbrella engine drives them from the ``curriculum_learning`` and
``data_efficiency`` config blocks.

>>> from slipstream.data import CurriculumScheduler
>>> scheduler = CurriculumScheduler({"min_difficulty": 64, "max_difficulty": 512,
...     "schedule_type": "fixed_root", "schedule_config":
...     {"total_curriculum_step": 100, "difficulty_step": 8, "root_degree": 2}})
>>> scheduler.update_difficulty(25)
288
"""

from __future__ import annotations

from slipstream.data.analyzer import DataAnalyzer
from slipstream.data.config import (
    CurriculumLearningConfig,
    CurriculumMetricConfig,
    CurriculumScheduleConfig,
    DataEfficiencyConfig,
    DataRoutingConfig,
    DataSamplingConfig,
    LayerTokenLRScheduleConfig,
    RandomLTDConfig,
    RandomLTDScheduleConfig,
    RandomLTDScheduleSettings,
    SamplingCurriculumConfig,
)
from slipstream.data.curriculum import CurriculumScheduler
from slipstream.data.dynamic_batching import (
    DynamicBatchSampler,
    batch_by_seqlens,
    dataset_seqlens,
    sample_length,
    scale_lr,
)
from slipstream.data.indexed import IndexedRows, IndexedRowsWriter, write_rows
from slipstream.data.progressive_layer_drop import (
    ProgressiveLayerDrop,
    ProgressiveLayerDropConfig,
    layer_keep_probability,
    run_layers_with_drop,
)
from slipstream.data.random_ltd import (
    LayerTokenLR,
    RandomLayerTokenDrop,
    RandomLTDScheduler,
    attach_random_ltd,
    convert_to_random_ltd,
    gather_tokens,
    remove_random_ltd_state_dict,
    scatter_tokens,
)
from slipstream.data.runtime import STATE_KEY, DataEfficiency
from slipstream.data.sampler import (
    CurriculumDataLoader,
    CurriculumSampler,
    MetricIndex,
    build_curriculum_dataloader,
)
from slipstream.data.seqlen import (
    apply_seqlen_curriculum,
    reshape_batch,
    reshaped_rows,
    seqlen_post_process,
    truncate_batch,
)

__all__ = [
    "STATE_KEY",
    "CurriculumDataLoader",
    "CurriculumLearningConfig",
    "CurriculumMetricConfig",
    "CurriculumSampler",
    "CurriculumScheduleConfig",
    "CurriculumScheduler",
    "DataAnalyzer",
    "DataEfficiency",
    "DataEfficiencyConfig",
    "DataRoutingConfig",
    "DataSamplingConfig",
    "DynamicBatchSampler",
    "IndexedRows",
    "IndexedRowsWriter",
    "LayerTokenLR",
    "LayerTokenLRScheduleConfig",
    "MetricIndex",
    "ProgressiveLayerDrop",
    "ProgressiveLayerDropConfig",
    "RandomLTDConfig",
    "RandomLTDScheduleConfig",
    "RandomLTDScheduleSettings",
    "RandomLTDScheduler",
    "RandomLayerTokenDrop",
    "SamplingCurriculumConfig",
    "apply_seqlen_curriculum",
    "attach_random_ltd",
    "batch_by_seqlens",
    "build_curriculum_dataloader",
    "convert_to_random_ltd",
    "dataset_seqlens",
    "gather_tokens",
    "layer_keep_probability",
    "remove_random_ltd_state_dict",
    "reshape_batch",
    "reshaped_rows",
    "run_layers_with_drop",
    "sample_length",
    "scale_lr",
    "scatter_tokens",
    "seqlen_post_process",
    "truncate_batch",
    "write_rows",
]
