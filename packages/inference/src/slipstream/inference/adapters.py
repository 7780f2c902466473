"""Model adapters: a Hugging Face decoder's config and weights mapped onto a FusedDecoder.

Each adapter reads the HF model object (duck-typed: no import of ``transformers``) and returns
the :class:`DecoderSpec` plus a state dict in the fused layout: ``qkv`` is ``[q; k; v]`` rows,
``up`` of a gated MLP is ``[gate; up]`` rows. Tensors that need no fusing are shared, not copied.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from slipstream.inference.model import DecoderSpec, FusedDecoder

__all__ = ["SUPPORTED_ARCHITECTURES", "UnsupportedModelError", "from_hf"]


class UnsupportedModelError(NotImplementedError):
    """The model's architecture (or one of its options) has no fused adapter yet."""


def _refuse(family: str, what: str) -> None:
    raise UnsupportedModelError(
        f"kernel injection for {family}: {what} is not supported yet; pass "
        "replace_with_kernel_inject=False to serve the Hugging Face model unfused"
    )


def _rotary_of(rotary_module: Any, family: str) -> tuple[torch.Tensor, float]:
    """The inverse frequencies and attention scaling of an HF rotary module (static RoPE only)."""
    rope_type = getattr(rotary_module, "rope_type", "default")
    if rope_type in ("dynamic", "longrope"):
        _refuse(family, f"rope type {rope_type!r} (its frequencies change with the length)")
    return rotary_module.inv_freq.detach().float(), float(
        getattr(rotary_module, "attention_scaling", 1.0)
    )


def _sliding_window(config: Any, family: str) -> int | None:
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        kinds = set(layer_types)
        if kinds == {"full_attention"}:
            return None
        if kinds != {"sliding_attention"}:
            _refuse(family, f"a mix of attention layer types {sorted(kinds)}")
    if family == "qwen2" and not getattr(config, "use_sliding_window", False):
        return None
    return window


def _llama_like(model: Any, family: str) -> tuple[DecoderSpec, dict[str, Any], dict]:
    """Llama 1/2/3, Mistral, Qwen2, Phi-3 and Mixtral: pre-norm RMSNorm, rotary, gated SiLU."""
    config, base = model.config, model.model
    if getattr(config, "hidden_act", "silu") != "silu":
        _refuse(family, f"hidden_act {config.hidden_act!r}")
    heads = config.num_attention_heads
    kv_heads = config.num_key_value_heads or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    inv_freq, scaling = _rotary_of(base.rotary_emb, family)
    moe = family == "mixtral"
    spec = DecoderSpec(
        family=family,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=config.intermediate_size,
        norm="rms",
        norm_eps=config.rms_norm_eps,
        position="rotary",
        rotary_dim=2 * inv_freq.numel(),
        max_positions=config.max_position_embeddings,
        mlp="moe" if moe else "gated",
        activation="silu",
        sliding_window=_sliding_window(config, family),
        num_experts=config.num_local_experts if moe else 0,
        experts_per_token=config.num_experts_per_tok if moe else 0,
    )
    state: dict[str, torch.Tensor] = {"embed.weight": base.embed_tokens.weight}
    biases = {"attn": False, "out": False, "mlp": False}
    for index, layer in enumerate(base.layers):
        attn, mlp, prefix = layer.self_attn, layer.mlp, f"blocks.{index}."
        if hasattr(attn, "qkv_proj"):  # Phi-3 ships QKV fused already
            qkv = [attn.qkv_proj]
        else:
            qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        state[prefix + "qkv.weight"] = _cat([m.weight for m in qkv])
        if qkv[0].bias is not None:
            biases["attn"] = True
            state[prefix + "qkv.bias"] = _cat([m.bias for m in qkv])
        state[prefix + "out.weight"] = attn.o_proj.weight
        if attn.o_proj.bias is not None:
            biases["out"] = True
            state[prefix + "out.bias"] = attn.o_proj.bias
        state[prefix + "input_norm.weight"] = layer.input_layernorm.weight
        state[prefix + "post_norm.weight"] = layer.post_attention_layernorm.weight
        if moe:
            state[prefix + "moe.router.weight"] = mlp.gate.weight
            if hasattr(mlp.experts, "gate_up_proj"):  # transformers 5: experts as 3-D tensors
                state[prefix + "moe.gate_up"] = mlp.experts.gate_up_proj
                state[prefix + "moe.down"] = mlp.experts.down_proj
            else:  # transformers 4: one module per expert, w1 = gate, w3 = up, w2 = down
                experts = list(mlp.experts)
                state[prefix + "moe.gate_up"] = torch.stack(
                    [torch.cat([e.w1.weight, e.w3.weight]).detach() for e in experts]
                )
                state[prefix + "moe.down"] = torch.stack([e.w2.weight.detach() for e in experts])
            continue
        ups = [mlp.gate_up_proj] if hasattr(mlp, "gate_up_proj") else [mlp.gate_proj, mlp.up_proj]
        state[prefix + "up.weight"] = _cat([m.weight for m in ups])
        state[prefix + "down.weight"] = mlp.down_proj.weight
        if ups[0].bias is not None:
            biases["mlp"] = True
            state[prefix + "up.bias"] = _cat([m.bias for m in ups])
            state[prefix + "down.bias"] = mlp.down_proj.bias
    state["final_norm.weight"] = base.norm.weight
    state["head.weight"] = model.lm_head.weight
    kwargs = {
        "attn_bias": biases["attn"],
        "out_bias": biases["out"],
        "mlp_bias": biases["mlp"],
        "inv_freq": inv_freq,
        "rotary_scaling": scaling,
    }
    return spec, kwargs, state


