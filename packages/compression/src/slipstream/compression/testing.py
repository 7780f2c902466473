"""Test helpers: DeepSpeed's compression configs and tiny Hugging Face models (built, never downloaded)."""

from __future__ import annotations

import copy
from typing import Any

import torch

# DeepSpeed's own unit-test config (tests/unit/compression/test_compression.py), unchanged.
DEEPSPEED_TEST_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 1,
    "optimizer": {"type": "Lamb", "params": {"lr": 0.00015}},
    "fp16": {"enabled": True},
    "compression_training": {
        "weight_quantization": {
            "shared_parameters": {
                "enabled": True,
                "quantizer_kernel": False,
                "schedule_offset": 50,
                "quantize_groups": 1,
                "quantize_verbose": False,
                "quantization_type": "asymmetric",
                "rounding": "nearest",
                "fp16_mixed_quantize": {"enabled": False, "quantize_change_ratio": 0.001},
            },
            "different_groups": {
                "wq1": {
                    "params": {"start_bits": 12, "target_bits": 8, "quantization_period": 50},
                    "modules": ["attention.self", "intermediate"],
                },
                "wq2": {
                    "params": {"start_bits": 12, "target_bits": 4, "quantization_period": 50},
                    "modules": ["attention.output"],
                },
            },
        },
        "activation_quantization": {
            "shared_parameters": {
                "enabled": True,
                "quantization_type": "asymmetric",
                "range_calibration": "dynamic",
                "schedule_offset": 50,
            },
            "different_groups": {"aq1": {"params": {"bits": 8}, "modules": ["attention.output"]}},
        },
        "sparse_pruning": {
            "shared_parameters": {"enabled": True, "schedule_offset": 30, "method": "l1"},
            "different_groups": {
                "sp1": {"params": {"dense_ratio": 0.5}, "modules": ["attention.self"]}
            },
        },
        "row_pruning": {
            "shared_parameters": {"enabled": True, "schedule_offset": 20, "method": "topk"},
            "different_groups": {
                "rp1": {
                    "params": {"dense_ratio": 0.5},
                    "modules": ["intermediate.dense"],
                    "related_modules": [["layer.\\w+.output.dense"]],
                }
            },
        },
        "head_pruning": {
            "shared_parameters": {
                "enabled": True,
                "schedule_offset": 10,
                "method": "topk",
                "num_heads": 12,
            },
            "different_groups": {
                "rp1": {
                    "params": {"dense_ratio": 0.5},
                    "modules": ["attention.output.dense"],
                    "related_modules": [["self.query", "self.key", "self.value"]],
                }
            },
        },
    },
}

# The layer-reduction block of DeepSpeed's config docs (BERT-base: 12 layers -> 5).
LAYER_REDUCTION_DOCS: dict[str, Any] = {
    "enabled": True,
    "keep_number_layer": 5,
    "module_name_prefix": "bert.encoder.layer",
    "teacher_layer": [2, 4, 6, 8, 10],
    "other_module_name": ["bert.pooler", "bert.embeddings", "classifier"],
}


def deepspeed_config() -> dict[str, Any]:
    """A fresh copy of DeepSpeed's unit-test config."""
    return copy.deepcopy(DEEPSPEED_TEST_CONFIG)


def tiny_bert(layers: int = 2, heads: int = 12, seed: int = 0) -> torch.nn.Module:
    """A BERT classifier with DeepSpeed's module names, small enough for CPU tests."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.BertConfig(
        hidden_size=48,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=96,
        vocab_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForSequenceClassification(config).eval()


def tiny_llama(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """A Llama causal LM (what slipstream.inference fuses), small enough for CPU tests."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=96,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config).eval()
