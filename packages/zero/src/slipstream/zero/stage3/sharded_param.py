"""ShardedParameter: one parameter's shard, and the full storage that comes and goes around it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from slipstream.zero.group import DataParallelGroup
from slipstream.zero.host_memory import HostArena
from slipstream.zero.layout import ShardSpec
from slipstream.zero.param_gather import copy_out
from slipstream.zero.stage3.state import ShardState

__all__ = [
    "ShardedParameter",
    "ensure_shards",
    "gather_full",
    "release_shards",
    "sharded_state_of",
]

# The attribute a partitioned nn.Parameter carries its ShardedParameter under.
ATTR = "_slipstream_zero"


def sharded_state_of(param: torch.Tensor) -> ShardedParameter | None:
    """The ShardedParameter of a ZeRO-3-partitioned parameter, or None for a plain tensor."""
    return getattr(param, ATTR, None)


class ShardedParameter:
    """A parameter partitioned over the data-parallel group (each rank holds 1/N of it).

    [Note: storage resizing, not ``.data`` swapping] The ``nn.Parameter`` object keeps its
    shape, dtype and identity for its whole life (optimizers, tied modules and autograd's
    saved tensors all refer to it). Freeing resizes its *storage* to 0 bytes; gathering
    resizes it back and copies the gathered values in. Views of the parameter that autograd
    saved during forward (``weight.t()`` inside ``F.linear``) share that storage, so they
    are freed with it and see the re-gathered values in backward; swapping ``param.data``
    instead would leave those views pinning the old memory. The copy goes through
    ``param.data`` (a separate version counter), so autograd's saved-tensor version check
    does not see the refill as an in-place modification.

    Attributes:
        param: the parameter. shard: this rank's shard (flat, padded; the all-gather input,
        cast to the parameter's dtype on its way into the collective). Before an optimizer
        is attached it is in the compute dtype; after, on the compute device, it *is* the fp32
        master shard (no separate 16-bit copy: [Note: ZeRO-3 memory]); with optimizer or
        parameter offload it stays a compute-dtype copy that each step refreshes. master:
        the fp32 master shard once an optimizer is attached. holders: active uses (a module's forward
        or backward, a prefetch, GatheredParameters); the storage is freed when it drops to 0,
        unless ``persistent``. store: with ``offload_param.device="nvme"``, the
        slipstream.offload.ParamSwapStore that swaps ``shard`` to disk between uses; code
        touching ``shard`` brackets it with :func:`ensure_shards`/:func:`release_shards`.
    """

    def __init__(
        self, param: torch.nn.Parameter, shard: torch.Tensor, group: DataParallelGroup
    ) -> None:
        self.param = param
        self.spec = ShardSpec(param.shape, group.world_size)
        self.full_numel = self.spec.numel  # read on every hook: not recomputed each time
        # The owning Stage3Model's count of gathered elements (a one-element list), kept by
        # the ``state`` setter; None until a model adopts this parameter.
        self.live: list[int] | None = None
        self._state = ShardState.UNSHARDED
        self.shard = shard
        self.group = group
        self.master: torch.Tensor | None = None
        self.holders = 0
        self.persistent = False
        self.pending: PendingGather | None = None
        self.store: Any = None
        # hpZ: this rank's slice of the full value within its node group (zeropp.py), kept
        # from a forward gather until the values change; None otherwise.
        self.secondary: torch.Tensor | None = None
        setattr(param, ATTR, self)

    @classmethod
    def partition(
        cls,
        param: torch.nn.Parameter,
        group: DataParallelGroup,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        broadcast: bool = True,
    ) -> ShardedParameter:
        """Shard a full parameter in place: broadcast rank 0's value, keep this rank's shard."""
        device = device or param.device
        target = dtype if (dtype is not None and param.is_floating_point()) else param.dtype
        with torch.no_grad():
            full = param.detach().to(device=device, dtype=target)
            if broadcast:
                full = full.contiguous()
                group.broadcast_(full, src=0)  # every rank starts from rank 0's weights
            spec = ShardSpec(param.shape, group.world_size)
            shard = spec.shard_of(full, group.rank)
            # A fresh storage owned by this parameter alone (it may have been a view).
            param.data = torch.empty(param.shape, dtype=target, device=device)
        sharded = cls(param, shard, group)
        sharded.free()
        return sharded

    @property
    def state(self) -> ShardState:
        """Whether the full data exists on this rank (see :class:`ShardState`)."""
        return self._state

    @state.setter
    def state(self, value: ShardState) -> None:
        live = self.live
        if live is not None and value is not self._state:
            live[0] += self.full_numel if value is ShardState.UNSHARDED else -self.full_numel
        self._state = value

    # ------------------------------------------------------------------ storage
    @property
    def full_nbytes(self) -> int:
        """Bytes of the full tensor."""
        return self.spec.numel * self.param.element_size()

    def free(self, keep_views: bool = False) -> None:
        """Release the full storage (only the shard stays).

        ``keep_views``: first move the parameter onto a storage of its own, so that tensors
        sharing the gathered storage (``p.detach()``, or ``p.cpu()`` on a CPU device, taken
        inside :class:`~slipstream.zero.GatheredParameters`) keep their values, as they do
        with DeepSpeed; the hot path frees in place instead.
        """
        if keep_views:
            with torch.no_grad():
                self.param.data = torch.empty_like(self.param.data)
        self.param.untyped_storage().resize_(0)
        self.state = ShardState.SHARDED

    def allocate(self) -> None:
        """Give the parameter its full storage back (contents undefined until filled)."""
        storage = self.param.untyped_storage()
        if storage.nbytes() != self.full_nbytes:
            storage.resize_(self.full_nbytes)

    def fill(self, rows: torch.Tensor, offset: int) -> None:
        """Allocate the full storage and copy this parameter's columns of gathered ``rows`` in."""
        self.allocate()
        spec = self.spec
        full = rows[:, offset : offset + spec.shard_numel].reshape(-1)[: spec.numel]
        with torch.no_grad():
            self.param.data.copy_(full.view(spec.shape))
        self.state = ShardState.UNSHARDED

    def offload_to_host(self, pin: bool, arena: HostArena | None = None) -> None:
        """Keep the shard in host memory (``offload_param``); gathers upload it on use.

        ``arena``: take the (pinned) host tensor from it, at its exact size; without one the
        shard gets a storage of its own (what NVMe swapping needs).
        """
        if self.shard.device.type == "cpu":
            return
        pinned = pin and torch.cuda.is_available()
        if arena is not None:
            host = arena.empty(self.shard.shape, self.shard.dtype)
        else:
            host = torch.empty(self.shard.shape, dtype=self.shard.dtype, pin_memory=pinned)
        host.copy_(self.shard)
        if self.master is not None and self.master.data_ptr() == self.shard.data_ptr():
            raise RuntimeError("offload the shards before attaching the optimizer")
        self.shard = host

    def refresh_shard(self) -> None:
        """Re-cut this rank's shard (and master) from the full data, after it was edited."""
        ensure_shards([self])
        self.secondary = None
        with torch.no_grad():
            self.shard.copy_(self.spec.shard_of(self.param.data, self.group.rank, self.shard.dtype))
            if self.master is not None and self.master.data_ptr() != self.shard.data_ptr():
                self.master.copy_(self.shard)
        release_shards([self], dirty=True)


