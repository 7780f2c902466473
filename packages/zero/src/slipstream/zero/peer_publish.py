"""Stages 1-2 on one NVLink node: publish updated shards with peer copies (copy engines, no SMs)."""

from __future__ import annotations

import logging
import socket
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from slipstream.zero.group import DataParallelGroup
from slipstream.zero.layout import ShardSpec

__all__ = ["PeerPublish", "peer_publish_unavailable"]

logger = logging.getLogger(__name__)

# Parameters start on 128-byte boundaries inside the symmetric buffer (full cache lines for
# the peer copies).
_ALIGN_BYTES = 128


def _symm_mem() -> Any:
    """torch's symmetric-memory module, or None when this build has none."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return None
    needed = ("empty", "rendezvous")
    return symm_mem if all(hasattr(symm_mem, name) for name in needed) else None


def _local_reason(params: Sequence[torch.Tensor], group: DataParallelGroup, offload: bool) -> str:
    """Why this rank cannot publish through peer copies ("" when it can, as far as it knows)."""
    if group.world_size == 1:
        return "a group of one rank has nothing to publish"
    if offload:
        return "optimizer offload publishes from host memory (offload_optimizer)"
    if not params:
        return "no trainable parameters"
    devices = {p.device for p in params}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        return "the parameters are not all on one CUDA device"
    if len({p.dtype for p in params}) != 1:
        return "the parameters have several dtypes"
    if dist.get_backend(group.group) != "nccl":
        return f"the process group's backend is {dist.get_backend(group.group)!r}, not 'nccl'"
    if _symm_mem() is None:
        return "this torch has no torch.distributed._symmetric_memory"
    return ""


def peer_publish_unavailable(
    params: Sequence[torch.Tensor], group: DataParallelGroup, *, offload: bool = False
) -> str:
    """Why ``publish_transport: "copy_engine"`` falls back to the all-gathers here ("" when it
    does not); the same answer on every rank (a collective when the local checks pass: every
    rank must be on this host)."""
    reason = _local_reason(params, group, offload)
    if reason:
        return reason
    hosts: list[Any] = [None] * group.world_size
    dist.all_gather_object(hosts, socket.gethostname(), group=group.group)
    if len(set(hosts)) != 1:
        return f"the group spans {len(set(hosts))} hosts (peer copies need one NVLink node)"
    # A small symmetric buffer first: a driver or container without the memory-sharing calls
    # fails here, on every rank, and every rank falls back together.
    failure = ""
    try:
        symm_mem = _symm_mem()
        _enable_group(symm_mem, _process_group(group))
        probe = symm_mem.empty(64, dtype=params[0].dtype, device=params[0].device)
        symm_mem.rendezvous(probe, _process_group(group))
    except Exception as error:  # any failure means: use the collectives
        failure = f"{type(error).__name__}: {error}"
    failures: list[Any] = [None] * group.world_size
    dist.all_gather_object(failures, failure, group=group.group)
    failed = [f for f in failures if f]
    if failed:
        return f"symmetric memory is not usable here ({failed[0][:200]})"
    return ""


def _process_group(group: DataParallelGroup) -> dist.ProcessGroup:
    pg = group.group if group.group is not None else dist.group.WORLD
    assert pg is not None
    return pg


def _enable_group(symm_mem: Any, pg: dist.ProcessGroup) -> None:
    """Register ``pg`` with symmetric memory (older torch needs it; newer: a no-op)."""
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            enable(pg.group_name)


class PeerPublish:
    """The parameters of a stage-1/2 group in one symmetric-memory buffer; after a step each
    rank writes its updated shards into its own copy and pulls the other ranks' shards out
    of theirs with device-to-device copies, which the GPUs' copy engines carry over NVLink
    without taking SMs from the compute.

    Built with :func:`peer_publish_unavailable` returning "" on every rank (collective: the
    buffer is allocated and exchanged here). Moves every parameter's ``.data`` into the
    buffer (values kept). :meth:`start` launches a publish on a side stream and returns at
    once; :meth:`land` makes the current stream wait until a parameter (and every one before
    it, in parameter order) has arrived; :meth:`land_all` waits for the whole publish and for
    the other ranks to be done reading this rank's buffer (before its next write).

    [Note: peer publish ordering] The side stream waits for the current stream (the step
    wrote this rank's shards), then a barrier: every rank's shards are written before anyone
    pulls. A second barrier after the pulls marks that no rank still reads another's
    buffer; ``land_all`` (called before the next backward and the next step) makes the
    current stream wait for it, so the next step's writes cannot race a slow peer's pulls.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        specs: Sequence[ShardSpec],
        group: DataParallelGroup,
    ) -> None:
        symm_mem = _symm_mem()
        assert symm_mem is not None
        self.params = list(params)
        self.specs = list(specs)
        self.group = group
        self.rank, self.world = group.rank, group.world_size
        self.device = self.params[0].device
        dtype = self.params[0].dtype
        align = max(1, _ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
        self.offsets: list[int] = []
        total = 0
        for p in self.params:
            self.offsets.append(total)
            total += -(-p.numel() // align) * align
        pg = _process_group(group)
        _enable_group(symm_mem, pg)
        self.buffer = symm_mem.empty(max(total, 1), dtype=dtype, device=self.device)
        with torch.no_grad():
            for p, offset in zip(self.params, self.offsets):
                view = self.buffer[offset : offset + p.numel()].view(p.shape)
                view.copy_(p.data)
                p.data = view
        self.handle = symm_mem.rendezvous(self.buffer, pg)
        peers = [(self.rank + k) % self.world for k in range(1, self.world)]
        # Per parameter: (destination in this buffer, source in a peer's buffer) for each peer.
        self._pulls: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        remote = {
            peer: self.handle.get_buffer(peer, (self.buffer.numel(),), dtype) for peer in peers
        }
        own_dst: list[torch.Tensor] = []
        self._own_len: list[int] = []
        for spec, offset in zip(self.specs, self.offsets):
            pulls = []
            for peer in peers:
                start, length = self._piece(spec, peer)
                if length:
                    where = slice(offset + start, offset + start + length)
                    pulls.append((self.buffer[where], remote[peer][where]))
            self._pulls.append(pulls)
            start, length = self._piece(spec, self.rank)
            own_dst.append(self.buffer[offset + start : offset + start + length])
            self._own_len.append(length)
        self._own_dst = own_dst
        self._side = torch.cuda.Stream(self.device)
        self._events: list[torch.cuda.Event] = []
        self._done: torch.cuda.Event | None = None
        self._landed = 0

    @staticmethod
    def _piece(spec: ShardSpec, rank: int) -> tuple[int, int]:
        """(start, length) of ``rank``'s piece of the flat parameter (length 0: padding only)."""
        start, end = spec.valid_range(rank)
        return start, end - start

    @property
    def buffer_bytes(self) -> int:
        """Bytes of this rank's symmetric buffer (the parameters, outside the caching
        allocator's statistics)."""
        return self.buffer.numel() * self.buffer.element_size()

    @torch.no_grad()
    def start(self, shards: Sequence[torch.Tensor]) -> None:
        """Write this rank's updated ``shards`` (the fp32 masters) into its parameters, cast,
        and launch the pulls of every other rank's pieces on the side stream."""
        self.land_all()  # the last publish, if no forward needed it
        compute = torch.cuda.current_stream(self.device)
        dst = [d for d, n in zip(self._own_dst, self._own_len) if n]
        src = [s.detach().reshape(-1)[:n] for s, n in zip(shards, self._own_len) if n]
        if dst:
            torch._foreach_copy_(dst, src)
        side = self._side
        side.wait_stream(compute)
        events = []
        with torch.cuda.stream(side):
            self.handle.barrier(channel=0)
            for pulls in self._pulls:
                for into, source in pulls:
                    into.copy_(source)
                event = torch.cuda.Event()
                event.record(side)
                events.append(event)
            self.handle.barrier(channel=0)
            done = torch.cuda.Event()
            done.record(side)
        self._events, self._done, self._landed = events, done, 0

    def land(self, index: int) -> None:
        """The current stream waits until parameter ``index`` (and all before it) arrived."""
        if index < self._landed or not self._events:
            return
        torch.cuda.current_stream(self.device).wait_event(self._events[index])
        self._landed = index + 1

    def land_all(self) -> None:
        """The current stream waits for the whole publish and for every rank's pulls."""
        if self._done is None:
            return
        torch.cuda.current_stream(self.device).wait_event(self._done)
        self._events, self._done, self._landed = [], None, 0

    @property
    def in_flight(self) -> bool:
        """Whether a publish has not been landed completely."""
        return self._done is not None
