"""Tiny random-weight Hugging Face decoders of every supported family, for tests (no downloads)."""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

__all__ = ["FAMILIES", "tiny_hf_model"]

FAMILIES = ("llama", "mistral", "qwen2", "phi3", "mixtral", "gpt2", "opt", "falcon")


def _config(family: str, layers: int) -> Any:
    hf: Any = importlib.import_module("transformers")

    common: dict[str, Any]
    llama_like: dict[str, Any]
    vocab, hidden, heads = 96, 64, 4
    common = {"vocab_size": vocab, "num_hidden_layers": layers, "num_attention_heads": heads}
    llama_like = {
        **common,
        "hidden_size": hidden,
        "intermediate_size": 96,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    if family == "llama":
        return hf.LlamaConfig(**llama_like, rope_theta=500000.0)
    if family == "mistral":
        return hf.MistralConfig(**llama_like, sliding_window=8)
    if family == "qwen2":
        return hf.Qwen2Config(**llama_like)
    if family == "phi3":
        return hf.Phi3Config(**llama_like)
    if family == "mixtral":
        return hf.MixtralConfig(**llama_like, num_local_experts=4, num_experts_per_tok=2)
    if family == "gpt2":
        return hf.GPT2Config(
            vocab_size=vocab,
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            n_positions=128,
            bos_token_id=1,
            eos_token_id=2,
        )
    if family == "opt":
        return hf.OPTConfig(
            **common,
            hidden_size=hidden,
            ffn_dim=96,
            max_position_embeddings=128,
            word_embed_proj_dim=hidden,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
    if family == "falcon":
        return hf.FalconConfig(
            **common,
            hidden_size=hidden,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            max_position_embeddings=128,
        )
    raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")


def tiny_hf_model(family: str, layers: int = 2, seed: int = 0) -> nn.Module:
    """A random fp32 ``transformers`` causal LM of ``family`` (hidden 64, 4 heads), in eval mode.

    Weights are drawn with a larger spread than Hugging Face's init so that the logits are far
    from uniform and greedy choices are decisive.
    """
    hf: Any = importlib.import_module("transformers")

    torch.manual_seed(seed)
    model = hf.AutoModelForCausalLM.from_config(
        _config(family, layers), attn_implementation="eager"
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "ln" in name:
                param.normal_(1.0, 0.1)
            else:
                param.normal_(0.0, 0.2)
    return model.eval()
