"""Stages 1-2 on one NVLink node: publish updated shards with peer copies (copy engines, no SMs)."""

from __future__ import annotations

import logging
import os
import socket
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from slipstream.zero.group import DataParallelGroup
from slipstream.zero.layout import ShardSpec

__all__ = ["PeerPublish", "peer_publish_unavailable", "symmetric_buffer_layout"]

logger = logging.getLogger(__name__)

# Where the publish phases end, as shares of the elements (in parameter order): the first
# holds the first eighth (the next forward's first layers wait only for it); the others let
# a step taken phase by phase (ZeroOptimizer) publish one phase while it steps the next, and
# shrink towards the end, since the pulls of the last phase are what the step leaves exposed
# (a phase's pulls take about as long as the step of as many elements).
_PHASE_ENDS = (1 / 8, 1 / 2, 13 / 16, 15 / 16, 1.0)

# Parameters start on 128-byte boundaries inside the symmetric buffer (full cache lines for
# the peer copies).
_ALIGN_BYTES = 128


def symmetric_buffer_layout(numels: Sequence[int], element_size: int) -> tuple[list[int], int]:
    """Where each parameter of ``numels`` elements starts in the symmetric buffer (in
    elements, each on a 128-byte boundary) and the buffer's length (at least one element).

    The buffer holds the parameters themselves, outside the caching allocator: its bytes
    (``length * element_size``) are not in ``torch.cuda.max_memory_allocated``, so
    :meth:`ShardedOptimizerStates.memory_report` lists them (``publish_buffer_<device>``).
    """
    align = max(1, _ALIGN_BYTES // element_size)
    offsets: list[int] = []
    total = 0
    for numel in numels:
        offsets.append(total)
        total += -(-numel // align) * align
    return offsets, max(total, 1)


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


MULTICAST_ENV = "TORCH_SYMM_MEM_DISABLE_MULTICAST"
_multicast_decided = False


def _no_multicast() -> None:
    """Once per process, before the first symmetric buffer: tell torch's symmetric-memory
    allocator not to create NVLink multicast objects, unless the user set
    ``TORCH_SYMM_MEM_DISABLE_MULTICAST`` already (then it is left as it is).

    The peer publish uses peer copies and barriers, never multicast (``multimem``), so the
    default publish never depends on NVLS support. Torch reads the variable when it
    allocates, for every symmetric buffer of the process: logged (rank 0, info), so that
    code of the user's own that wants multicast knows to set it to 0 first (docs/zero.md)."""
    global _multicast_decided
    if _multicast_decided:
        return
    _multicast_decided = True
    if MULTICAST_ENV in os.environ:
        logger.info(
            "%s=%s (set by the user): left as it is", MULTICAST_ENV, os.environ[MULTICAST_ENV]
        )
        return
    os.environ[MULTICAST_ENV] = "1"
    logger.info(
        "symmetric memory (publish_transport copy_engine): %s=1 set for this process (no NVLink "
        "multicast objects are created); set it to 0 before slipstream.initialize to keep them",
        MULTICAST_ENV,
    )


def _enable_group(symm_mem: Any, pg: dist.ProcessGroup) -> None:
    """Register ``pg`` with symmetric memory (older torch needs it; newer: a no-op), after
    :func:`_no_multicast`."""
    _no_multicast()
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
    wrote the masters), casts this rank's pieces of a phase's parameters, then a barrier:
    every rank's pieces are written before anyone pulls them. A last barrier after all the
    pulls marks that no rank still reads another's buffer; ``land_all`` (called before the
    next backward and the next step) makes the current stream wait for it, so the next step's
    writes (masters, then this buffer) cannot race the side stream or a slow peer's pulls.
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
        self.offsets, total = symmetric_buffer_layout(
            [p.numel() for p in self.params], torch.empty((), dtype=dtype).element_size()
        )
        pg = _process_group(group)
        _enable_group(symm_mem, pg)
        self.buffer = symm_mem.empty(total, dtype=dtype, device=self.device)
        self._views: list[torch.Tensor] = []
        with torch.no_grad():
            for p, offset in zip(self.params, self.offsets):
                view = self.buffer[offset : offset + p.numel()].view(p.shape)
                view.copy_(p.data)
                p.data = view
                self._views.append(view)
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
        # The phases (see start()): consecutive parameters, ending where the elements seen
        # reach each share of _PHASE_ENDS (a phase may be empty).
        total_numel = sum(p.numel() for p in self.params)
        ends, seen, share = [], 0, 0
        for i, p in enumerate(self.params):
            seen += p.numel()
            while share < len(_PHASE_ENDS) and seen >= _PHASE_ENDS[share] * total_numel:
                ends.append(i + 1)
                share += 1
        ends += [len(self.params)] * (len(_PHASE_ENDS) - len(ends))
        starts = [0, *ends[:-1]]
        self.phases: list[range] = [range(a, b) for a, b in zip(starts, ends)]
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
        """On the side stream: write this rank's updated ``shards`` (the fp32 masters) into
        its parameters, cast, and pull every other rank's pieces; returns at once.

        Phase by phase (:attr:`phases`), each a cast of this rank's pieces, a barrier (every
        rank's pieces of the phase are written) and the pulls: the first phase holds the
        first eighth of the elements, so the next forward's first layers wait for a small
        cast and a small pull, and the rest runs beside that forward instead of before it.
        The masters are read here while the current stream goes on; it writes them again
        only in the next step, after :meth:`land_all`."""
        self.begin()
        for phase in range(len(self.phases)):
            self.start_phase(phase, shards)
        self.end()

    def begin(self) -> None:
        """Before the first :meth:`start_phase` of a publish: land the last one (if no
        forward needed it) and follow any parameter whose ``.data`` was replaced."""
        self.land_all()
        self._rehome()
        self._events, self._done, self._landed = [], None, 0

    @torch.no_grad()
    def start_phase(self, phase: int, shards: Sequence[torch.Tensor]) -> None:
        """On the side stream, once the current stream has reached this point (the step
        wrote these masters): cast this rank's pieces of ``phase``, a barrier, the pulls.
        Phases start in order, each once per publish, the same on every rank."""
        indices = self.phases[phase]
        if len(self._events) != indices.start:
            raise RuntimeError(
                f"peer publish phase {phase} started out of order (after "
                f"{len(self._events)} parameters, expected {indices.start})"
            )
        side = self._side
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            own = [i for i in indices if self._own_len[i]]
            if own:
                torch._foreach_copy_(
                    [self._own_dst[i] for i in own],
                    [shards[i].detach().reshape(-1)[: self._own_len[i]] for i in own],
                )
            if not indices:
                return
            self.handle.barrier(channel=0)
            for i in indices:
                for into, source in self._pulls[i]:
                    into.copy_(source)
                event = torch.cuda.Event()
                event.record(side)
                self._events.append(event)

    def end(self) -> None:
        """After the last :meth:`start_phase`: the barrier that marks every rank's pulls
        done (see [Note: peer publish ordering])."""
        if len(self._events) != len(self.params):
            raise RuntimeError(
                f"peer publish ended after {len(self._events)} of {len(self.params)} parameters"
            )
        with torch.cuda.stream(self._side):
            self.handle.barrier(channel=0)
            done = torch.cuda.Event()
            done.record(self._side)
        self._done, self._landed = done, 0

    def _rehome(self) -> None:
        """Point a parameter whose ``.data`` was replaced since (``p.data = ...``,
        ``load_state_dict(assign=True)``) back into the buffer: this publish writes every
        element of it, as the all-gathers would write into the new tensor."""
        for index, (p, view) in enumerate(zip(self.params, self._views)):
            if p.data_ptr() == view.data_ptr():
                continue
            if p.shape != view.shape or p.dtype != view.dtype or p.device != view.device:
                raise RuntimeError(
                    f"parameter {index} of this ZeRO stage-1/2 group changed to shape "
                    f"{tuple(p.shape)}, {p.dtype} on {p.device} (was {tuple(view.shape)}, "
                    f"{view.dtype} on {view.device}) after it was sharded; the copy-engine "
                    "publish (zero_optimization.publish_transport) cannot follow it. Change "
                    "the model before slipstream.initialize, or set publish_transport "
                    '"collective"'
                )
            p.data = view

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