def _by_store(members: Iterable[ShardedParameter]) -> dict[int, tuple[Any, list[torch.Tensor]]]:
    found: dict[int, tuple[Any, list[torch.Tensor]]] = {}
    for member in members:
        store = member.store
        if store is not None and member.shard in store:
            found.setdefault(id(store), (store, []))[1].append(member.shard)
    return found


def ensure_shards(members: Iterable[ShardedParameter]) -> None:
    """NVMe parameters: make the members' shards resident in host memory (else a no-op)."""
    for store, shards in _by_store(members).values():
        store.ensure(shards)


def release_shards(members: Iterable[ShardedParameter], dirty: bool) -> None:
    """NVMe parameters: done with the members' shards (``dirty``: they were written)."""
    for store, shards in _by_store(members).values():
        store.release(shards, dirty=dirty)


def prefetch_shards(members: Iterable[ShardedParameter]) -> None:
    """NVMe parameters: start reading the members' shards from disk (no waiting)."""
    for store, shards in _by_store(members).values():
        store.prefetch(shards)


class PendingGather:
    """An all-gather of several parameters' shards in flight (one collective)."""

    def __init__(self, members: list[ShardedParameter], async_op: bool) -> None:
        group = members[0].group
        # The parameter's dtype: a shard that is the fp32 master is cast here, into the send
        # buffer, so that half the bytes travel (see [Note: ZeRO-3 memory]).
        dtype = members[0].param.dtype
        self.members = members
        self.offsets: list[int] = []
        total = 0
        for member in members:
            self.offsets.append(total)
            total += member.spec.shard_numel
        # The gathered parameters live where the parameter does (the compute device); a shard
        # offloaded to the host (offload_param) is uploaded first, asynchronously if pinned;
        # one swapped to NVMe is read back first and released once the gather has it.
        device = members[0].param.device
        ensure_shards(members)
        send = (
            torch.cat([m.shard.to(device=device, dtype=dtype, non_blocking=True) for m in members])
            if len(members) > 1
            else members[0].shard.to(device=device, dtype=dtype, non_blocking=True)
        )
        self.uploaded: torch.cuda.Event | None = None
        if send.device.type == "cuda" and members[0].shard.device.type == "cpu":
            self.uploaded = torch.cuda.Event()
            self.uploaded.record()
        self.total = total
        self.world = group.world_size
        # One parameter without padding: gathered straight into its own storage (no receive
        # buffer, no copy). Otherwise into ``[world, total]`` and copied out in wait().
        only = members[0]
        self.in_place = (
            len(members) == 1
            and only.spec.padded_numel == only.spec.numel
            and only.param.device == send.device
        )
        if self.in_place:
            only.allocate()
            self.out = only.param.data.view(-1)
        else:
            self.out = torch.empty(self.world * total, dtype=dtype, device=send.device)
        self.work: dist.Work | None = group.all_gather_into(self.out, send, async_op=async_op)
        for member in members:
            member.pending = self
        self.done = False

    def wait(self) -> None:
        """Finish the collective and copy each parameter's full value into its storage."""
        if self.done:
            return
        if self.work is not None:
            self.work.wait()
        if self.uploaded is not None:
            self.uploaded.synchronize()  # the host shards were read by the upload
            self.uploaded = None
        release_shards(self.members, dirty=False)
        if self.in_place:
            self.members[0].state = ShardState.UNSHARDED
            self.members[0].pending = None
        else:
            rows = self.out.view(self.world, self.total)
            for member in self.members:
                member.allocate()
            copy_out(rows, [m.param for m in self.members], [m.spec for m in self.members])
            for member in self.members:
                member.state = ShardState.UNSHARDED
                member.pending = None
        self.done = True
        del self.out


def gather_full(members: list[ShardedParameter], async_op: bool = False) -> list[PendingGather]:
    """Start gathering every SHARDED member not already in flight; one collective per
    process group and parameter dtype."""
    need = [m for m in members if m.state is ShardState.SHARDED and m.pending is None]
    # One collective per (process group, dtype): expert parameters shard over their
    # expert-data-parallel group, dense ones over the data-parallel group.
    by_key: dict[tuple[int, torch.dtype], list[ShardedParameter]] = {}
    for member in need:
        by_key.setdefault((id(member.group.group), member.param.dtype), []).append(member)
    if need and getattr(need[0].group, "hpz_size", 1) > 1:
        from slipstream.zero.zeropp import hpz_gathers

        return hpz_gathers(list(by_key.values()), async_op)
    return [PendingGather(group, async_op) for group in by_key.values()]
