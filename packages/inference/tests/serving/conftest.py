"""Tiny random Llama-architecture models and a local character-level tokenizer (no downloads)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

ALPHABET = " abcdefghijklmnopqrstuvwxyz.,!?'ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789\n:"
VOCAB = 4 + len(set(ALPHABET))  # the tokenizer's size: every id the model emits decodes
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def tiny_model(model_type: str = "llama", seed: int = 0, vocab: int = VOCAB) -> Any:
    """A 2-layer random model of ``model_type`` (GQA with 4 query heads on 2 KV heads but for
    GPT-2), fp32."""
    kwargs: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    if model_type == "qwen2":
        config = transformers.Qwen2Config(**kwargs)  # q/k/v projections with bias
    elif model_type == "mixtral":  # 4 experts, top 2
        config = transformers.MixtralConfig(**kwargs, num_local_experts=4, num_experts_per_tok=2)
    elif model_type == "gpt2":  # learned positions, LayerNorm, biases, no GQA
        config = transformers.GPT2Config(
            vocab_size=vocab,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=256,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
    else:
        config = transformers.LlamaConfig(**kwargs)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def char_tokenizer() -> Any:
    """A character-level PreTrainedTokenizerFast: ids 0-3 special, then one id per character."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for char in ALPHABET:
        vocab.setdefault(char, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    """The shared character tokenizer."""
    return char_tokenizer()


@pytest.fixture(scope="session")
def model() -> Any:
    """The shared tiny random Llama."""
    return tiny_model("llama")


@pytest.fixture(scope="session")
def make_model() -> Any:
    """The :func:`tiny_model` factory, for tests that need another type or seed."""
    return tiny_model
