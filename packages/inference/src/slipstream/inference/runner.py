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
    positions: torch.Tensor | None = None
    slot: torch.Tensor | None = None  # (1,)
    logits: torch.Tensor | None = None  # static graph output (batch, vocab)
    graph_failed: bool = False


class StaticCacheRunner:
    """Runs a :class:`FusedDecoder` for ``generate``: one cache of ``max_len`` slots per batch size.

    With ``cuda_graph`` on a CUDA device, the first decode step of each batch size is captured
    (gpt-fast's idea, done with a raw ``torch.cuda.CUDAGraph`` rather than ``torch.compile``)
    and every later step is one replay: inputs are copied into static buffers, the slot is a
    device tensor, and attention covers all ``max_len`` slots under the key-valid mask, so that
    shapes never change; the step marks its slot valid inside the graph. A capture that fails
    logs one warning and that batch size runs eagerly.

    ``prefill`` and ``decode`` return fp32 logits, as Hugging Face's ``generate`` hands them to
    its logits processors (the graph's output is copied out by that one conversion).
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
        bucket.key_valid.zero_()
        bucket.key_valid[:, :length] = key_valid
        slots = torch.arange(length, device=input_ids.device)
        logits = self.model(
            input_ids, positions, bucket.key_valid[:, :length], slots, bucket.cache, last_only=True
        )
        return logits[:, -1].float()

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, slot: int) -> torch.Tensor:
        """One token per row at cache ``slot`` (``positions`` below ``max_len``); returns fp32
        logits ``(batch, vocab)``."""
        self._check_length(slot + 1)
        bucket = self._bucket(tokens.shape[0])
        if self.cuda_graph and tokens.is_cuda and not bucket.graph_failed:
            if bucket.graph is None:
                self._capture(bucket, tokens, positions, slot)
            if bucket.graph is not None:
                assert bucket.tokens is not None and bucket.positions is not None
                assert bucket.slot is not None and bucket.logits is not None
                bucket.tokens.copy_(tokens[:, None])
                bucket.positions.copy_(positions[:, None])
                bucket.slot.fill_(slot)
                bucket.graph.replay()  # marks key_valid[:, slot] itself (mark_valid)
                # A copy the next replay cannot overwrite, in fp32 for the logits processors.
                logits = bucket.logits
                return logits.float() if logits.dtype != torch.float32 else logits.clone()
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
        return logits[:, -1].float()

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
        try:
            # Warm up on a side stream (lazy inits, Triton compiles) before capturing; the warm-up
            # writes this step's keys and values, which the captured replay rewrites identically.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._graph_step(bucket)
            torch.cuda.current_stream().wait_stream(side)
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
