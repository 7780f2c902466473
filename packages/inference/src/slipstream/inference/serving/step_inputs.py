"""One step's scheduled chunks packed into the host buffers the paged forward reads."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from slipstream.inference.serving.scheduler import ScheduledChunk

# int32s per 16 bytes: ``seq_lens`` and ``query_start_loc`` start at 16-byte offsets of
# ``ints`` (see [Note: aligned step buffers]).
_ALIGN = 4


def _padding(length: int) -> int:
    return -length % _ALIGN


def ints_length(num_seqs: int, table_width: int) -> int:
    """Length of a step's ``ints`` buffer: the block tables, ``seq_lens`` and
    ``query_start_loc``, the first two padded to 16 bytes."""
    tables = num_seqs * table_width
    return tables + _padding(tables) + num_seqs + _padding(num_seqs) + num_seqs + 1


# [Note: aligned step buffers]
# Triton compiles a kernel once per 16-byte alignment of each pointer argument. seq_lens and
# query_start_loc are views into one int32 buffer after the (seqs x width) block table; without
# padding, their alignment changed with seqs * width, and paged_attention compiled (about half
# a second on an H100) in the middle of serving whenever a step met a new combination — the
# evening benchmark's first 2048-token prompt step took 606 ms where the next ones took 50.
# Padding each section to 16 bytes keeps every view aligned, so one variant serves all steps.


@dataclasses.dataclass
class StepInputs:
    """One step's inputs on the host, packed into two buffers so that one copy each moves them.

    ``longs`` is ``[input_ids | positions | slots | sample_rows]`` (int64), ``ints`` is
    ``[block_tables (seqs x width) | seq_lens | query_start_loc]`` (int32, the kernel's types),
    the first two sections each padded to 16 bytes (:func:`ints_length`).
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
        pad_tables, pad_lens = _padding(s * w), _padding(s)
        tables, _, seq_lens, _, starts = ints.split([s * w, pad_tables, s, pad_lens, s + 1])
        return {
            "input_ids": ids,
            "positions": positions,
            "slots": slots,
            "sample_rows": rows,
            "block_tables": tables.view(s, w),
            "seq_lens": seq_lens,
            "query_start_loc": starts,
        }


class BlockTableRows:
    """A host ``(rows, width)`` block-table tensor kept from step to step, for a graph bucket.

    A decode-graph step has a wide static table (``max_model_len / block_size`` columns) that a
    list-to-tensor conversion would rebuild at milliseconds per step; here a row is rewritten
    only when its table changed (another request in that row, or a new block, once every
    ``block_size`` decodes). Columns past a row's table may hold stale blocks: the kernel reads
    only the blocks under the sequence's length.
    """

    def __init__(self, rows: int, width: int, scratch_block: int) -> None:
        self.tensor = torch.full((rows, width), scratch_block, dtype=torch.int32)
        self.scratch_block = scratch_block
        self._tables: list[list[int] | None] = [None] * rows

    def update(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """The table of ``chunks`` in its first rows, padding rows (scratch only) after them."""
        for row, chunk in enumerate(chunks):
            table = chunk.block_table
            if self._tables[row] != table:  # list equality: one C loop
                self.tensor[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
                self._tables[row] = table
        for row in range(len(chunks), len(self._tables)):
            if self._tables[row] is not None:
                self.tensor[row].fill_(self.scratch_block)
                self._tables[row] = None
        return self.tensor


def build_step_inputs(
    chunks: Sequence[ScheduledChunk],
    block_size: int,
    *,
    pad_to: int | None = None,
    table_width: int | None = None,
    scratch_block: int = 0,
    table_rows: BlockTableRows | None = None,
) -> StepInputs:
    """Pack ``chunks`` (in batch order) into :class:`StepInputs`, vectorised over tokens.

    ``pad_to`` adds single-token padding sequences up to that many (a decode-graph bucket):
    each decodes token 0 at position 0 into ``scratch_block`` and is sampled (its row is
    dropped by the caller). ``table_width`` fixes the block-table width (a graph's static
    shape); by default it is the longest table of the batch. ``table_rows`` keeps that table
    across steps (its width wins).
    """
    real = len(chunks)
    seqs = pad_to if pad_to is not None else real
    if seqs < real:
        raise ValueError(f"pad_to={pad_to} is smaller than the batch's {real} sequences")
    if table_rows is not None:
        table_width = table_rows.tensor.shape[1]
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
        if table_rows is None:
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
        if table_rows is None:
            tables += [scratch_block] * width
        seq_lens.append(1)
        starts.append(starts[-1] + 1)
        rows.append(starts[-1] - 1)
    longs = torch.tensor(ids + positions + slots + rows, dtype=torch.int64)
    pads = [0] * _padding(seqs * width)
    lens = seq_lens + [0] * _padding(seqs) + starts
    if table_rows is None:
        ints = torch.tensor(tables + pads + lens, dtype=torch.int32)
    else:
        table_tensor = table_rows.update(chunks).view(-1)
        ints = torch.cat([table_tensor, torch.tensor(pads + lens, dtype=torch.int32)])
    return StepInputs(longs, ints, starts[-1], seqs, len(rows), width, max_query_len)
