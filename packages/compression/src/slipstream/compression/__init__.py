"""DeepSpeed-Compression for Slipstream: QAT, ZeroQuant, XTC, pruning, layer reduction, export."""

from __future__ import annotations

from slipstream.compression.compress import (
    init_compression,
    redundancy_clean,
    student_initialization,
)
from slipstream.compression.config import CompressionConfig, compression_config
from slipstream.compression.distillation import distill, distillation_loss, layerwise_distillation
from slipstream.compression.export import save_compressed
from slipstream.compression.layers import (
    CompressionState,
    Conv2dCompress,
    EmbeddingCompress,
    LinearCompress,
)
from slipstream.compression.recipes import xtc, xtc_config, zeroquant, zeroquant_config
from slipstream.compression.scheduler import CompressionScheduler

__all__ = [
    "CompressionConfig",
    "CompressionScheduler",
    "CompressionState",
    "Conv2dCompress",
    "EmbeddingCompress",
    "LinearCompress",
    "compression_config",
    "distill",
    "distillation_loss",
    "init_compression",
    "layerwise_distillation",
    "redundancy_clean",
    "save_compressed",
    "student_initialization",
    "xtc",
    "xtc_config",
    "zeroquant",
    "zeroquant_config",
]
