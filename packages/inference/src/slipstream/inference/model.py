"""The fused decoder: one block type for every supported family, over a static KV cache."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from slipstream.kernels.ops import (
    add_rms_norm,
    decode_attention,
    decode_inputs,
    gated_activation,
    layer_norm,
    moe_gemv,
    rms_norm,
    rotary_embedding,
    rotary_kv_write,
)

__all__ = ["DecoderSpec", "FusedBlock", "FusedDecoder", "KVCache", "attention_mask"]

MOE_DECODE_ROWS = 64  # (token, expert) rows up to which a GPU MoE layer runs moe_gemv


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
    """The shape and the variant choices of a decoder, read from a Hugging Face config.

    Heads are the global counts; a tensor-parallel model holds ``num_heads // tp_size`` of them
    (see :func:`slipstream.inference.tensor_parallel.shard_decoder`).
    """

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm: Literal["rms", "layer"] = "rms"
    norm_eps: float = 1e-6
    position: Literal["rotary", "learned"] = "rotary"
    rotary_dim: int = 0  # features rotated per head (partial rotary when < head_dim)
    learned_offset: int = 0  # OPT's learned positions start at 2
    max_positions: int = 2048
    mlp: Literal["gated", "plain", "moe"] = "gated"
    activation: Literal["silu", "gelu", "gelu_tanh", "relu"] = "silu"
    parallel_residual: bool = False  # Falcon: attention and MLP both read the same normed input
    sliding_window: int | None = None
    num_experts: int = 0
    experts_per_token: int = 0
    attention_scale: float | None = None  # default 1/sqrt(head_dim)

    @property
    def scale(self) -> float:
        """The softmax scale of the attention scores."""
        return self.attention_scale or 1.0 / math.sqrt(self.head_dim)


@dataclasses.dataclass
class KVCache:
    """Preallocated keys and values: ``(layers, batch, kv_heads, max_len, head_dim)`` each.

    Slot ``s`` of every row holds the token fed at step ``s``; left padding occupies slots too
    and is masked out by ``key_valid`` (the semantics of Hugging Face's static cache).
    """

    keys: torch.Tensor
    values: torch.Tensor

    @classmethod
    def allocate(
        cls,
        spec: DecoderSpec,
        batch: int,
        max_len: int,
        kv_heads: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        """Zeroed buffers for ``batch`` rows of ``max_len`` slots (``kv_heads`` local heads)."""
        shape = (spec.num_layers, batch, kv_heads, max_len, spec.head_dim)
        return cls(
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )

    @property
    def max_len(self) -> int:
        """Slots per row."""
        return self.keys.shape[3]


def attention_mask(
    key_valid: torch.Tensor, slots: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """Boolean ``(batch, 1, queries, keys)``: a query at slot ``q`` sees valid keys at ``k <= q``.

    ``key_valid`` is ``(batch, keys)``, ``slots`` the queries' slot indices ``(queries,)``.
    A query whose row has no visible key (a pad position) is let see itself, so that softmax
    stays finite; its output is never used.
    """
    key_slots = torch.arange(key_valid.shape[1], device=key_valid.device)
    causal = key_slots[None, :] <= slots[:, None]
    if sliding_window is not None:
        causal = causal & (slots[:, None] - key_slots[None, :] < sliding_window)
    allowed = causal[None] & key_valid[:, None, :]
    allowed = allowed | (key_slots[None, :] == slots[:, None])[None]
    return allowed[:, None]


def _activation(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "silu":
        return F.silu(x)
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    return F.relu(x)


class Norm(nn.Module):
    """RMSNorm or LayerNorm through ``slipstream.kernels`` (Triton on GPU, torch on CPU)."""

    def __init__(self, kind: str, size: int, eps: float, bias: bool) -> None:
        super().__init__()
        self.kind, self.eps = kind, eps
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "rms":
            return rms_norm(x, self.weight, self.eps)
        return layer_norm(x, self.weight, self.bias, self.eps)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + residual, norm(x + residual))``: one kernel for RMSNorm, two for LayerNorm."""
        if self.kind == "rms":
            return add_rms_norm(x, residual, self.weight, self.eps)  # type: ignore[no-any-return]
        total = x + residual
        return total, self(total)


class MoEFeedForward(nn.Module):
    """Mixtral's sparse MLP: softmax router, top-k experts renormalised, gated SiLU experts."""

    def __init__(self, spec: DecoderSpec, intermediate: int) -> None:
        super().__init__()
        self.top_k = spec.experts_per_token
        self.router = nn.Linear(spec.hidden_size, spec.num_experts, bias=False)
        e, h = spec.num_experts, spec.hidden_size
        self.gate_up = nn.Parameter(torch.empty(e, 2 * intermediate, h))
        self.down = nn.Parameter(torch.empty(e, h, intermediate))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.router(flat).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)  # fp32, as HF's router
        if flat.is_cuda and flat.shape[0] * self.top_k <= MOE_DECODE_ROWS:
            return self._decode(flat, weights, experts).view_as(x)
        out = torch.zeros_like(flat)
        # Group the (token, slot) pairs by expert: one host sync per layer for the counts, then
        # one gathered matmul pair per expert that has tokens.
        picks = experts.reshape(-1)
        order = torch.argsort(picks, stable=True)
        counts = torch.bincount(picks, minlength=self.gate_up.shape[0]).tolist()
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            chosen = order[start : start + count]
            start += count
            rows = chosen // self.top_k
            gate, up = F.linear(flat[rows], self.gate_up[expert]).chunk(2, dim=-1)
            hidden = F.linear(F.silu(gate) * up, self.down[expert])
            scaled = hidden * weights.reshape(-1)[chosen, None]
            out.index_add_(0, rows, scaled.to(out.dtype))
        return out.view_as(x)

    def _decode(
        self, flat: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """A few tokens on a GPU: every (token, expert) row reads only its expert's weights
        through ``moe_gemv`` (the ids stay on the device: no host sync, so a CUDA graph can
        capture the decode step)."""
        ids = experts.reshape(-1)
        rows = flat.repeat_interleave(self.top_k, dim=0)
        hidden = gated_activation(moe_gemv(rows, ids, self.gate_up), "silu")
        down = moe_gemv(hidden, ids, self.down).float() * weights.reshape(-1, 1)
        return down.view(flat.shape[0], self.top_k, -1).sum(1).to(flat.dtype)


class FusedBlock(nn.Module):
    """One decoder layer: fused QKV, rotary, SDPA over the cache, fused gate/up MLP.

    Tensor parallelism sets ``tp_group``: QKV and gate/up hold this rank's columns, the output
    and down projections its rows, and one all-reduce sums the block's two partial outputs
    (one, for a parallel-residual block).
    """

    def __init__(self, spec: DecoderSpec, *, attn_bias: bool, out_bias: bool, mlp_bias: bool):
        super().__init__()
        self.spec = spec
        self.heads, self.kv_heads = spec.num_heads, spec.num_kv_heads
        hd = spec.head_dim
        self.input_norm = Norm(spec.norm, spec.hidden_size, spec.norm_eps, spec.norm == "layer")
        self.post_norm = (
            None
            if spec.parallel_residual
            else Norm(spec.norm, spec.hidden_size, spec.norm_eps, spec.norm == "layer")
        )
        qkv_out = (spec.num_heads + 2 * spec.num_kv_heads) * hd
        self.qkv = nn.Linear(spec.hidden_size, qkv_out, bias=attn_bias)
        self.out = nn.Linear(spec.num_heads * hd, spec.hidden_size, bias=out_bias)
        self.moe: MoEFeedForward | None = None
        if spec.mlp == "moe":
            self.moe = MoEFeedForward(spec, spec.intermediate_size)
        else:
            up = 2 * spec.intermediate_size if spec.mlp == "gated" else spec.intermediate_size
            self.up = nn.Linear(spec.hidden_size, up, bias=mlp_bias)
            self.down = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=mlp_bias)
        self.tp_group: dist.ProcessGroup | None = None
        # The group's sum (tensor_parallel.allreduce); None: dist.all_reduce on tp_group.
        self.reducer: Callable[[torch.Tensor], torch.Tensor] | None = None

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.reducer is not None:
            return self.reducer(x)
        if self.tp_group is not None:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def reduce_add_norm(
        self, partial: torch.Tensor, residual: torch.Tensor, norm: Norm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``norm.add_forward`` of ``partial`` summed over the tensor-parallel group: one kernel
        for the sum, the residual add and an RMSNorm where the reducer has one (Slipstream's
        symmetric-memory kernel, ``tensor_parallel.symm_mem_kernel``)."""
        reducer = self.reducer
        if norm.kind == "rms" and getattr(reducer, "norm_state", None) is not None:
            return reducer.add_rms_norm(partial, residual, norm.weight, norm.eps)  # type: ignore[union-attr, no-any-return]
        return norm.add_forward(self._reduce(partial), residual)

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        if self.moe is not None:
            return self.moe(h)
        up = self.up(h)
        if self.spec.mlp == "gated":
            up = gated_activation(up, self.spec.activation)  # act(gate) * up in one kernel
        else:
            up = _activation(self.spec.activation, up)
        return self.down(up)

    def _attention(
        self,
        h: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        cache: tuple[torch.Tensor, torch.Tensor] | None,
        slots: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        return self.out(self._attend(self.qkv(h), rotary, cache, slots, mask))

    def _attend(
        self,
        qkv: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        cache: tuple[torch.Tensor, torch.Tensor] | None,
        slots: torch.Tensor,
        mask: torch.Tensor,
        split_attention: bool = False,
        pdl: bool = False,
    ) -> torch.Tensor:
        """Attention from the QKV projection's output; returns ``(batch, tokens, heads * hd)``
        before the output projection. ``split_attention``: over the cache through
        ``decode_attention`` (split-K over the slots) instead of SDPA. ``pdl``: the cache write
        and ``decode_attention`` launch with programmatic dependent launch (``decode_pdl``)."""
        batch, length, _ = qkv.shape
        hd, heads, kv_heads = self.spec.head_dim, self.heads, self.kv_heads
        if cache is not None:
            # One kernel rotates Q and K, writes K and V at the (device-tensor) slots and lays Q
            # out contiguous: four launches fewer per layer than rotary + two index_copy_ +
            # the query copy, and still capturable in a CUDA graph.
            cos, sin = (None, None) if rotary is None else (rotary[0][:, :, 0], rotary[1][:, :, 0])
            q = rotary_kv_write(qkv, cos, sin, cache[0], cache[1], slots, heads, kv_heads, pdl=pdl)
            k = cache[0][:, :, : mask.shape[-1]]
            v = cache[1][:, :, : mask.shape[-1]]
        else:
            qk = qkv[..., : (heads + kv_heads) * hd].view(batch, length, heads + kv_heads, hd)
            if rotary is not None:
                qk = rotary_embedding(qk, *rotary)  # queries and keys in one kernel
            q, k = qk[:, :, :heads], qk[:, :, heads:]
            v = qkv[..., (heads + kv_heads) * hd :].view(batch, length, kv_heads, hd)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if heads > kv_heads:
            # Grouped-query attention without repeating K/V: the query heads sharing a KV head
            # become extra query rows of it (head h reads KV head h // group, as HF's repeat_kv
            # does), so decode reads each cached key once; `mask` comes grouped to match.
            q = q.reshape(batch, kv_heads, (heads // kv_heads) * length, hd)
        if split_attention and cache is not None:
            out = decode_attention(q, k, v, mask, self.spec.scale, pdl=pdl, trigger=pdl)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.spec.scale)
        out = out.reshape(batch, heads, length, hd).transpose(1, 2)
        return out.reshape(batch, length, heads * hd)

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        cache: tuple[torch.Tensor, torch.Tensor] | None,
        slots: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """``x`` ``(batch, tokens, hidden)`` at cache ``slots``.

        ``mask`` is :func:`attention_mask`'s (boolean, or the additive 0 / -inf form the
        decoder passes), with its query rows repeated once per query head of a KV head
        (``group`` times) when the block has grouped-query attention.
        """
        x, pending = self.forward_split(x, self.input_norm(x), rotary, cache, slots, mask)
        return x + self._reduce(pending)

    def forward_split(
        self,
        x: torch.Tensor,
        h: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        cache: tuple[torch.Tensor, torch.Tensor] | None,
        slots: torch.Tensor,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` given ``h = input_norm(x)``, returning ``(base, pending)``: the
        block's output is ``base`` plus ``pending`` summed over the tensor-parallel group (this
        rank's partial; the whole sum without TP). The decoder sums and adds ``pending`` in the
        next norm's kernel (:meth:`reduce_add_norm`)."""
        attn = self._attention(h, rotary, cache, slots, mask)
        if self.post_norm is None:  # parallel residual: one reduction for both branches
            return x, attn + self._mlp(h)
        x, h = self.reduce_add_norm(attn, x, self.post_norm)  # sum + residual add + norm fused
        return x, self._mlp(h)


