"""DeepSpeed-Compression for Slipstream: QAT, ZeroQuant, XTC, pruning, layer reduction, export."""

from __future__ import annotations

from slipstream.compression.compress import (
    init_compression,
    redundancy_clean,
    student_initialization,
)
from slipstream.compression.config import CompressionConfig, compression_config
from slipstream.compression.layers import (
    CompressionState,
    Conv2dCompress,
    EmbeddingCompress,
    LinearCompress,
)
from slipstream.compression.scheduler import CompressionScheduler

__all__ = [
    "CompressionConfig",
    "CompressionScheduler",
    "CompressionState",
    "Conv2dCompress",
    "EmbeddingCompress",
    "LinearCompress",
    "compression_config",
    "init_compression",
    "redundancy_clean",
    "student_initialization",
]
