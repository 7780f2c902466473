"""Make a Hugging Face decoder (Llama-style attention interface) use Ulysses attention."""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist

from slipstream.comm.sequence import _group_size, check_ulysses_heads, seq_all_to_all

__all__ = ["apply_ulysses_attention"]

_names = itertools.count()


def _local_causal_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout: float,
    scaling: float | None,
) -> torch.Tensor:
    """Causal attention over the whole sequence: ``[b, h, S, d]`` in, ``[b, S, h, d]`` out."""
    if key.shape[1] != query.shape[1]:
        repeat = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(repeat, dim=1)
        value = value.repeat_interleave(repeat, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, dropout_p=dropout, scale=scaling, is_causal=True
    )
    return out.transpose(1, 2)


def _spread_kv(tensor: torch.Tensor, size: int) -> torch.Tensor:
    heads = tensor.shape[1]
    if heads % size == 0:
        return tensor
    if size % heads == 0:
        return tensor.repeat_interleave(size // heads, dim=1)
    raise ValueError(
        f"the model has {heads} key/value heads, which neither divide by the sequence-parallel "
        f"size {size} nor divide it; use a sequence_parallel_size that is a multiple or a "
        "divisor of num_key_value_heads"
    )


def apply_ulysses_attention(
    model: torch.nn.Module, sequence_process_group: dist.ProcessGroup | None
) -> torch.nn.Module:
    """Switch a Hugging Face decoder to Ulysses attention over ``sequence_process_group``.

    Registers an attention function with transformers' ``AttentionInterface`` (all-to-all to
    the whole sequence for ``1/SP`` of the heads, causal SDPA, all-to-all back) and selects it
    in the model's config. Feed each rank its slice from
    :func:`slipstream.comm.sequence.shard_sequence` (``input_ids`` and the global
    ``position_ids``) and take the loss with
    :func:`~slipstream.comm.sequence.sequence_parallel_cross_entropy` on ``shift_labels``.
    Causal, unpadded (packed) sequences only: a forward given an ``attention_mask`` with
    padding raises, as does one without ``position_ids`` on an SP group larger than one.
    On a tensor-parallel model (AutoTP) Ulysses splits each rank's ``1/TP`` of the heads;
    :func:`~slipstream.comm.sequence.check_ulysses_heads` says which counts work.

    >>> model = LlamaForCausalLM(config)  # doctest: +SKIP
    >>> apply_ulysses_attention(model, grid.sequence_group)  # doctest: +SKIP
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    config: Any = model.config
    size = _group_size(sequence_process_group)
    # A tensor-parallel model (AutoTP, the layers of slipstream.comm.tensor_parallel) keeps
    # 1/TP of the heads on each rank: Ulysses splits those.
    tp = max((int(getattr(p, "tp_size", 1)) for p in model.parameters()), default=1)
    check_ulysses_heads(
        config.num_attention_heads, getattr(config, "num_key_value_heads", None), size, tp
    )

    def attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        group = sequence_process_group
        # [b, h, s/SP, d] -> [b, h/SP, s, d]: scatter heads (1), gather the sequence (2).
        q = seq_all_to_all(query, 1, 2, group)
        k = seq_all_to_all(_spread_kv(key, size), 1, 2, group)
        v = seq_all_to_all(_spread_kv(value, size), 1, 2, group)
        context = _local_causal_attention(module, q, k, v, dropout, scaling)
        # [b, s, h/SP, d] -> [b, s/SP, h, d]: scatter the sequence (1), gather heads (2).
        return seq_all_to_all(context, 1, 2, group), None

    name = f"slipstream_ulysses_{next(_names)}"
    AttentionInterface.register(name, attention)
    # The mask is causal by construction (is_causal over the gathered sequence): the model
    # builds none, which also keeps it from building one for the local slice length.
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, lambda *args, **kwargs: None)
    config._attn_implementation = name

    def check_inputs(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        mask = kwargs.get("attention_mask")
        if mask is not None and not bool(torch.all(mask != 0)):
            raise ValueError(
                "Ulysses attention takes causal, unpadded sequences: an attention_mask with "
                "padding was given; pack the sequences instead (or drop attention_mask)"
            )
        if size > 1 and kwargs.get("position_ids") is None:
            raise ValueError(
                "Ulysses attention needs each rank's global position_ids (the model would "
                "number every slice from 0); pass those of slipstream.comm.sequence."
                "shard_sequence"
            )

    model.register_forward_pre_hook(check_inputs, with_kwargs=True)
    return model
