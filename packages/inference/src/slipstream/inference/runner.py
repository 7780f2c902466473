"""Prefill and decode over a static KV cache, the decode step replayed from a CUDA graph."""

from __future__ import annotations

import dataclasses
import logging

import torch

from slipstream.inference.model import MOE_DECODE_ROWS, FusedDecoder, KVCache

__all__ = ["StaticCacheRunner"]

logger = logging.getLogger(__name__)

EAGER_WIDTH = 256  # attention width granularity of an eager decode step


@dataclasses.dataclass
class _Bucket:
    """Per batch size: the cache, the key-valid mask and (on GPU) the captured decode graph."""

    cache: KVCache
    key_valid: torch.Tensor  # (batch, max_len) bool
    graph: torch.cuda.CUDAGraph | None = None
    tokens: torch.Tensor | None = None  # static graph inputs (batch, 1)
    positions: torch.Tensor | None = None  # advanced by one on the device by every replay
    slot: torch.Tensor | None = None  # (1,) the step's slot, which the blocks read
    next_slot: torch.Tensor | None = None  # (1,) the next step's, advanced by every replay
    logits: torch.Tensor | None = None  # static graph output (batch, vocab)
    graph_failed: bool = False
    # What the device holds for the next replay: next_slot's value (None: unknown), and whether
    # ``positions`` holds the last step's plus one (after a replay; not after a prefill).
    device_slot: int | None = None
    advanced: bool = False
    next_positions: torch.Tensor | None = None  # (batch,) after an eager decode step


