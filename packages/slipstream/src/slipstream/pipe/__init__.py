"""DeepSpeed's ``deepspeed.pipe`` names, from slipstream-pipeline.

>>> from slipstream.pipe import LayerSpec, PipelineModule, TiedLayerSpec
"""

from __future__ import annotations

from slipstream.comm.topology import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
)
from slipstream.pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = [
    "LayerSpec",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineModule",
    "ProcessTopology",
    "TiedLayerSpec",
]
