"""Point-to-point exchange of activations and gradients between pipeline ranks.

[Note: one communicator per direction] NCCL runs the sends and receives between two ranks of
one process group on one stream, in order. If two neighbours each start a large send to the
other and then a receive, both sends wait for receives queued behind them: a deadlock (1F1B
does exactly that in its steady state: activations go down while gradients come up). So each
kind of message travels in its own group: activations, gradients, and, for the interleaved
schedule, the wrap-around from the last rank to the first (which on two ranks is the reverse
direction of the same pair). Within a group every rank pair then carries one direction only,
and :func:`slipstream.pipeline.schedules.simulate` checks that each such channel is read in
the order it is written.

[Note: shape negotiation] A receiver must allocate a buffer of the right shape and dtype
before the data arrives. The first message of each batch on each channel is preceded by a
small int64 header (count, then per tensor: dtype code, requires-grad flag, rank, sizes).
Later micro-batches of the batch reuse it, so a batch costs two extra tiny messages per
channel, and shapes may change from one batch to the next (sequence length, batch size).
Within a batch they must not: the sender checks and raises.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["StageCommunicator", "TensorMeta"]

_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}

TensorMeta = tuple[torch.dtype, bool, tuple[int, ...]]


def _encode(tensors: Sequence[torch.Tensor]) -> list[int]:
    header = [len(tensors)]
    for tensor in tensors:
        if tensor.dtype not in _DTYPE_CODE:
            raise TypeError(
                f"cannot send a {tensor.dtype} tensor between pipeline stages; use one of "
                f"{[str(d) for d in _DTYPES]}"
            )
        header += [_DTYPE_CODE[tensor.dtype], int(tensor.requires_grad), tensor.dim()]
        header += list(tensor.shape)
    return header


def _decode(header: list[int]) -> list[TensorMeta]:
    metas: list[TensorMeta] = []
    count, pos = header[0], 1
    for _ in range(count):
        dtype, requires_grad, ndim = _DTYPES[header[pos]], bool(header[pos + 1]), header[pos + 2]
        shape = tuple(header[pos + 3 : pos + 3 + ndim])
        pos += 3 + ndim
        metas.append((dtype, requires_grad, shape))
    return metas


def _meta(tensors: Sequence[torch.Tensor]) -> list[TensorMeta]:
    return [(t.dtype, t.requires_grad, tuple(t.shape)) for t in tensors]


class StageCommunicator:
    """Sends and receives one rank's activations and gradients along its pipeline.

    Args:
        pipe_ranks: global ranks of this pipeline's stages, in stage order.
        stage: this rank's stage.
        device: where received tensors are allocated.
        groups: ``{"act", "grad", "act_wrap", "grad_wrap"}`` → process group (see the module
            notes); :meth:`create_groups` makes them.

    Messages are addressed by model *part* (``chunk · P + stage``): the peer of part ``s`` is
    part ``s ± 1``, on stage ``(s ± 1) % P``. A part on this same rank (one stage, several
    chunks) is handed over in memory.
    """

    def __init__(
        self,
        pipe_ranks: Sequence[int],
        stage: int,
        device: torch.device,
        groups: dict[str, dist.ProcessGroup | None],
    ) -> None:
        self.pipe_ranks = list(pipe_ranks)
        self.num_stages = len(self.pipe_ranks)
        self.stage = stage
        self.device = device
        self.groups = groups
        self._pending: list[tuple[Any, Any]] = []  # (work, tensors kept alive until done)
        self._sent_meta: dict[tuple[str, int], list[TensorMeta]] = {}
        self._recv_meta: dict[tuple[str, int], list[TensorMeta]] = {}
        self._local: dict[tuple[str, int], deque[list[torch.Tensor]]] = {}
        self.header_messages = 0  # headers sent plus headers received (for tests and logs)

    @staticmethod
    def create_groups(pipe_rank_lists: Sequence[Sequence[int]], my_rank: int) -> dict[str, Any]:
        """Create the four message groups for every pipeline (collective over the world).

        ``pipe_rank_lists`` lists every pipeline's ranks (``topology.get_axis_comm_lists``);
        returns this rank's groups.
        """
        mine: dict[str, Any] = {}
        for kind in ("act", "grad", "act_wrap", "grad_wrap"):
            for ranks in pipe_rank_lists:
                group = dist.new_group(list(ranks)) if len(ranks) > 1 else None
                if my_rank in ranks:
                    mine[kind] = group
        return mine

    # ------------------------------------------------------------------ batch framing
    def start_batch(self) -> None:
        """Forget the negotiated shapes: the next message on each channel carries a header."""
        self._sent_meta.clear()
        self._recv_meta.clear()

    def finish(self) -> None:
        """Wait for every outstanding send (their buffers may then be reused)."""
        for work, _ in self._pending:
            if work is not None:
                work.wait()
        self._pending.clear()

    # ------------------------------------------------------------------ addressing
    def _route(self, kind: str, part: int, outgoing: bool) -> tuple[int, int, str]:
        """(peer part, peer stage, group key) of a message about ``part``."""
        step = 1 if kind == "act" else -1
        peer_part = part + step if outgoing else part - step
        src_part = part if outgoing else peer_part
        # Activations wrap from the last stage to the first, gradients from the first to the
        # last (see the note on one communicator per direction).
        src_stage = src_part % self.num_stages
        wraps = src_stage == (self.num_stages - 1 if kind == "act" else 0)
        return peer_part, peer_part % self.num_stages, f"{kind}_wrap" if wraps else kind

    # ------------------------------------------------------------------ sending
    def send(self, kind: str, part: int, tensors: Sequence[torch.Tensor]) -> None:
        """Send ``tensors`` of model part ``part``: activations to part+1, gradients to
        part-1. Activations carry a header on the first message of a batch; gradients never
        do (the receiver knows the shapes of the activations they belong to)."""
        peer_part, peer, group_key = self._route(kind, part, outgoing=True)
        if peer == self.stage:
            # Same rank (one stage, several chunks): hand over in memory.
            self._local.setdefault((kind, peer_part), deque()).append(
                [t.clone() if kind == "grad" else _as_received(t) for t in tensors]
            )
            return
        dst = self.pipe_ranks[peer]
        group = self.groups[group_key]
        if kind == "act":
            meta = _meta(tensors)
            negotiated = self._sent_meta.get((kind, part))
            if negotiated is None:
                header = torch.tensor(_encode(tensors), dtype=torch.int64, device=self.device)
                length = torch.tensor([header.numel()], dtype=torch.int64, device=self.device)
                self._isend(length, dst, group)
                self._isend(header, dst, group)
                self._sent_meta[(kind, part)] = meta
                self.header_messages += 1
            elif [(d, s) for d, _, s in negotiated] != [(d, s) for d, _, s in meta]:
                raise RuntimeError(
                    f"pipeline stage {self.stage} sends activations of shapes "
                    f"{[s for _, _, s in meta]} after {[s for _, _, s in negotiated]} earlier "
                    "in the same batch; every micro-batch of a batch must have the same shapes "
                    "(pad them, or split the batch)"
                )
        for tensor in tensors:
            self._isend(tensor.detach().contiguous(), dst, group)

    def _isend(self, tensor: torch.Tensor, dst: int, group: Any) -> None:
        # Asynchronous: the schedule's correctness argument assumes sends never block
        # (see the schedules module note).
        work = dist.isend(tensor, dst, group=group)
        # Keep the tensor alive until its send completes; drop the finished ones so that a
        # batch's sent gradients are not all held until its end.
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]
        self._pending.append((work, tensor))

    # ------------------------------------------------------------------ receiving
    def recv(
        self, kind: str, part: int, like: Sequence[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        """Receive the tensors for model part ``part``: activations from part-1 (float ones
        that required grad at the sender come back requiring grad), gradients from part+1
        (``like``: the activations they belong to, which give their shapes)."""
        _, peer, group_key = self._route(kind, part, outgoing=False)
        if peer == self.stage:
            queue = self._local.get((kind, part))
            if not queue:
                raise RuntimeError(
                    f"stage {self.stage} expects {kind} for part {part} from itself, but none "
                    "was sent: the schedule is out of order"
                )
            return queue.popleft()
        src = self.pipe_ranks[peer]
        group = self.groups[group_key]
        if kind == "grad":
            if like is None:
                raise ValueError("receiving gradients needs like=<the activations sent>")
            metas: list[TensorMeta] = [(t.dtype, False, tuple(t.shape)) for t in like]
        else:
            cached = self._recv_meta.get((kind, part))
            if cached is None:
                length = torch.empty(1, dtype=torch.int64, device=self.device)
                dist.recv(length, src, group=group)
                header = torch.empty(int(length.item()), dtype=torch.int64, device=self.device)
                dist.recv(header, src, group=group)
                cached = _decode(header.tolist())  # host sync: once per channel per batch
                self._recv_meta[(kind, part)] = cached
                self.header_messages += 1
            metas = cached
        out = []
        for dtype, requires_grad, shape in metas:
            buffer = torch.empty(shape, dtype=dtype, device=self.device)
            dist.recv(buffer, src, group=group)
            if requires_grad and buffer.is_floating_point():
                buffer.requires_grad_(True)
            out.append(buffer)
        return out


def _as_received(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` as a receiver would get it: a fresh leaf, requiring grad as sent."""
    copy = tensor.detach().clone()
    if tensor.requires_grad and copy.is_floating_point():
        copy.requires_grad_(True)
    return copy
