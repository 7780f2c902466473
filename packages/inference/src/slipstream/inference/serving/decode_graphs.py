"""Decode-only steps replayed from CUDA graphs, one per batch-size bucket.

[Note: decode graphs] A step whose chunks are all single-token decodes has fixed shapes once
padded to a batch-size bucket: :class:`DecodeGraphs` copies its inputs into static buffers and
replays a CUDA graph captured for every bucket when the engine starts. Padding rows decode
token 0 at position 0 into a scratch block (the cache has one block more than the pool hands
out), so they never touch a real request's keys; their logits are dropped. Steps with a prompt
chunk run eagerly (their token count changes every step, and they are a few percent of the
steps of a long generation).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from slipstream.inference.serving.scheduler import ScheduledChunk
from slipstream.inference.serving.step_inputs import (
    BlockTableRows,
    StepInputs,
    build_step_inputs,
)

if TYPE_CHECKING:
    from slipstream.inference.serving.model_runner import PagedDecoder

logger = logging.getLogger(__name__)

# A capture function turns a step closure into a replay closure returning the same tensor.
CaptureFn = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]


def graph_buckets(max_batch: int) -> list[int]:
    """Batch sizes decode graphs are captured for: 1, 2, 4, 8, then every 16 up to ``max_batch``.

    A decode step of ``n`` requests runs in the smallest bucket ``>= n`` (at most 15 padding
    rows past 8); ``max_batch`` itself is always a bucket.
    """
    sizes = [size for size in (1, 2, 4, 8) if size < max_batch]
    sizes += list(range(16, max_batch, 16))
    return [*sizes, max_batch]


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
        self.table_rows: dict[int, BlockTableRows] = {}
        self.graphs: dict[int, Callable[[], torch.Tensor]] = {}

    def bucket_for(self, batch: int) -> int | None:
        """The smallest bucket holding ``batch`` sequences (None past the largest: eager)."""
        for size in self.buckets:
            if size >= batch:
                return size
        return None

    def inputs(self, chunks: Sequence[ScheduledChunk], bucket: int) -> StepInputs:
        """The step's inputs padded to ``bucket`` with the static block-table width."""
        rows = self.table_rows.get(bucket)
        if rows is None:
            rows = self.table_rows[bucket] = BlockTableRows(
                bucket, self.runner.max_blocks_per_seq, self.runner.num_blocks
            )
        return build_step_inputs(
            chunks,
            self.runner.block_size,
            pad_to=bucket,
            scratch_block=self.runner.num_blocks,
            table_rows=rows,
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
