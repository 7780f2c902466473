"""Fast inference for Hugging Face decoders (DeepSpeed's ``deepspeed.init_inference``).

>>> engine = init_inference(model, dtype=torch.bfloat16, replace_with_kernel_inject=True,
...                         enable_cuda_graph=True)  # doctest: +SKIP
>>> tokens = engine.generate(input_ids, attention_mask=mask, max_new_tokens=64)  # doctest: +SKIP
"""

from __future__ import annotations

from slipstream.inference.adapters import SUPPORTED_ARCHITECTURES, UnsupportedModelError, from_hf
from slipstream.inference.config import InferenceConfig, load_inference_config
from slipstream.inference.engine import CausalLMOutput, InferenceEngine, init_inference
from slipstream.inference.generation import GenerationSettings
from slipstream.inference.model import DecoderSpec, FusedDecoder, KVCache

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CausalLMOutput",
    "DecoderSpec",
    "FusedDecoder",
    "GenerationSettings",
    "InferenceConfig",
    "InferenceEngine",
    "KVCache",
    "UnsupportedModelError",
    "from_hf",
    "init_inference",
    "load_inference_config",
]