class StaticCacheRunner:
    """Runs a :class:`FusedDecoder` for ``generate``: one cache of ``max_len`` slots per batch size.

    With ``cuda_graph`` on a CUDA device, the first decode step of each batch size is captured
    (gpt-fast's idea, done with a raw ``torch.cuda.CUDAGraph`` rather than ``torch.compile``)
    and every later step is one replay: inputs are copied into static buffers, the slot is a
    device tensor, and attention covers all ``max_len`` slots under the key-valid mask, so that
    shapes never change; the step marks its slot valid inside the graph. A capture that fails
    logs one warning and that batch size runs eagerly.

    ``prefill`` and ``decode`` return fp32 logits, as Hugging Face's ``generate`` hands them to
    its logits processors (the graph's output is copied out by that one conversion). A replay
    advances the step's positions and slot by one on the device, so that the next step (called
    with ``positions=None``, at the next slot) needs nothing copied in but its tokens.
    """

    def __init__(self, model: FusedDecoder, max_len: int, *, cuda_graph: bool) -> None:
        self.model = model
        self.max_len = max_len
        self.cuda_graph = cuda_graph
        self.buckets: dict[int, _Bucket] = {}
        # Decode steps compute their first block's inputs in one decode_inputs launch, with the
        # rotary cos/sin of every slot's position computed once here.
        model.build_decode_tables(max_len)

    def captured(self, batch: int) -> bool:
        """Whether batch size ``batch`` decodes by replaying a captured CUDA graph."""
        bucket = self.buckets.get(batch)
        return bucket is not None and bucket.graph is not None

    def _bucket(self, batch: int) -> _Bucket:
        bucket = self.buckets.get(batch)
        if bucket is None:
            param = self.model.embed.weight
            kv_heads = int(self.model.blocks[0].kv_heads)  # type: ignore[arg-type]
            cache = KVCache.allocate(
                self.model.spec, batch, self.max_len, kv_heads, param.dtype, param.device
            )
            key_valid = torch.zeros(batch, self.max_len, dtype=torch.bool, device=param.device)
            bucket = self.buckets[batch] = _Bucket(cache, key_valid)
        return bucket

    def _check_length(self, needed: int) -> None:
        if needed > self.max_len:
            raise ValueError(
                f"prompt plus new tokens need {needed} KV-cache slots but max_out_tokens is "
                f"{self.max_len}; raise max_out_tokens in the inference config"
            )

    @torch.no_grad()
    def prefill(
        self, input_ids: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor
    ) -> torch.Tensor:
        """Fill the cache with the prompts; returns the last token's fp32 logits ``(batch, vocab)``."""
        batch, length = input_ids.shape
        self._check_length(length)
        bucket = self._bucket(batch)
        bucket.advanced, bucket.next_positions = False, None
        bucket.key_valid.zero_()
        bucket.key_valid[:, :length] = key_valid
        slots = torch.arange(length, device=input_ids.device)
        logits = self.model(
            input_ids, positions, bucket.key_valid[:, :length], slots, bucket.cache, last_only=True
        )
        return logits[:, -1].float()

    @torch.no_grad()
    def decode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None,
        slot: int,
        *,
        copy: bool = True,
    ) -> torch.Tensor:
        """One token per row at cache ``slot``; returns fp32 logits ``(batch, vocab)``.

        ``positions`` ``(batch,)`` are the tokens' position ids (below ``max_len``), or None
        for the previous decode step's (of this batch size, since its prefill) plus one.
        ``copy=False``: the logits in the model's dtype, a replayed step's being the graph's
        output buffer itself, which the next decode step of this batch size overwrites (for a
        caller done with them by then, as ``generate``: no copy per step).
        """
        self._check_length(slot + 1)
        batch = tokens.shape[0]
        bucket = self._bucket(batch)
        given = positions
        if positions is None:
            positions = self._next_positions(bucket)
        if self.cuda_graph and tokens.is_cuda and not bucket.graph_failed:
            if bucket.graph is None:
                self._capture(bucket, tokens, positions, slot)
            if bucket.graph is not None:
                assert bucket.tokens is not None and bucket.positions is not None
                assert bucket.next_slot is not None and bucket.logits is not None
                bucket.tokens.copy_(tokens[:, None])
                if given is not None or not bucket.advanced:
                    bucket.positions.copy_(positions[:, None])
                if bucket.device_slot != slot:
                    bucket.next_slot.fill_(slot)
                # The replay marks key_valid[:, slot] and advances positions and next_slot.
                bucket.graph.replay()
                bucket.advanced, bucket.device_slot = True, slot + 1
                # A copy the next replay cannot overwrite, in fp32 for the logits processors.
                logits = bucket.logits
                if not copy:
                    return logits
                return logits.float() if logits.dtype != torch.float32 else logits.clone()
        bucket.advanced = False
        bucket.key_valid[:, slot] = True
        slots = torch.tensor([slot], device=tokens.device)
        # Eager steps attend over a width rounded up to EAGER_WIDTH slots (the later ones are
        # masked: not yet valid, and after this slot): attention backends that plan per shape
        # (cuDNN's SDPA) then see a new shape every EAGER_WIDTH steps, not every step.
        width = min(self.max_len, -(-(slot + 1) // EAGER_WIDTH) * EAGER_WIDTH)
        logits = self.model(
            tokens[:, None],
            positions[:, None],
            bucket.key_valid[:, :width],
            slots,
            bucket.cache,
        )
        bucket.next_positions = positions + 1
        return logits[:, -1].float() if copy else logits[:, -1]

    def _next_positions(self, bucket: _Bucket) -> torch.Tensor:
        """The positions a ``decode(positions=None)`` step of ``bucket`` continues from."""
        if bucket.advanced and bucket.positions is not None:
            return bucket.positions[:, 0]
        if bucket.next_positions is None:
            raise ValueError(
                "decode(positions=None) continues the previous decode step of this batch size; "
                "the first step after a prefill must pass its positions"
            )
        return bucket.next_positions

    def _graph_step(self, bucket: _Bucket) -> torch.Tensor:
        assert bucket.tokens is not None and bucket.positions is not None
        assert bucket.slot is not None
        logits = self.model(
            bucket.tokens,
            bucket.positions,
            bucket.key_valid,
            bucket.slot,
            bucket.cache,
            mark_valid=True,
            next_slot=bucket.next_slot,
        )
        return logits[:, -1]

    def _capture(
        self, bucket: _Bucket, tokens: torch.Tensor, positions: torch.Tensor, slot: int
    ) -> None:
        spec = self.model.spec
        if spec.mlp == "moe" and tokens.shape[0] * spec.experts_per_token > MOE_DECODE_ROWS:
            # Past MOE_DECODE_ROWS (token, expert) rows the expert loop runs: it syncs with the
            # host for its per-expert counts, so this batch size decodes eagerly.
            bucket.graph_failed = True
            logger.info("batch %d of a MoE decoder decodes eagerly (no graph)", tokens.shape[0])
            return
        bucket.tokens = tokens[:, None].clone()
        bucket.positions = positions[:, None].clone()
        bucket.slot = torch.tensor([slot], device=tokens.device)
        bucket.next_slot = bucket.slot.clone()
        try:
            # Warm up on a side stream (lazy inits, Triton compiles) before capturing; the warm-up
            # writes this step's keys and values, which the captured replay rewrites identically
            # (each run starts from this step's positions and slot: a run advances them).
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    bucket.positions.copy_(positions[:, None])
                    bucket.next_slot.fill_(slot)
                    self._graph_step(bucket)
            torch.cuda.current_stream().wait_stream(side)
            bucket.advanced, bucket.device_slot = False, None  # decode copies this step's in
            graph = torch.cuda.CUDAGraph()
            # Captured on the warm-up stream: per-stream scratch the warm-up made (the split-K
            # GEMVs' workspace) is found at capture, where it cannot be allocated.
            with torch.cuda.graph(graph, stream=side):
                bucket.logits = self._graph_step(bucket)
            bucket.graph = graph
        except Exception as error:  # any capture failure falls back to eager
            bucket.graph, bucket.graph_failed = None, True
            logger.warning(
                "CUDA graph capture of the decode step failed for batch %d (%s); this batch "
                "size runs eagerly",
                tokens.shape[0],
                error,
            )