def _gpt2(model: Any, family: str) -> tuple[DecoderSpec, dict[str, Any], dict]:
    config, base = model.config, model.transformer
    if getattr(config, "scale_attn_by_inverse_layer_idx", False):
        _refuse(family, "scale_attn_by_inverse_layer_idx")
    activation = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
    if config.activation_function not in activation:
        _refuse(family, f"activation_function {config.activation_function!r}")
    hidden, heads = config.n_embd, config.n_head
    spec = DecoderSpec(
        family=family,
        vocab_size=config.vocab_size,
        hidden_size=hidden,
        num_layers=config.n_layer,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=config.n_inner or 4 * hidden,
        norm="layer",
        norm_eps=config.layer_norm_epsilon,
        position="learned",
        max_positions=config.n_positions,
        mlp="plain",
        activation=activation[config.activation_function],  # type: ignore[arg-type]
        attention_scale=None if config.scale_attn_weights else 1.0,
    )
    state: dict[str, torch.Tensor] = {
        "embed.weight": base.wte.weight,
        "positions.weight": base.wpe.weight,
    }
    for index, layer in enumerate(base.h):
        prefix = f"blocks.{index}."
        # GPT-2's Conv1D stores weights as (in, out): transposed into nn.Linear's (out, in).
        for ours, theirs in (
            ("qkv", layer.attn.c_attn),
            ("out", layer.attn.c_proj),
            ("up", layer.mlp.c_fc),
            ("down", layer.mlp.c_proj),
        ):
            state[prefix + ours + ".weight"] = theirs.weight.t()
            state[prefix + ours + ".bias"] = theirs.bias
        for ours, theirs in (("input_norm", layer.ln_1), ("post_norm", layer.ln_2)):
            state[prefix + ours + ".weight"] = theirs.weight
            state[prefix + ours + ".bias"] = theirs.bias
    state["final_norm.weight"] = base.ln_f.weight
    state["final_norm.bias"] = base.ln_f.bias
    state["head.weight"] = model.lm_head.weight
    return spec, {"attn_bias": True, "out_bias": True, "mlp_bias": True}, state


def _opt(model: Any, family: str) -> tuple[DecoderSpec, dict[str, Any], dict]:
    config, base = model.config, model.model.decoder
    if not config.do_layer_norm_before:
        _refuse(family, "do_layer_norm_before=False (post-norm OPT-350m)")
    if config.word_embed_proj_dim != config.hidden_size:
        _refuse(family, "word_embed_proj_dim != hidden_size (project_in/project_out)")
    if not getattr(config, "layer_norm_elementwise_affine", True):
        _refuse(family, "layer_norm_elementwise_affine=False")
    if config.activation_function not in ("relu", "gelu"):
        _refuse(family, f"activation_function {config.activation_function!r}")
    hidden, heads = config.hidden_size, config.num_attention_heads
    spec = DecoderSpec(
        family=family,
        vocab_size=config.vocab_size,
        hidden_size=hidden,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=config.ffn_dim,
        norm="layer",
        norm_eps=1e-5,
        position="learned",
        learned_offset=2,
        max_positions=config.max_position_embeddings,
        mlp="plain",
        activation=config.activation_function,
    )
    bias = bool(getattr(config, "enable_bias", True))
    state: dict[str, torch.Tensor] = {
        "embed.weight": base.embed_tokens.weight,
        "positions.weight": base.embed_positions.weight,
    }
    for index, layer in enumerate(base.layers):
        attn, prefix = layer.self_attn, f"blocks.{index}."
        qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        pairs = {"out": attn.out_proj, "up": layer.fc1, "down": layer.fc2}
        state[prefix + "qkv.weight"] = _cat([m.weight for m in qkv])
        if bias:
            state[prefix + "qkv.bias"] = _cat([m.bias for m in qkv])
        for ours, theirs in pairs.items():
            state[prefix + ours + ".weight"] = theirs.weight
            if bias:
                state[prefix + ours + ".bias"] = theirs.bias
        for ours, theirs in (
            ("input_norm", layer.self_attn_layer_norm),
            ("post_norm", layer.final_layer_norm),
        ):
            state[prefix + ours + ".weight"] = theirs.weight
            state[prefix + ours + ".bias"] = theirs.bias
    state["final_norm.weight"] = base.final_layer_norm.weight
    state["final_norm.bias"] = base.final_layer_norm.bias
    state["head.weight"] = model.lm_head.weight
    return spec, {"attn_bias": bias, "out_bias": bias, "mlp_bias": bias}, state


