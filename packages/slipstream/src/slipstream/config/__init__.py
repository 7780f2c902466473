"""The DeepSpeed-compatible config: typed blocks, ``load_config`` and the recognised-feature table.

>>> from slipstream.config import load_config
>>> config = load_config({"train_batch_size": 8, "bf16": {"enabled": True}}, world_size=2)
>>> config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps
(4, 1)
"""

from __future__ import annotations

from slipstream.comm.config import CommsLoggerConfig, TensorParallelConfig
from slipstream.config.batch import BatchSizes, resolve_batch_sizes
from slipstream.config.blocks import AmdSpecificConfig, OptimizerConfig, SchedulerConfig
from slipstream.config.features import (
    RECOGNISED_FEATURES,
    RecognisedFeature,
    check_recognised_features,
)
from slipstream.config.loading import parse_config_text, read_config_source, strip_json_comments
from slipstream.config.monitor import CometConfig, CsvMonitorConfig, TensorBoardConfig, WandbConfig
from slipstream.config.precision import BF16Config, FP16Config, parse_communication_dtype
from slipstream.config.top_level import SlipstreamConfig, load_config
from slipstream.config.zero import AioConfig, OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig
from slipstream.kernels.config_schema import (
    AutoValueError,
    ConfigError,
    NotImplementedFeatureError,
)

__all__ = [
    "RECOGNISED_FEATURES",
    "AioConfig",
    "AmdSpecificConfig",
    "AutoValueError",
    "BF16Config",
    "BatchSizes",
    "CometConfig",
    "CommsLoggerConfig",
    "ConfigError",
    "CsvMonitorConfig",
    "FP16Config",
    "NotImplementedFeatureError",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "RecognisedFeature",
    "SchedulerConfig",
    "SlipstreamConfig",
    "TensorBoardConfig",
    "TensorParallelConfig",
    "WandbConfig",
    "ZeroConfig",
    "check_recognised_features",
    "load_config",
    "parse_communication_dtype",
    "parse_config_text",
    "read_config_source",
    "resolve_batch_sizes",
    "strip_json_comments",
]
