"""A ragged (unpadded) forward of a Llama-architecture Hugging Face model over a paged KV cache.

[Note: weights] This runner calls the Hugging Face module's own projections, MLP and rotary
tables, and runs norms, RoPE and paged attention through ``slipstream.kernels`` ops, so any
checkpoint that loads into ``LlamaForCausalLM``, ``MistralForCausalLM`` or
``Qwen2ForCausalLM`` serves as is. When
``slipstream.inference``'s model adapters (fused blocks, quantized or sharded weights) land,
:class:`PagedDecoder` should take an adapter in place of the HF module: the paged parts
(slot mapping, cache writes, ``paged_attention``) stay as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from slipstream.inference.serving.scheduler import ScheduledChunk
from slipstream.kernels.ops import paged_attention, rms_norm, rotary_embedding

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def _norm(module: Any, x: torch.Tensor) -> torch.Tensor:
    """A Hugging Face RMSNorm through the kernels' ``rms_norm`` op (one Triton kernel on a GPU
    instead of seven eager ops; in fp32 the same arithmetic as Hugging Face's)."""
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
    return rms_norm(x, module.weight, eps)


def check_supported(model: nn.Module, max_model_len: int) -> None:
    """Raise ValueError unless ``model`` is a Llama-architecture causal LM this runner serves."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"serving supports Hugging Face models of type {', '.join(SUPPORTED_MODEL_TYPES)}; "
            f"got model_type={model_type!r} ({type(model).__name__})"
        )
    window = getattr(config, "sliding_window", None)
    uses_window = getattr(config, "use_sliding_window", model_type == "mistral")
    if uses_window and window is not None and max_model_len > window:
        raise ValueError(
            f"this {model_type} model attends over a sliding window of {window} tokens, which "
            f"serving does not implement; set max_model_len <= {window}"
        )


class PagedDecoder:
    """Runs scheduled chunks of many requests as one ragged batch, writing and reading the KV
    cache through block tables (``(num_blocks, block_size, kv_heads, head_dim)`` per layer)."""

    def __init__(self, model: nn.Module, *, num_blocks: int, block_size: int) -> None:
        hf: Any = model.eval()
        config = hf.config
        self.model = model
        self.decoder: Any = hf.model
        self.lm_head: nn.Module = hf.lm_head
        self.block_size = block_size
        self.num_blocks = num_blocks
        weight: torch.Tensor = self.decoder.embed_tokens.weight
        self.device: torch.device = weight.device
        self.dtype: torch.dtype = weight.dtype
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = self.decoder.layers[0].self_attn.head_dim
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        self.key_cache = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.decoder.layers
        ]
        self.value_cache = [torch.zeros_like(cache) for cache in self.key_cache]

    @staticmethod
    def bytes_per_block(model: nn.Module, block_size: int) -> int:
        """KV-cache bytes one block takes over all layers (keys and values)."""
        hf: Any = model
        config = hf.config
        head_dim = hf.model.layers[0].self_attn.head_dim
        element = hf.model.embed_tokens.weight.element_size()
        per_token = 2 * config.num_key_value_heads * head_dim * element
        return int(per_token * block_size * config.num_hidden_layers)

    def _metadata(self, chunks: Sequence[ScheduledChunk]) -> dict[str, Any]:
        max_blocks = max(len(chunk.block_table) for chunk in chunks)
        tables = [
            chunk.block_table + [0] * (max_blocks - len(chunk.block_table)) for chunk in chunks
        ]
        lengths = [len(chunk.token_ids) for chunk in chunks]
        starts = [0]
        for length in lengths:
            starts.append(starts[-1] + length)
        flat = [token for chunk in chunks for token in chunk.token_ids]
        host = {
            "input_ids": torch.tensor(flat, dtype=torch.long),
            "block_tables": torch.tensor(tables, dtype=torch.int32),
            "seq_lens": torch.tensor(
                [c.start + n for c, n in zip(chunks, lengths)], dtype=torch.int32
            ),
            "query_start_loc": torch.tensor(starts, dtype=torch.int32),
            "context": torch.tensor([c.start for c in chunks], dtype=torch.long),
        }
        meta: dict[str, Any] = {k: v.to(self.device, non_blocking=True) for k, v in host.items()}
        # Position and cache slot of every token, computed on the device from the small tensors.
        token_seq = torch.repeat_interleave(
            torch.arange(len(chunks), device=self.device), torch.tensor(lengths, device=self.device)
        )
        offsets = torch.arange(len(flat), device=self.device) - meta["query_start_loc"][token_seq]
        positions = meta["context"][token_seq] + offsets
        block = meta["block_tables"][token_seq, positions // self.block_size].long()
        meta["positions"] = positions
        meta["slots"] = block * self.block_size + positions % self.block_size
        meta["max_query_len"] = max(lengths)
        # Rows whose logits are sampled: the last token of each chunk that reaches its end.
        meta["sample_rows"] = torch.tensor(
            [starts[i + 1] - 1 for i, chunk in enumerate(chunks) if chunk.samples],
            dtype=torch.long,
        ).to(self.device, non_blocking=True)
        return meta

    @torch.inference_mode()
    def forward(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """Compute every chunk's tokens; return fp32 logits of the sampling chunks, in order."""
        meta = self._metadata(chunks)
        hidden = self.decoder.embed_tokens(meta["input_ids"])
        cos, sin = self.decoder.rotary_emb(hidden[None], meta["positions"][None])
        # Hugging Face's tables repeat the half table twice (NeoX "rotate half" layout): the
        # rotary op takes the half, (tokens, 1, head_dim / 2), in fp32.
        half = self.head_dim // 2
        cos, sin = cos[0, :, None, :half].float(), sin[0, :, None, :half].float()
        tokens = hidden.shape[0]
        for index, layer in enumerate(self.decoder.layers):
            attn = layer.self_attn
            x = _norm(layer.input_layernorm, hidden)
            q = attn.q_proj(x).view(tokens, self.num_heads, self.head_dim)
            k = attn.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
            v = attn.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
            q = rotary_embedding(q, cos, sin)
            k = rotary_embedding(k, cos, sin)
            key_cache, value_cache = self.key_cache[index], self.value_cache[index]
            # Every token's keys/values of this layer land in the cache before any attention
            # reads it (see [Note: caching blocks before they are written] in block_pool.py).
            key_cache.view(-1, self.num_kv_heads, self.head_dim)[meta["slots"]] = k
            value_cache.view(-1, self.num_kv_heads, self.head_dim)[meta["slots"]] = v
            out = paged_attention(
                q,
                key_cache,
                value_cache,
                meta["block_tables"],
                meta["seq_lens"],
                meta["query_start_loc"],
                scale=attn.scaling,
                max_query_len=meta["max_query_len"],
            )
            hidden = hidden + attn.o_proj(out.reshape(tokens, -1))
            hidden = hidden + layer.mlp(_norm(layer.post_attention_layernorm, hidden))
        last = _norm(self.decoder.norm, hidden[meta["sample_rows"]])
        return self.lm_head(last).float()  # type: ignore[no-any-return]
