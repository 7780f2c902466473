"""The ragged forward of ``init_inference``'s fused decoder over a paged KV cache.

[Note: one decoder] Serving does not map weights itself: :func:`build_fused_decoder` runs the
model through :func:`slipstream.inference.init_inference` (the family adapters, the cast,
AutoTP sharding, quantized weights) and :class:`PagedDecoder` calls the resulting
:class:`~slipstream.inference.model.FusedBlock` s' own norms, fused QKV, output projection
and MLP. Only attention differs from ``generate``'s static cache: the tokens of many requests
run back to back (no padding), their keys and values are written to cache slots through block
tables, and ``paged_attention`` reads them back.

Decode-only steps replay CUDA graphs: see [Note: decode graphs] in ``decode_graphs.py``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from slipstream.inference.model import FusedBlock, FusedDecoder
from slipstream.inference.serving.decode_graphs import (
    CaptureFn,
    DecodeGraphs,
    capture_cuda_graph,
)
from slipstream.inference.serving.scheduler import ScheduledChunk
from slipstream.inference.serving.step_inputs import (
    StepInputs,
    build_step_inputs,
    ints_length,
)
from slipstream.kernels.ops import paged_attention, rotary_embedding

logger = logging.getLogger(__name__)

_INFERENCE_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

# What rank 0 broadcasts before each step (all -1: stop).
_HEADER = ("bucket", "tokens", "seqs", "samples", "table_width", "max_query_len")


def build_fused_decoder(
    model: nn.Module, *, tensor_parallel: int = 1, tp_group: Any = None
) -> FusedDecoder:
    """``init_inference``'s fused decoder of a Hugging Face causal LM, in the model's dtype.

    Raises :class:`~slipstream.inference.adapters.UnsupportedModelError` for an architecture
    without a fused adapter (the message lists the supported ones).
    """
    from slipstream.inference.engine import init_inference

    weight = next(model.parameters())
    dtype = _INFERENCE_DTYPES.get(weight.dtype)
    if dtype is None:
        raise ValueError(
            f"serving computes in fp32, bf16 or fp16; the model's weights are {weight.dtype}. "
            "Cast the model or set serving.dtype"
        )
    tp: dict[str, Any] = {"tp_size": tensor_parallel}
    if tp_group is not None:
        tp["tp_group"] = tp_group
    engine = init_inference(model, dtype=dtype, replace_with_kernel_inject=True, tensor_parallel=tp)
    assert engine.fused is not None
    return engine.fused


def check_supported(decoder: FusedDecoder, max_model_len: int) -> None:
    """Raise ValueError for what the paged forward does not implement (sliding windows)."""
    window = decoder.spec.sliding_window
    if window is not None and max_model_len > window:
        raise ValueError(
            f"this {decoder.spec.family} model attends over a sliding window of {window} "
            f"tokens, which serving does not implement; set max_model_len <= {window}"
        )


class PagedDecoder:
    """Runs scheduled chunks of many requests as one ragged batch through a fused decoder,
    writing and reading the KV cache through block tables.

    The cache is ``(num_blocks + 1, block_size, kv_heads, head_dim)`` per layer (this rank's
    KV heads under tensor parallelism); block ``num_blocks`` is the scratch block of
    decode-graph padding rows.
    """

    def __init__(
        self,
        decoder: FusedDecoder,
        *,
        num_blocks: int,
        block_size: int,
        max_blocks_per_seq: int,
        cuda_graph: bool = False,
        graph_max_batch: int = 256,
        capture: CaptureFn | None = None,
    ) -> None:
        self.decoder = decoder
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_blocks_per_seq = max_blocks_per_seq
        # the embedding's device: the head may be quantized (quant.weight.lm_head, no .weight)
        self.device: torch.device = decoder.embed.weight.device
        self.dtype: torch.dtype = decoder.embed.weight.dtype
        first = decoder.blocks[0]
        assert isinstance(first, FusedBlock)
        self.kv_heads, self.head_dim = first.kv_heads, decoder.spec.head_dim
        shape = (num_blocks + 1, block_size, self.kv_heads, self.head_dim)
        self.key_cache = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in decoder.blocks
        ]
        self.value_cache = [torch.zeros_like(cache) for cache in self.key_cache]
        # Tensor parallelism: rank 0 schedules and sends each step's inputs to the group.
        self.tp_group: dist.ProcessGroup | None = decoder.head_group
        self._stopped = False
        self.last_bucket = 0  # the graph bucket of the last step (0: eager)
        self.graphs: DecodeGraphs | None = None
        if cuda_graph and decoder.spec.mlp == "moe":
            # The expert loop reads the tokens per expert back to the host: not capturable.
            logger.info("serving.cuda_graph: MoE models decode eagerly (no CUDA graph)")
        elif cuda_graph and (capture is not None or self.device.type == "cuda"):
            if capture is None:
                capture = functools.partial(capture_cuda_graph, pool=torch.cuda.graph_pool_handle())
            self.graphs = DecodeGraphs(self, graph_max_batch, capture)
            self.graphs.capture_all()

    @torch.inference_mode()
    def warmup(self, max_tokens: int) -> list[int]:
        """Run eager steps in the scratch block that meet every Triton specialisation a serving
        step can meet; returns each step's token count.

        Triton compiles a kernel once per class of each integer argument (1, a multiple of 16,
        other) and per constexpr tile (``paged_attention``'s prompt and decode tiles), so the
        first step of a new class would otherwise compile for half a second in front of every
        waiting request. The steps: the full budget (rounded down to 16) as 16 sequences and
        one token less as 3 (tokens, sampled rows and block-table widths in both classes), a
        one-block prompt (table width 1), and decode steps of 1, 16 and 3 sequences.
        """
        full = max(16, max_tokens - max_tokens % 16)
        bs, scratch = self.block_size, self.num_blocks
        plans = [
            self._warmup_chunks(full, 16, width_class=16),
            self._warmup_chunks(full - 1, 3, width_class=3),
            [(bs, 0, 1)],
            [(1, 0, 1)],
            [(1, 0, 16)] * 16,
            [(1, 0, 3)] * 3,
        ]
        counts = []
        for plan in plans:
            chunks = [
                ScheduledChunk("warmup", [1] * count, start, [scratch] * width, True)
                for count, start, width in plan
            ]
            inputs = build_step_inputs(chunks, bs, scratch_block=scratch)
            longs = inputs.longs.to(self.device)
            ints = inputs.ints.to(self.device)
            self.run(inputs.views(longs, ints), inputs.max_query_len)
            counts.append(inputs.num_tokens)
        return counts

    def _warmup_chunks(
        self, tokens: int, seqs: int, width_class: int
    ) -> list[tuple[int, int, int]]:
        """``seqs`` prompt chunks ``(count, start, table width)`` of ``tokens`` in all, the
        first after a block of context; every table as wide as the longest needs, rounded to
        a multiple of 16 (``width_class`` 16), or else made neither 1 nor a multiple of 16."""
        seqs = max(1, min(seqs, tokens))
        counts = [tokens // seqs + (i < tokens % seqs) for i in range(seqs)]
        starts = [self.block_size] + [0] * (seqs - 1)
        width = max(-(-(c + s) // self.block_size) for c, s in zip(counts, starts))
        if width_class == 16:
            width = -(-width // 16) * 16
        elif width == 1 or width % 16 == 0:
            width += 1
        return [(c, s, width) for c, s in zip(counts, starts)]

    @staticmethod
    def bytes_per_block(decoder: FusedDecoder, block_size: int) -> int:
        """KV-cache bytes one block takes over all layers (keys and values, this rank's heads)."""
        first = decoder.blocks[0]
        assert isinstance(first, FusedBlock)
        element = decoder.embed.weight.element_size()
        per_token = 2 * first.kv_heads * decoder.spec.head_dim * element
        return int(per_token * block_size * decoder.spec.num_layers)

    @torch.inference_mode()
    def forward(
        self,
        chunks: Sequence[ScheduledChunk],
        feed: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Compute every chunk's tokens; return fp32 logits of the sampling chunks, in order.

        ``feed`` ``(tokens, rows)`` (asynchronous scheduling, every chunk one token): chunk
        ``i``'s token id is ``tokens[rows[i]]``, read on the device (the previous step's sampled
        ids, not yet on the host). Under tensor parallelism this runs on rank 0, which sends the
        step to the other ranks (each in :meth:`serve_worker`).
        """
        bucket = 0
        if self.graphs is not None and all(len(c.token_ids) == 1 and c.samples for c in chunks):
            bucket = self.graphs.bucket_for(len(chunks)) or 0
        if bucket:
            assert self.graphs is not None
            inputs = self.graphs.inputs(chunks, bucket)
        else:
            inputs = build_step_inputs(chunks, self.block_size, scratch_block=self.num_blocks)
        if self.tp_group is not None:
            self._send_header(inputs, bucket)
        self.last_bucket = bucket
        logits = self._step(inputs, bucket, source=True, feed=feed)
        return logits[: len(chunks)] if bucket else logits

    def _step(
        self,
        inputs: StepInputs,
        bucket: int,
        *,
        source: bool,
        feed: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Move (rank 0) or receive (the other ranks) the step's buffers, then run it."""
        if bucket:
            assert self.graphs is not None
            longs, ints = self.graphs.buffers(bucket, inputs)
            if source:
                # From page-locked copies: a copy from pageable memory waits for the stream's
                # queued work, which would undo a step launched ahead (async_scheduling).
                pinned = self.device.type == "cuda"
                longs.copy_(
                    inputs.longs.pin_memory() if pinned else inputs.longs, non_blocking=True
                )
                ints.copy_(inputs.ints.pin_memory() if pinned else inputs.ints, non_blocking=True)
        elif not source:
            longs = torch.empty(inputs.longs.shape, dtype=torch.int64, device=self.device)
            ints = torch.empty(inputs.ints.shape, dtype=torch.int32, device=self.device)
        elif self.device.type == "cuda":
            longs = inputs.longs.pin_memory().to(self.device, non_blocking=True)
            ints = inputs.ints.pin_memory().to(self.device, non_blocking=True)
        else:
            longs, ints = inputs.longs, inputs.ints
        if feed is not None:
            tokens, rows = feed
            if longs is inputs.longs:  # CPU: keep the host buffers the caller built
                longs = longs.clone()
            longs[: rows.numel()].copy_(tokens.index_select(0, rows))
        if self.tp_group is not None:
            dist.broadcast(longs, group=self.tp_group, group_src=0)
            dist.broadcast(ints, group=self.tp_group, group_src=0)
        if bucket:
            assert self.graphs is not None
            return self.graphs.replay(bucket, inputs)
        return self.run(inputs.views(longs, ints), inputs.max_query_len)

    def _send_header(self, inputs: StepInputs | None, bucket: int) -> None:
        values = [-1] * len(_HEADER)
        if inputs is not None:
            values = [
                bucket,
                inputs.num_tokens,
                inputs.num_seqs,
                inputs.num_samples,
                inputs.table_width,
                inputs.max_query_len,
            ]
        header = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.broadcast(header, group=self.tp_group, group_src=0)

    def stop_workers(self) -> None:
        """Rank 0: end the other ranks' :meth:`serve_worker` loops (no-op without TP)."""
        if self.tp_group is not None and not self._stopped:
            self._stopped = True
            self._send_header(None, 0)

    @torch.inference_mode()
    def serve_worker(self) -> int:
        """Ranks > 0 of a tensor-parallel group: run every step rank 0 sends until it calls
        :meth:`stop_workers`; returns the number of steps run."""
        if self.tp_group is None or dist.get_rank(self.tp_group) == 0:
            raise RuntimeError("serve_worker runs on the ranks > 0 of a tensor-parallel group")
        steps = 0
        while True:
            header = torch.empty(len(_HEADER), dtype=torch.int64, device=self.device)
            dist.broadcast(header, group=self.tp_group, group_src=0)
            bucket, tokens, seqs, samples, width, max_query_len = header.tolist()  # host sync
            if seqs < 0:
                return steps
            # Host shells of the right sizes: _step receives the contents from rank 0.
            longs = torch.empty(3 * tokens + samples, dtype=torch.int64)
            ints = torch.empty(ints_length(seqs, width), dtype=torch.int32)
            inputs = StepInputs(longs, ints, tokens, seqs, samples, width, max_query_len)
            self._step(inputs, bucket, source=False)
            steps += 1

    def run(self, step: dict[str, torch.Tensor], max_query_len: int) -> torch.Tensor:
        """The forward over device inputs (``StepInputs.views``); capturable in a CUDA graph
        when ``max_query_len`` and the shapes are fixed."""
        decoder = self.decoder
        spec = decoder.spec
        positions = step["positions"]
        hidden = decoder.embed(step["input_ids"])
        if decoder.positions is not None:
            hidden = hidden + decoder.positions(positions + spec.learned_offset)
        rotary = decoder._rotary(positions[None])
        cos_sin = None if rotary is None else (rotary[0][0], rotary[1][0])  # (tokens, 1, half)
        tokens = hidden.shape[0]
        for index, block in enumerate(decoder.blocks):
            assert isinstance(block, FusedBlock)
            if decoder.layer_hook is not None:
                decoder.layer_hook.before(index)
            h = block.input_norm(hidden)
            attn = self._attention(block, index, h, cos_sin, step, max_query_len, tokens)
            if block.post_norm is None:  # parallel residual, as FusedBlock.forward
                hidden = hidden + block._reduce(attn + block._mlp(h))
            else:
                hidden = hidden + block._reduce(attn)
                hidden = hidden + block._reduce(block._mlp(block.post_norm(hidden)))
            if decoder.layer_hook is not None:
                decoder.layer_hook.after(index)
        logits = decoder.head(decoder.final_norm(hidden[step["sample_rows"]]))
        if decoder.head_group is not None:  # vocab-parallel head under tensor parallelism
            parts = [
                torch.empty_like(logits) for _ in range(dist.get_world_size(decoder.head_group))
            ]
            dist.all_gather(parts, logits.contiguous(), group=decoder.head_group)
            logits = torch.cat(parts, dim=-1)
        return logits.float()

    def _attention(
        self,
        block: FusedBlock,
        index: int,
        h: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
        step: dict[str, torch.Tensor],
        max_query_len: int,
        tokens: int,
    ) -> torch.Tensor:
        heads, kv_heads, hd = block.heads, block.kv_heads, self.head_dim
        qkv = block.qkv(h)
        qk = qkv[:, : (heads + kv_heads) * hd].view(tokens, heads + kv_heads, hd)
        if cos_sin is not None:
            qk = rotary_embedding(qk, *cos_sin)  # queries and keys in one kernel
        query, key = qk[:, :heads], qk[:, heads:]
        value = qkv[:, (heads + kv_heads) * hd :].view(tokens, kv_heads, hd)
        key_cache, value_cache = self.key_cache[index], self.value_cache[index]
        # Every token's keys/values of this layer land in the cache before any attention reads
        # them (see [Note: caching blocks before they are written] in block_pool.py);
        # index_copy_ with device slots keeps the step capturable.
        key_cache.view(-1, kv_heads, hd).index_copy_(0, step["slots"], key)
        value_cache.view(-1, kv_heads, hd).index_copy_(0, step["slots"], value)
        out = paged_attention(
            query,
            key_cache,
            value_cache,
            step["block_tables"],
            step["seq_lens"],
            step["query_start_loc"],
            scale=block.spec.scale,
            max_query_len=max_query_len,
        )
        return block.out(out.reshape(tokens, heads * hd))  # type: ignore[no-any-return]
