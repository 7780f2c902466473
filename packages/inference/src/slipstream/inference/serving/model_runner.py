"""The ragged forward of ``init_inference``'s fused decoder over a paged KV cache.

[Note: one decoder] Serving does not map weights itself: :func:`build_fused_decoder` runs the
model through :func:`slipstream.inference.init_inference` (the family adapters, the cast,
AutoTP sharding, quantized weights) and :class:`PagedDecoder` calls the resulting
:class:`~slipstream.inference.model.FusedBlock` s' own norms, fused QKV, output projection
and MLP. Only attention differs from ``generate``'s static cache: the tokens of many requests
run back to back (no padding), their keys and values are written to cache slots through block
tables, and ``paged_attention`` reads them back.

[Note: decode graphs] A step whose chunks are all single-token decodes has fixed shapes once
padded to a batch-size bucket: :class:`DecodeGraphs` copies its inputs into static buffers and
replays a CUDA graph captured for every bucket when the engine starts. Padding rows decode token 0 at position 0 into a scratch block
(the cache has one block more than the pool hands out), so they never touch a real request's
keys; their logits are dropped. Steps with a prompt chunk run eagerly (their token count
changes every step, and they are a few percent of the steps of a long generation).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from slipstream.inference.model import FusedBlock, FusedDecoder
from slipstream.inference.serving.scheduler import ScheduledChunk
from slipstream.kernels.ops import paged_attention, rotary_embedding

logger = logging.getLogger(__name__)

_INFERENCE_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

# A capture function turns a step closure into a replay closure returning the same tensor.
# What rank 0 broadcasts before each step (all -1: stop).
_HEADER = ("bucket", "tokens", "seqs", "samples", "table_width", "max_query_len")
CaptureFn = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]


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


def graph_buckets(max_batch: int) -> list[int]:
    """Batch sizes decode graphs are captured for: 1, 2, 4, 8, then every 16 up to ``max_batch``.

    A decode step of ``n`` requests runs in the smallest bucket ``>= n`` (at most 15 padding
    rows past 8); ``max_batch`` itself is always a bucket.
    """
    sizes = [size for size in (1, 2, 4, 8) if size < max_batch]
    sizes += list(range(16, max_batch, 16))
    return [*sizes, max_batch]


@dataclasses.dataclass
class StepInputs:
    """One step's inputs on the host, packed into two buffers so that one copy each moves them.

    ``longs`` is ``[input_ids | positions | slots | sample_rows]`` (int64), ``ints`` is
    ``[block_tables (seqs x width) | seq_lens | query_start_loc]`` (int32, the kernel's types).
    """

    longs: torch.Tensor
    ints: torch.Tensor
    num_tokens: int
    num_seqs: int
    num_samples: int
    table_width: int
    max_query_len: int

    def views(self, longs: torch.Tensor, ints: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views into ``longs``/``ints`` (these buffers or their device copies)."""
        t, s, w = self.num_tokens, self.num_seqs, self.table_width
        ids, positions, slots, rows = longs.split([t, t, t, self.num_samples])
        tables, seq_lens, starts = ints.split([s * w, s, s + 1])
        return {
            "input_ids": ids,
            "positions": positions,
            "slots": slots,
            "sample_rows": rows,
            "block_tables": tables.view(s, w),
            "seq_lens": seq_lens,
            "query_start_loc": starts,
        }


def build_step_inputs(
    chunks: Sequence[ScheduledChunk],
    block_size: int,
    *,
    pad_to: int | None = None,
    table_width: int | None = None,
    scratch_block: int = 0,
) -> StepInputs:
    """Pack ``chunks`` (in batch order) into :class:`StepInputs`, vectorised over tokens.

    ``pad_to`` adds single-token padding sequences up to that many (a decode-graph bucket):
    each decodes token 0 at position 0 into ``scratch_block`` and is sampled (its row is
    dropped by the caller). ``table_width`` fixes the block-table width (a graph's static
    shape); by default it is the longest table of the batch.
    """
    real = len(chunks)
    seqs = pad_to if pad_to is not None else real
    if seqs < real:
        raise ValueError(f"pad_to={pad_to} is smaller than the batch's {real} sequences")
    width = table_width or max(len(chunk.block_table) for chunk in chunks)
    # Plain lists, then one tensor per buffer: at a few hundred sequences this costs tens of
    # microseconds, where a tensor op per field costs more than the whole.
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    rows: list[int] = []
    tables: list[int] = []
    seq_lens: list[int] = []
    starts = [0]
    max_query_len = 1
    for chunk in chunks:
        table, start, count = chunk.block_table, chunk.start, len(chunk.token_ids)
        ids += chunk.token_ids
        span = range(start, start + count)
        positions += span
        slots += [table[p // block_size] * block_size + p % block_size for p in span]
        tables += table
        tables += [scratch_block] * (width - len(table))
        seq_lens.append(start + count)
        starts.append(starts[-1] + count)
        max_query_len = max(max_query_len, count)
        if chunk.samples:
            rows.append(starts[-1] - 1)
    for _ in range(seqs - real):  # padding: token 0 at position 0 in the scratch block
        ids.append(0)
        positions.append(0)
        slots.append(scratch_block * block_size)
        tables += [scratch_block] * width
        seq_lens.append(1)
        starts.append(starts[-1] + 1)
        rows.append(starts[-1] - 1)
    longs = torch.tensor(ids + positions + slots + rows, dtype=torch.int64)
    ints = torch.tensor(tables + seq_lens + starts, dtype=torch.int32)
    return StepInputs(longs, ints, starts[-1], seqs, len(rows), width, max_query_len)


def capture_cuda_graph(
    step: Callable[[], torch.Tensor], pool: Any = None
) -> Callable[[], torch.Tensor]:
    """Capture ``step`` (after two warm-up runs on a side stream) into a CUDA graph; return a
    closure that replays it and returns its static output. Graphs given one ``pool`` share
    their memory (they never run at once)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # lazy initialisation and Triton compiles happen outside the capture
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: the server's other threads may touch CUDA while the engine thread captures.
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        output = step()

    def replay() -> torch.Tensor:
        graph.replay()
        return output

    return replay


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
        weight = decoder.head.weight
        self.device: torch.device = weight.device
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

    @staticmethod
    def bytes_per_block(decoder: FusedDecoder, block_size: int) -> int:
        """KV-cache bytes one block takes over all layers (keys and values, this rank's heads)."""
        first = decoder.blocks[0]
        assert isinstance(first, FusedBlock)
        element = decoder.embed.weight.element_size()
        per_token = 2 * first.kv_heads * decoder.spec.head_dim * element
        return int(per_token * block_size * decoder.spec.num_layers)

    @torch.inference_mode()
    def forward(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """Compute every chunk's tokens; return fp32 logits of the sampling chunks, in order.

        Under tensor parallelism this runs on rank 0, which sends the step to the other ranks
        (each in :meth:`serve_worker`).
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
        logits = self._step(inputs, bucket, source=True)
        return logits[: len(chunks)] if bucket else logits

    def _step(self, inputs: StepInputs, bucket: int, *, source: bool) -> torch.Tensor:
        """Move (rank 0) or receive (the other ranks) the step's buffers, then run it."""
        if bucket:
            assert self.graphs is not None
            longs, ints = self.graphs.buffers(bucket, inputs)
            if source:
                longs.copy_(inputs.longs, non_blocking=True)
                ints.copy_(inputs.ints, non_blocking=True)
        elif not source:
            longs = torch.empty(inputs.longs.shape, dtype=torch.int64, device=self.device)
            ints = torch.empty(inputs.ints.shape, dtype=torch.int32, device=self.device)
        elif self.device.type == "cuda":
            longs = inputs.longs.pin_memory().to(self.device, non_blocking=True)
            ints = inputs.ints.pin_memory().to(self.device, non_blocking=True)
        else:
            longs, ints = inputs.longs, inputs.ints
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
            ints = torch.empty(seqs * width + 2 * seqs + 1, dtype=torch.int32)
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


class DecodeGraphs:
    """Decode-only steps replayed from a graph per batch-size bucket (see [Note: decode graphs]).

    ``capture`` is :func:`capture_cuda_graph` on a GPU; tests pass a plain function (the
    "replay" then reruns the step eagerly from the same static buffers), so the padding and
    buffer logic is exercised on the CPU.
    """

    def __init__(self, runner: PagedDecoder, max_batch: int, capture: CaptureFn) -> None:
        self.runner = runner
        self.buckets = graph_buckets(max_batch)
        self.capture = capture
        self.static: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.graphs: dict[int, Callable[[], torch.Tensor]] = {}

    def bucket_for(self, batch: int) -> int | None:
        """The smallest bucket holding ``batch`` sequences (None past the largest: eager)."""
        for size in self.buckets:
            if size >= batch:
                return size
        return None

    def inputs(self, chunks: Sequence[ScheduledChunk], bucket: int) -> StepInputs:
        """The step's inputs padded to ``bucket`` with the static block-table width."""
        return build_step_inputs(
            chunks,
            self.runner.block_size,
            pad_to=bucket,
            table_width=self.runner.max_blocks_per_seq,
            scratch_block=self.runner.num_blocks,
        )

    def buffers(self, bucket: int, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """``bucket``'s static device buffers (allocated the first time, sized like ``inputs``)."""
        static = self.static.get(bucket)
        if static is None:
            device = self.runner.device
            static = self.static[bucket] = (
                torch.zeros(inputs.longs.shape, dtype=torch.int64, device=device),
                torch.zeros(inputs.ints.shape, dtype=torch.int32, device=device),
            )
        return static

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket now, largest first (their memory pool then fits the rest), on
        padding-only inputs that write nothing but the scratch block: a capture in the middle
        of serving would stall every running request for its duration."""
        started = time.perf_counter()
        for bucket in reversed(self.buckets):
            inputs = self.inputs([], bucket)
            longs, ints = self.buffers(bucket, inputs)
            longs.copy_(inputs.longs)
            ints.copy_(inputs.ints)
            self.replay(bucket, inputs)
        logger.info(
            "serving: captured %d decode graphs (batch buckets %s) in %.1fs",
            len(self.buckets),
            self.buckets,
            time.perf_counter() - started,
        )

    def replay(self, bucket: int, inputs: StepInputs) -> torch.Tensor:
        """Replay ``bucket``'s graph over its static buffers (capturing it the first time);
        returns the static logits ``(bucket, vocab)``."""
        replay = self.graphs.get(bucket)
        if replay is None:
            runner = self.runner
            views = inputs.views(*self.static[bucket])

            def step() -> torch.Tensor:
                return runner.run(views, 1)

            # Were a capture to happen on a live step, its warm-up runs would rewrite that
            # step's own keys and values (the same values); padding rows write only the scratch
            # block.
            replay = self.graphs[bucket] = self.capture(step)
        return replay()