class FusedDecoder(nn.Module):
    """A decoder-only language model built from :class:`FusedBlock` s.

    Built by :func:`slipstream.inference.adapters.from_hf` from a Hugging Face model.
    ``forward`` returns logits ``(batch, tokens, vocab)`` for the tokens fed, writing their keys
    and values into ``cache`` at ``slots``.
    """

    def __init__(
        self,
        spec: DecoderSpec,
        *,
        attn_bias: bool = False,
        out_bias: bool = False,
        mlp_bias: bool = False,
        head_bias: bool = False,
        inv_freq: torch.Tensor | None = None,
        rotary_scaling: float = 1.0,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.positions = (
            nn.Embedding(spec.max_positions + spec.learned_offset, spec.hidden_size)
            if spec.position == "learned"
            else None
        )
        self.blocks = nn.ModuleList(
            FusedBlock(spec, attn_bias=attn_bias, out_bias=out_bias, mlp_bias=mlp_bias)
            for _ in range(spec.num_layers)
        )
        self.final_norm = Norm(spec.norm, spec.hidden_size, spec.norm_eps, spec.norm == "layer")
        self.head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=head_bias)
        if spec.position == "rotary" and inv_freq is None:
            inv_freq = 1.0 / (
                10000.0
                ** (torch.arange(0, spec.rotary_dim, 2, dtype=torch.float64) / spec.rotary_dim)
            )
        self.register_buffer(
            "inv_freq",
            inv_freq.float() if inv_freq is not None else torch.zeros(0),
            persistent=False,
        )
        self.rotary_scaling = float(rotary_scaling)
        self.inv_freq: torch.Tensor
        self.head_group: dist.ProcessGroup | None = None  # vocab-parallel head under TP
        self.head_reducer: Any = None  # slipstream.inference.allreduce.TPReducer, under TP
        self.layer_hook: LayerHook | None = None  # ZeRO-Inference streams weights through this
        # The fused quantized decode GEMVs' programmatic dependent launch option (set by
        # init_inference from quant.weight.decode_pdl; fused_quant_decode passes it on).
        self.quant_pdl: str = "on"
        # decode_attention's launch options in the fused quantized step (when quant_pdl is not
        # "off"): launched with programmatic dependent launch itself (``pdl``: it starts while
        # the QKV GEMV finishes and waits for it), letting the output projection launch at once
        # (``trigger``: that projection prefetches its weight while attention runs), and with
        # ``pdl`` an L2 prefetch of the cache before the wait (``prefetch``) or a load of the
        # first chunk of the slots QKV does not write (``preload``), and an L2 prefetch of
        # the output projection's weight (``weights``: "early" / "waited"). All off: on an
        # H100 (8B, batch 1) any early launch of the output projection cost ~0.3 ms a step;
        # pdl + prefetch gained 26 us for int4 but nothing on top of decode_attention's
        # d_split 2 (the default) and cost 62 us for int8 (calls D2, G; docs/inference.md);
        # tools/bench/quant_decode_variants.py sets them ("attn:pdl=true", ...).
        self.quant_attention_pdl = False
        self.quant_attention_trigger: bool | str = False  # or "issued" / "waited"
        self.quant_attention_prefetch = False
        self.quant_attention_preload = False
        # "early" / "waited": attention's programs prefetch the quantized output projection's
        # weight into L2 before / after their wait (None: not)
        self.quant_attention_weights: str | None = None
        # The parts that single-token decode steps run through the decode kernels
        # (fused_decode.decode_forward; set by fused_decode.enable_decode_fusion); empty: none.
        self.decode_fusion: frozenset[str] = frozenset()
        # Whether the fused dense decode step launches its kernels with programmatic dependent
        # launch (the ``decode_pdl`` config key; set by fused_decode.enable_decode_fusion).
        self.decode_pdl = False
        # The rotary cos/sin of positions [0, length), fp32 (length, rotary_dim / 2) each, that
        # single-token steps gather through ``decode_inputs`` (build_decode_tables); None: those
        # steps compute their angles. Tables once handed out stay alive (CUDA graphs hold them).
        self.decode_tables: tuple[torch.Tensor, torch.Tensor] | None = None
        self._old_tables: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.decode_prologue = False  # single-token steps run decode_inputs (build_decode_tables)
        # The dense fused step without decode_pdl: the QKV GEMV and decode_attention alone
        # launched with programmatic dependent launch (attention waits only; its early loads
        # overlap the GEMV's end), and attention's L2 prefetch of its cache rows before the
        # wait (tools/bench/quant_decode_variants.py: bf16,attn:pdl=true,attn:prefetch=true).
        # Off: the 8B bf16 step took 5.839 ms with both against 5.719 (H100, call G).
        self.decode_attention_pdl = False
        self.decode_attention_prefetch = False

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.spec.position != "rotary":
            return None
        # fp32 angles, as Hugging Face computes them; (batch, tokens, 1, rotary_dim / 2).
        angles = positions[..., None].float() * self.inv_freq
        cos, sin = angles.cos(), angles.sin()
        if self.rotary_scaling != 1.0:  # (x * 1.0 is x: two launches fewer a decode step)
            cos, sin = cos * self.rotary_scaling, sin * self.rotary_scaling
        return cos[:, :, None], sin[:, :, None]

    def build_decode_tables(self, length: int) -> None:
        """Let single-token steps at cache slots below ``length`` compute their first block's
        inputs in one ``decode_inputs`` launch (embedding, learned positions, rotary cos/sin,
        additive mask; on a GPU one Triton kernel instead of about fifteen small ones). The
        rotary cos/sin of positions ``[0, length)`` are computed here once, by the same torch
        ops as :meth:`_rotary`, so that the steps gather the same bits. Position ids must stay
        below ``length`` (they do in ``generate``: a token's position is at most its slot)."""
        self.decode_prologue = True
        if self.spec.position != "rotary":
            return
        if self.decode_tables is not None:
            if self.decode_tables[0].shape[0] >= length:
                return
            self._old_tables.append(self.decode_tables)
        positions = torch.arange(length, device=self.inv_freq.device)[None]
        rotary = self._rotary(positions)
        assert rotary is not None
        self.decode_tables = (rotary[0][0, :, 0].contiguous(), rotary[1][0, :, 0].contiguous())

    def _decode_inputs(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        key_valid: torch.Tensor,
        slots: torch.Tensor,
        group: int,
        mark_valid: bool,
        next_slot: torch.Tensor | None = None,
    ) -> (
        tuple[
            torch.Tensor,
            tuple[torch.Tensor, torch.Tensor] | None,
            torch.Tensor,
            torch.Tensor | None,
        ]
        | None
    ):
        """``(x, rotary, mask, normed)`` of a single-token step through ``decode_inputs``
        (``normed``: the first block's input RMSNorm of ``x``, where the fused quantized step
        takes it; else None); None where it does not apply (more tokens, no tables for these
        slots, a vocab-parallel embedding)."""
        if not self.decode_prologue or input_ids.shape[1] != 1 or slots.shape != (1,):
            return None
        if type(self.embed) is not nn.Embedding:  # e.g. tensor parallelism's vocab shards
            return None
        weight = self.embed.weight
        tables = self.decode_tables
        if self.spec.position == "rotary" and (
            tables is None
            or tables[0].shape[0] < key_valid.shape[1]
            or tables[0].device != weight.device
        ):
            return None
        learned = None if self.positions is None else self.positions.weight
        if learned is not None and (
            type(self.positions) is not nn.Embedding or learned.dtype != weight.dtype
        ):
            return None
        cos_table, sin_table = (None, None) if tables is None else tables
        norm = None
        if self.decode_fusion and self.layer_hook is None:
            from slipstream.inference.fused_quant_decode import first_norm_folds

            first = self.blocks[0]
            assert isinstance(first, FusedBlock)
            norm = first.input_norm if first_norm_folds(self) else None
        x, cos, sin, mask, normed = decode_inputs(
            input_ids,
            positions,
            key_valid,
            slots,
            weight,
            learned,
            self.spec.learned_offset,
            cos_table if self.spec.position == "rotary" else None,
            sin_table if self.spec.position == "rotary" else None,
            self.spec.sliding_window,
            group,
            mark_valid=mark_valid,
            next_slot=next_slot,
            norm_weight=None if norm is None else norm.weight,
            norm_eps=1e-6 if norm is None else norm.eps,
        )
        rotary = None if cos is None or sin is None else (cos, sin)
        return x, rotary, mask, normed

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        key_valid: torch.Tensor,
        slots: torch.Tensor,
        cache: KVCache | None = None,
        last_only: bool = False,
        mark_valid: bool = False,
        next_slot: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits for ``input_ids`` ``(batch, tokens)`` (only the last token's if ``last_only``).

        Args:
            positions: ``(batch, tokens)`` position ids (rotary angle or learned position).
            key_valid: ``(batch, keys)`` which cache slots hold real tokens; its width is the
                number of slots attended (the whole cache for a graph-captured decode step).
            slots: ``(tokens,)`` the cache slots the tokens are written to.
            cache: the KV cache; None attends only to the tokens given (``slots`` = 0..n-1).
            mark_valid: set ``key_valid[:, slots]`` True first, on the device (a CUDA-graph
                decode step: then the runner launches nothing for it before the replay).
            next_slot: ``(1,)`` (a CUDA-graph decode step): the step's slot is read from it into
                ``slots``, and it and ``positions`` advance by one on the device, so that the
                next replay needs no new positions or slot copied in.
        """
        first = self.blocks[0]
        assert isinstance(first, FusedBlock)
        previous = first  # the block whose output's partial sum ``pending`` (below) is
        group = first.heads // first.kv_heads
        prologue = (
            None
            if cache is None
            else self._decode_inputs(
                input_ids, positions, key_valid, slots, group, mark_valid, next_slot
            )
        )
        normed = None
        if prologue is not None:  # a single-token step: one decode_inputs launch for all this
            x, rotary, mask, normed = prologue
        else:
            if next_slot is not None:
                slots.copy_(next_slot)
            if mark_valid:
                key_valid.index_fill_(1, slots, True)
            x = self.embed(input_ids)
            if self.positions is not None:
                x = x + self.positions(positions + self.spec.learned_offset)
            rotary = self._rotary(positions)
            mask = attention_mask(key_valid, slots, self.spec.sliding_window)
            if group > 1:  # once per step, not per layer: (batch, 1, group * tokens, keys)
                mask = mask[:, :, None].expand(-1, -1, group, -1, -1).flatten(2, 3)
            # An additive mask, built once per step: SDPA would otherwise turn the boolean mask
            # into one in every layer (extra kernels per layer at decode).
            mask = torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill_(
                ~mask, float("-inf")
            )
            if next_slot is not None:  # this step's positions and slot are read: advance them
                positions.add_(1)
                next_slot.add_(1)
        if self.decode_fusion and input_ids.numel() == 1 and self.layer_hook is None:
            from slipstream.inference.fused_decode import decode_forward

            return decode_forward(self, x, rotary, cache, slots, mask, normed)
        # Each block's last residual add runs in the next norm's kernel (add + norm fused).
        pending: torch.Tensor | None = None
        for index, block in enumerate(self.blocks):
            assert isinstance(block, FusedBlock)
            layer_cache = None if cache is None else (cache.keys[index], cache.values[index])
            if self.layer_hook is not None:
                self.layer_hook.before(index)
            if pending is None:
                h = block.input_norm(x)
            else:
                x, h = previous.reduce_add_norm(pending, x, block.input_norm)
            x, pending = block.forward_split(x, h, rotary, layer_cache, slots, mask)
            previous = block
            if self.layer_hook is not None:
                self.layer_hook.after(index)
        normed = (
            self.final_norm(x)
            if pending is None
            else previous.reduce_add_norm(pending, x, self.final_norm)[1]
        )
        if last_only:
            normed = normed[:, -1:]  # a prefill needs only the next token's logits
        logits = self.head(normed)
        if self.head_group is not None:
            logits = self.gather_vocab(logits)
        return logits

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """A vocab-parallel head's logits joined along the last dimension, rank by rank."""
        if self.head_reducer is not None:
            return self.head_reducer.gather(logits)  # type: ignore[no-any-return]
        parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(self.head_group))]
        dist.all_gather(parts, logits.contiguous(), group=self.head_group)
        return torch.cat(parts, dim=-1)


class LayerHook:
    """Called around each block's forward (ZeRO-Inference fetches and releases weights here)."""

    def before(self, index: int) -> None:
        """Make block ``index``'s weights ready on the compute device."""

    def after(self, index: int) -> None:
        """Block ``index`` is done with its weights."""