def _falcon(model: Any, family: str) -> tuple[DecoderSpec, dict[str, Any], dict]:
    config, base = model.config, model.transformer
    if config.new_decoder_architecture:
        _refuse(family, "new_decoder_architecture (Falcon-40B/180B layout)")
    if config.alibi or not config.rotary:
        _refuse(family, "ALiBi positions")
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = hidden // heads
    kv_heads = 1 if config.multi_query else heads
    inv_freq, scaling = _rotary_of(base.rotary_emb, family)
    activation = getattr(config, "activation", "gelu")
    if activation != "gelu":
        _refuse(family, f"activation {activation!r}")
    spec = DecoderSpec(
        family=family,
        vocab_size=config.vocab_size,
        hidden_size=hidden,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=getattr(config, "ffn_hidden_size", None) or 4 * hidden,
        norm="layer",
        norm_eps=config.layer_norm_epsilon,
        position="rotary",
        rotary_dim=2 * inv_freq.numel(),
        max_positions=getattr(config, "max_position_embeddings", 2048),
        mlp="plain",
        activation="gelu",
        parallel_residual=config.parallel_attn,
    )
    state: dict[str, torch.Tensor] = {"embed.weight": base.word_embeddings.weight}
    for index, layer in enumerate(base.h):
        attn, prefix = layer.self_attention, f"blocks.{index}."
        weight = attn.query_key_value.weight
        if not config.multi_query:  # per-head [q, k, v] interleaving -> [all q; all k; all v]
            weight = weight.view(heads, 3, head_dim, hidden).transpose(0, 1).reshape(-1, hidden)
        state[prefix + "qkv.weight"] = weight
        pairs = {
            "out": attn.dense,
            "up": layer.mlp.dense_h_to_4h,
            "down": layer.mlp.dense_4h_to_h,
        }
        for ours, theirs in pairs.items():
            state[prefix + ours + ".weight"] = theirs.weight
        if config.bias:
            _refuse(family, "bias=True")
        state[prefix + "input_norm.weight"] = layer.input_layernorm.weight
        state[prefix + "input_norm.bias"] = layer.input_layernorm.bias
        if not config.parallel_attn:
            state[prefix + "post_norm.weight"] = layer.post_attention_layernorm.weight
            state[prefix + "post_norm.bias"] = layer.post_attention_layernorm.bias
    state["final_norm.weight"] = base.ln_f.weight
    state["final_norm.bias"] = base.ln_f.bias
    state["head.weight"] = model.lm_head.weight
    return spec, {"inv_freq": inv_freq, "rotary_scaling": scaling}, state


_Adapter = Callable[[Any, str], tuple[DecoderSpec, dict[str, Any], dict]]
# HF `config.model_type` -> adapter.
_ADAPTERS: dict[str, _Adapter] = {
    "llama": _llama_like,
    "mistral": _llama_like,
    "qwen2": _llama_like,
    "phi3": _llama_like,
    "mixtral": _llama_like,
    "gpt2": _gpt2,
    "opt": _opt,
    "falcon": _falcon,
}
SUPPORTED_ARCHITECTURES = tuple(sorted(_ADAPTERS))


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat([t.detach() for t in tensors])


def from_hf(model: nn.Module) -> FusedDecoder:
    """Build a :class:`FusedDecoder` from a Hugging Face causal LM (weights shared or fused).

    Raises:
        UnsupportedModelError: for a ``model_type`` without an adapter (the message lists the
            supported ones) or an option of a supported family that is not handled yet.
    """
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None)
    if family not in _ADAPTERS:
        raise UnsupportedModelError(
            f"kernel injection has no adapter for model_type {family!r} "
            f"({type(model).__name__}); supported: {', '.join(SUPPORTED_ARCHITECTURES)}. Pass "
            "replace_with_kernel_inject=False to serve the Hugging Face model unfused"
        )
    spec, kwargs, state = _ADAPTERS[family](model, family)
    with torch.device("meta"):
        fused = FusedDecoder(spec, head_bias=False, **kwargs)
    device = state["embed.weight"].device
    inv_freq = kwargs.get("inv_freq")
    fused.load_state_dict(
        {name: tensor.detach() for name, tensor in state.items()}, strict=True, assign=True
    )
    fused.inv_freq = (inv_freq if inv_freq is not None else torch.zeros(0)).to(
        device=device, dtype=torch.float32
    )
    return fused.eval()
