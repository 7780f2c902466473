"""AutoTP for training: shard a Hugging Face decoder's layers in place over a tensor-parallel group.

For Llama-style decoders (Llama, Mistral, Qwen2, Qwen3): in every block the attention's
``q_proj``/``k_proj``/``v_proj`` and the MLP's ``gate_proj``/``up_proj`` become
:class:`ColumnParallelLinear` (each rank keeps whole heads / a slice of the intermediate size),
``o_proj`` and ``down_proj`` become :class:`RowParallelLinear`, the token embedding a
:class:`VocabParallelEmbedding` and the LM head a column-parallel linear whose logits are
gathered (so the model's own loss runs unchanged). Norms stay replicated: their inputs and
gradients are equal on every rank of the group. Works on the module's structure only; it does
not import transformers.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from slipstream.comm.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from slipstream.comm.tensor_parallel.mappings import tensor_parallel_world_size

__all__ = ["SUPPORTED_MODEL_TYPES", "shard_hf_decoder_for_training"]

logger = logging.getLogger(__name__)

# Hugging Face ``config.model_type`` values whose blocks have the Llama layout.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

_COLUMN_ATTENTION = ("q_proj", "k_proj", "v_proj")
_COLUMN_MLP = ("gate_proj", "up_proj")
# Attribute names some transformers versions keep on the attention module and use in reshapes.
_HEAD_COUNTS = ("num_heads", "num_attention_heads", "num_key_value_heads")


def _check_divisible(config: Any, tp_size: int) -> None:
    fields = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")
    for field in fields:
        value = getattr(config, field, None)
        if value is None:
            continue
        if value % tp_size:
            raise ValueError(
                f"tensor_parallel.autotp_size = {tp_size} does not divide the model's "
                f"config.{field} = {value}; choose an autotp_size that divides "
                + ", ".join(f"{f} = {getattr(config, f, None)}" for f in fields)
            )


def shard_hf_decoder_for_training(
    model: torch.nn.Module, group: dist.ProcessGroup | None
) -> torch.nn.Module:
    """Replace ``model``'s linears and embedding by this rank's tensor-parallel shards, in place.

    Every rank of ``group`` must call it with the same model (same weights: seed first, or load
    the same checkpoint); each keeps its slice. Returns ``model``.

    Raises:
        NotImplementedError: the model is not a supported Hugging Face decoder.
        ValueError: a head count, the intermediate size or the vocabulary does not divide by
            the group size.

    >>> shard_hf_decoder_for_training(model, grid.group("tensor"))  # doctest: +SKIP
    """
    tp_size = tensor_parallel_world_size(group)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(
            f"tensor_parallel.autotp_size = {tp_size}: AutoTP training supports Hugging Face "
            f"decoders of model_type {list(SUPPORTED_MODEL_TYPES)}, got "
            f"{model_type!r} ({type(model).__name__}). For another model, build it from "
            "slipstream.comm.tensor_parallel's ColumnParallelLinear/RowParallelLinear/"
            "VocabParallelEmbedding and pass mpu= to initialize"
        )
    if tp_size == 1:
        return model
    _check_divisible(config, tp_size)
    base: Any = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    embed = getattr(base, "embed_tokens", None)
    if layers is None or not isinstance(embed, torch.nn.Embedding):
        raise NotImplementedError(
            f"{type(model).__name__} (model_type {model_type!r}) lacks the expected "
            "model.layers / model.embed_tokens; AutoTP cannot shard this variant"
        )
    for index, layer in enumerate(layers):
        attention, mlp = layer.self_attn, layer.mlp
        for name in _COLUMN_ATTENTION:
            setattr(
                attention, name, ColumnParallelLinear.from_linear(getattr(attention, name), group)
            )
        attention.o_proj = RowParallelLinear.from_linear(attention.o_proj, group)
        for attr in _HEAD_COUNTS:
            value = getattr(attention, attr, None)
            if isinstance(value, int):
                setattr(attention, attr, value // tp_size)
        if isinstance(getattr(attention, "hidden_size", None), int):
            attention.hidden_size //= tp_size
        for name in _COLUMN_MLP:
            setattr(mlp, name, ColumnParallelLinear.from_linear(getattr(mlp, name), group))
        mlp.down_proj = RowParallelLinear.from_linear(mlp.down_proj, group)
        logger.debug("AutoTP: sharded block %d over %d ranks", index, tp_size)

    lm_head = getattr(model, "lm_head", None)
    tied = isinstance(lm_head, torch.nn.Linear) and lm_head.weight is embed.weight
    sharded_embed = VocabParallelEmbedding.from_embedding(embed, group)
    base.embed_tokens = sharded_embed
    if isinstance(lm_head, torch.nn.Linear):
        head = ColumnParallelLinear.from_linear(lm_head, group, gather_output=True)
        if tied:
            # Tied embeddings stay tied: both are split along the vocabulary the same way.
            head.weight = sharded_embed.weight
        model.lm_head = head
    return model
