"""ZeRO++ (quantized weight all-gather, quantized gradient reduce-scatter) and MiCS for stage 3.

Stage 3 talks to the other ranks only through its :class:`~slipstream.zero.DataParallelGroup`
(``all_gather_into`` for parameters, ``reduce_scatter_into`` for gradients, ``sum_``/``max_``
for norms and overflow flags, ``broadcast_`` for initial values). :class:`ZeroPlusPlusGroup`
is that group with the ZeRO++/MiCS collectives behind the same calls, so stage 3's gather and
reduce code is unchanged:

- **qwZ** (``zero_quantized_weights``): each rank quantizes its shard to int8 in blocks of
  :data:`BLOCK_SIZE` (one fp32 scale per block, ``slipstream.kernels.ops.quantize``), the
  codes and scales are all-gathered, and every rank dequantizes into the full parameter.
  Bytes on the wire: 1 + 4/256 per element instead of 2 (bf16) or 4 (fp32).
- **qgZ** (``zero_quantized_gradients``): the reduce-scatter becomes an all-to-all of int8
  blocks (each rank quantizes the piece of its gradient bucket that every other rank owns),
  followed by a local fp32 dequantize-and-sum of the pieces received. With
  ``zero_quantized_gradients_bits`` 4 the codes are int4, two per byte (as DeepSpeed's qgZ
  sends): half the bytes of int8, an error bound of ``|block max| / 14`` instead of ``/ 254``.
- **hpZ** (``zero_hpz_partition_size``): after a parameter's first full gather, each rank
  keeps a *secondary* shard, its ``1/hpz`` slice of the full value within its group of
  ``hpz`` adjacent ranks (a node); later gathers (backward, a module's second call) all-gather
  those secondaries inside the node instead of the primary shards across the world. The
  secondaries are dropped whenever the values change (after each optimizer step, a
  checkpoint load, an edit under ``GatheredParameters``), so the next gather is a primary one.
  With qgZ too, the gradient all-to-all is hierarchical: int8 inside the node, then int8
  across nodes on ``1/hpz`` of the bytes.
- **MiCS** (``mics_shard_size``): parameters, gradients and optimizer states are sharded over
  groups of ``mics_shard_size`` adjacent ranks and replicated across those groups; all-gathers
  stay inside a group, and gradients are reduce-scattered inside it and then all-reduced
  (averaged) across the replicas. ``mics_hierarchical_params_gather`` gathers in two hops
  when a shard group spans nodes: across the nodes among the ranks of one local index, then
  inside the node (only ``1/node_size`` of the flat gather's bytes cross nodes).

[Note: full-precision gathers] qwZ quantizes the gathers that feed forward and backward;
:class:`~slipstream.zero.GatheredParameters` (reading or saving weights) gathers exactly, in
:func:`full_precision_gathers`, so checkpoints and exported weights carry no int8 error.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.zero.group import DataParallelGroup

__all__ = [
    "BLOCK_SIZE",
    "ZeroPlusPlusGroup",
    "build_zero_group",
    "full_precision_gathers",
    "hpz_gathers",
]

# Elements per quantization block (one fp32 scale each): 1/64 overhead in bytes on int8.
BLOCK_SIZE = 256
# qgZ's code widths (zero_quantized_gradients_bits) and the kernels' format names.
_FORMATS = {8: "int8", 4: "int4"}

_state = threading.local()


@contextmanager
def full_precision_gathers() -> Iterator[None]:
    """Inside this block, qwZ groups gather parameters exactly (see [Note: full-precision
    gathers])."""
    _state.exact = getattr(_state, "exact", 0) + 1
    try:
        yield
    finally:
        _state.exact -= 1


def _exact() -> bool:
    return getattr(_state, "exact", 0) > 0


class _Deferred:
    """A collective in flight whose result needs a finishing step (dequantize, a second
    reduction) once it lands; ``wait()`` runs it once, as stage 3 expects of a Work."""

    def __init__(self, works: list[Any], finish: Callable[[], None]) -> None:
        self._works = works
        self._finish: Callable[[], None] | None = finish

    def wait(self) -> bool:
        for work in self._works:
            if work is not None:
                work.wait()
        self._works = []
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True


def _quantize_rows(rows: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Codes ``[rows, blocks, block * bits / 8]`` (int8, or uint8 holding two int4 codes) and
    scales ``[rows, blocks]`` of a 2-D tensor, each row padded to whole blocks (so no block
    spans two rows); also the padded width.

    ``block`` is :data:`BLOCK_SIZE`, or the row width when a row is shorter (a shard of a
    small parameter is not padded to 256 codes; int4 rounds it up to an even width)."""
    from slipstream.kernels.ops.quantize import quantize

    count, width = rows.shape
    block = min(BLOCK_SIZE, width)
    if bits == 4:
        block += block % 2  # two codes per byte
    padded = -(-width // block) * block
    if padded != width:
        rows = torch.nn.functional.pad(rows, (0, padded - width))
    q = quantize(rows, _FORMATS[bits], block)
    blocks = padded // block
    return q.data.view(count, blocks, -1), q.scales.view(count, blocks), padded


def _dequantize_rows(
    codes: torch.Tensor, scales: torch.Tensor, width: int, dtype: torch.dtype, bits: int = 8
) -> torch.Tensor:
    """Inverse of :func:`_quantize_rows`: ``[rows, width]`` in ``dtype``."""
    from slipstream.kernels.ops.quantize import QuantizedTensor, dequantize

    count, blocks, stored = codes.shape
    block = stored * 8 // bits
    q = QuantizedTensor(
        codes.reshape(count * blocks, stored),
        scales.reshape(-1),
        _FORMATS[bits],
        block,
        torch.Size([count, blocks * block]),
        dtype,
    )
    return dequantize(q)[:, :width]


@dataclasses.dataclass(frozen=True, slots=True)
class ZeroPlusPlusGroup(DataParallelGroup):
    """The group stage 3 shards over, with ZeRO++ and MiCS collectives (see the module doc).

    ``group``/``world_size``/``rank`` describe the *shard* group (with MiCS, one group of
    ``mics_shard_size`` ranks; otherwise the data-parallel group). ``replica_group`` (MiCS)
    joins the ranks that hold the same shard in the ``replicas`` groups.
    """

    quantize_weights: bool = False
    quantize_gradients: bool = False
    replica_group: dist.ProcessGroup | None = None
    replicas: int = 1
    hpz_group: dist.ProcessGroup | None = None
    hpz_size: int = 1
    hpz_rank: int = 0
    cross_group: dist.ProcessGroup | None = None  # hpZ: same local index on every node
    gradient_bits: int = 8  # qgZ: int8 or int4 (two codes per byte) all-to-alls
    # MiCS hierarchical gather (mics_hierarchical_params_gather): the shard group's ranks on
    # this node (node_size of them) and those with this rank's local index on the other nodes.
    node_group: dist.ProcessGroup | None = None
    node_size: int = 1
    across_group: dist.ProcessGroup | None = None

    # ------------------------------------------------------------------ parameters
    def all_gather_into(
        self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = False
    ) -> Any:
        """All-gather ``shard`` into ``output``: int8 blocks with qwZ, else as is."""
        if self.across_group is not None:
            return self._hierarchical_gather(output, shard, async_op)
        if (
            not self.quantize_weights
            or self.world_size == 1
            or _exact()
            or not shard.is_floating_point()
        ):
            return DataParallelGroup.all_gather_into(self, output, shard, async_op)
        world, numel = self.world_size, shard.numel()
        codes, scales, _ = _quantize_rows(shard.reshape(1, -1))
        all_codes = torch.empty((world, *codes.shape[1:]), dtype=codes.dtype, device=codes.device)
        all_scales = torch.empty((world, scales.shape[1]), dtype=scales.dtype, device=codes.device)
        works = [
            comm.all_gather_into_tensor(all_codes, codes, group=self.group, async_op=async_op),
            comm.all_gather_into_tensor(all_scales, scales, group=self.group, async_op=async_op),
        ]

        def finish() -> None:
            values = _dequantize_rows(all_codes, all_scales, numel, output.dtype)
            with torch.no_grad():
                output.view(world, numel).copy_(values)

        deferred = _Deferred(works, finish)
        if async_op:
            return deferred
        deferred.wait()
        return None

    def _hierarchical_gather(
        self, output: torch.Tensor, shard: torch.Tensor, async_op: bool
    ) -> Any:
        """MiCS's two-hop gather: shard rank ``a*h + j`` (node ``a``, local index ``j``) first
        gathers the shards of local index ``j`` across the nodes (the only hop that leaves the
        node: ``1/h`` of a flat gather's cross-node bytes), then the node gathers those
        bundles; the rows are reordered into shard-rank order. Exact (no rounding)."""
        size, numel = self.node_size, shard.numel()
        nodes = self.world_size // size
        across = torch.empty(nodes * numel, dtype=shard.dtype, device=shard.device)
        work = comm.all_gather_into_tensor(
            across,
            shard.reshape(-1),
            group=self.across_group,
            async_op=async_op,
            log_name="mics_gather_across_nodes",
        )

        def finish() -> None:
            bundles = torch.empty(size * nodes * numel, dtype=shard.dtype, device=shard.device)
            comm.all_gather_into_tensor(
                bundles, across, group=self.node_group, log_name="mics_gather_in_node"
            )
            # bundles[j][a] is shard rank a*h + j's shard.
            rows = bundles.view(size, nodes, numel).transpose(0, 1).reshape(-1)
            with torch.no_grad():
                output.view(-1).copy_(rows)

        deferred = _Deferred([work], finish)
        if async_op:
            return deferred
        deferred.wait()
        return None

    # ------------------------------------------------------------------ gradients
    def reduce_scatter_into(
        self,
        output: torch.Tensor,
        full: torch.Tensor,
        async_op: bool = False,
        *,
        average: bool = False,
    ) -> Any:
        """Sum ``full`` over the shard group (int8 all-to-all with qgZ) into this rank's
        ``output``; with MiCS, then average it across the replicas. (``average``, the
        in-collective mean of the plain group, is not offered here.)"""
        if average:
            raise ValueError(
                "a ZeRO++/MiCS group sums its reduce-scatter; average after it instead "
                "(average_in_reduce_scatter is for the plain data-parallel group)"
            )
        if self.quantize_gradients and self.world_size > 1:
            work = self._quantized_reduce_scatter(output, full, async_op)
        else:
            work = DataParallelGroup.reduce_scatter_into(self, output, full, async_op)
        if self.replicas == 1:
            return work
        deferred = _Deferred([work], lambda: self._average_replicas(output))
        if async_op:
            return deferred
        deferred.wait()
        return None

    def _quantized_reduce_scatter(
        self, output: torch.Tensor, full: torch.Tensor, async_op: bool
    ) -> Any:
        if self.hpz_size > 1 and self.cross_group is not None:
            return self._hierarchical_reduce_scatter(output, full, async_op)
        world, numel, bits = self.world_size, output.numel(), self.gradient_bits
        # Row r is the piece rank r owns; each is quantized in its own blocks and sent to r.
        codes, scales, _ = _quantize_rows(full.reshape(world, numel), bits)
        got_codes, got_scales = torch.empty_like(codes), torch.empty_like(scales)
        works = [
            comm.all_to_all_single(got_codes, codes, group=self.group, async_op=async_op),
            comm.all_to_all_single(got_scales, scales, group=self.group, async_op=async_op),
        ]

        def finish() -> None:
            # The sum of every rank's piece, in fp32 whatever the bucket's dtype.
            pieces = _dequantize_rows(got_codes, got_scales, numel, torch.float32, bits)
            output.copy_(pieces.sum(dim=0))

        deferred = _Deferred(works, finish)
        if async_op:
            return deferred
        deferred.wait()
        return None

    def _hierarchical_reduce_scatter(
        self, output: torch.Tensor, full: torch.Tensor, async_op: bool
    ) -> Any:
        """qgZ with hpZ nodes: int8 all-to-all inside the node, then across nodes.

        Rank ``a*h + j`` (node ``a``, local index ``j``) owns row ``a*h + j`` of the bucket.
        Hop 1 sends each node peer ``j'`` the rows its local index owns on every node and sums
        what arrives: ``[N/h, n]`` node partial sums. Hop 2 sends row ``a`` of those to node
        ``a``'s rank of the same local index and sums: this rank's piece. Only ``1/h`` of the
        int8 bytes cross nodes (the second hop).
        """
        world, numel, size = self.world_size, output.numel(), self.hpz_size
        bits = self.gradient_bits
        nodes = world // size
        by_peer = full.reshape(nodes, size, numel).transpose(0, 1).reshape(world, numel)
        codes, scales, _ = _quantize_rows(by_peer, bits)
        got_codes, got_scales = torch.empty_like(codes), torch.empty_like(scales)
        works = [
            comm.all_to_all_single(got_codes, codes, group=self.hpz_group, async_op=async_op),
            comm.all_to_all_single(got_scales, scales, group=self.hpz_group, async_op=async_op),
        ]

        def finish() -> None:
            pieces = _dequantize_rows(got_codes, got_scales, numel, torch.float32, bits)
            node_sums = pieces.view(size, nodes, numel).sum(dim=0)
            codes2, scales2, _ = _quantize_rows(node_sums, bits)
            got2, got_scales2 = torch.empty_like(codes2), torch.empty_like(scales2)
            comm.all_to_all_single(got2, codes2, group=self.cross_group)
            comm.all_to_all_single(got_scales2, scales2, group=self.cross_group)
            sums = _dequantize_rows(got2, got_scales2, numel, torch.float32, bits)
            output.copy_(sums.sum(dim=0))

        deferred = _Deferred(works, finish)
        if async_op:
            return deferred
        deferred.wait()
        return None

    def _average_replicas(self, output: torch.Tensor) -> None:
        comm.all_reduce(output, group=self.replica_group)
        # Stage 3 divides by the shard group's size; the replicas' share is divided here.
        output.div_(self.replicas)

    # ------------------------------------------------------------------ initial values
    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Broadcast from shard-group rank ``src`` of the first replica to every replica."""
        if self.replicas == 1:
            return DataParallelGroup.broadcast_(self, tensor, src)
        comm.broadcast(tensor, src=src)  # the first shard group holds global ranks 0..m-1
        return tensor


class _SecondaryGather:
    """hpZ: an all-gather of the members' secondary shards within the node group."""

    def __init__(self, members: list[Any], async_op: bool) -> None:
        from slipstream.zero.layout import ShardSpec

        group: ZeroPlusPlusGroup = members[0].group
        self.members = members
        self.size = group.hpz_size
        self.specs = [ShardSpec(m.param.shape, self.size) for m in members]
        send = torch.cat([m.secondary.reshape(-1) for m in members])
        self.total = send.numel()
        self.out = torch.empty(self.size * self.total, dtype=send.dtype, device=send.device)
        self.work = comm.all_gather_into_tensor(
            self.out, send, group=group.hpz_group, async_op=async_op
        )
        for member in members:
            member.pending = self
        self.done = False

    def wait(self) -> None:
        """Finish the collective and copy each parameter's full value into its storage."""
        from slipstream.zero.stage3.state import ShardState

        if self.done:
            return
        if self.work is not None:
            self.work.wait()
        rows = self.out.view(self.size, self.total)
        offset = 0
        for member, spec in zip(self.members, self.specs):
            member.allocate()
            full = rows[:, offset : offset + spec.shard_numel].reshape(-1)[: spec.numel]
            with torch.no_grad():
                member.param.data.copy_(full.view(spec.shape))
            member.state = ShardState.UNSHARDED
            member.pending = None
            offset += spec.shard_numel
        self.done = True
        del self.out


class _PrimaryGather:
    """hpZ: the ordinary (primary) gather, which keeps each member's secondary shard once the
    full value is in."""

    def __init__(self, pending: Any) -> None:
        self.pending = pending
        self.members = pending.members
        for member in self.members:
            member.pending = self

    def wait(self) -> None:
        """Finish the primary gather, then cut the secondaries from the full values."""
        from slipstream.zero.layout import ShardSpec

        if self.pending is None:
            return
        for member in self.members:
            member.pending = self.pending
        self.pending.wait()
        self.pending = None
        for member in self.members:
            group = member.group
            spec = ShardSpec(member.param.shape, group.hpz_size)
            member.secondary = spec.shard_of(member.param.data, group.hpz_rank)


def hpz_gathers(by_dtype: list[list[Any]], async_op: bool) -> list[Any]:
    """Stage 3's gathers under hpZ: within the node from secondaries where every member has
    one, else primary gathers that keep secondaries (one collective per dtype group)."""
    from slipstream.zero.stage3.sharded_param import PendingGather

    if _exact():  # GatheredParameters: the primary shards, exactly (no secondaries kept)
        return [PendingGather(members, async_op) for members in by_dtype]
    out: list[Any] = []
    for members in by_dtype:
        if all(m.secondary is not None for m in members):
            out.append(_SecondaryGather(members, async_op))
        else:
            out.append(_PrimaryGather(PendingGather(members, async_op)))
    return out


def build_zero_group(
    group: dist.ProcessGroup | None = None,
    *,
    quantize_weights: bool = False,
    quantize_gradients: bool = False,
    mics_shard_size: int = -1,
    hpz_partition_size: int = 1,
    gradient_bits: int = 8,
    hierarchical_gather: bool = False,
    node_size: int = 1,
) -> DataParallelGroup:
    """The group stage 3 should shard over for these ZeRO++/MiCS settings.

    A plain :class:`DataParallelGroup` when every setting is off. ``mics_shard_size`` > 0
    splits the world into groups of that many adjacent ranks (it must divide the world size
    and ``group`` must be the default group); creating them is collective: every rank calls
    this with the same arguments.
    """
    if gradient_bits not in _FORMATS:
        raise ValueError(
            f"zero_quantized_gradients_bits={gradient_bits}: qgZ sends int8 or int4 codes; "
            "use 8 or 4"
        )
    base = DataParallelGroup.of(group)
    if hierarchical_gather and mics_shard_size <= 0:
        raise ValueError(
            "mics_hierarchical_params_gather needs mics_shard_size: it is MiCS's two-hop "
            "parameter gather; set mics_shard_size or drop it"
        )
    if hierarchical_gather and quantize_weights:
        raise ValueError(
            "mics_hierarchical_params_gather with zero_quantized_weights: the two-hop gather "
            "of int8 blocks is not implemented; choose one of them"
        )
    # A shard group of the whole world is plain ZeRO-3, unless it gathers in two hops.
    mics = mics_shard_size > 0 and (mics_shard_size != base.world_size or hierarchical_gather)
    hpz = hpz_partition_size > 1 and base.world_size > hpz_partition_size
    if not (quantize_weights or quantize_gradients or mics or hpz):
        return base
    if mics and hpz:
        raise ValueError(
            f"zero_hpz_partition_size={hpz_partition_size} and mics_shard_size="
            f"{mics_shard_size} both set: hpZ and MiCS are two ways to keep gathers inside a "
            "node; choose one"
        )
    if hpz:
        if group is not None:
            raise ValueError(
                f"zero_hpz_partition_size={hpz_partition_size} needs the default process group "
                "as the data-parallel group (an mpu's was given); drop the mpu or hpZ"
            )
        if base.world_size % hpz_partition_size:
            raise ValueError(
                f"zero_hpz_partition_size={hpz_partition_size} does not divide the "
                f"data-parallel world size {base.world_size}; use the number of GPUs per node"
            )
        node_group = cross_group = None
        for start in range(0, base.world_size, hpz_partition_size):
            ranks = list(range(start, start + hpz_partition_size))
            made = dist.new_group(ranks)  # collective: every rank creates every group
            if base.rank in ranks:
                node_group = made
        for local in range(hpz_partition_size):
            ranks = list(range(local, base.world_size, hpz_partition_size))
            made = dist.new_group(ranks)
            if base.rank in ranks:
                cross_group = made
        return ZeroPlusPlusGroup(
            base.group,
            base.world_size,
            base.rank,
            quantize_weights=quantize_weights,
            quantize_gradients=quantize_gradients,
            gradient_bits=gradient_bits,
            hpz_group=node_group,
            hpz_size=hpz_partition_size,
            hpz_rank=base.rank % hpz_partition_size,
            cross_group=cross_group,
        )
    if not mics:
        return ZeroPlusPlusGroup(
            base.group,
            base.world_size,
            base.rank,
            quantize_weights=quantize_weights,
            quantize_gradients=quantize_gradients,
            gradient_bits=gradient_bits,
        )
    if group is not None:
        raise ValueError(
            f"mics_shard_size={mics_shard_size} needs the default process group as the "
            "data-parallel group (an mpu's data-parallel group was given); drop the mpu or "
            "mics_shard_size"
        )
    world = base.world_size
    if world % mics_shard_size:
        raise ValueError(
            f"mics_shard_size={mics_shard_size} does not divide the data-parallel world size "
            f"{world}; choose a divisor of it (e.g. the number of GPUs per node)"
        )
    replicas = world // mics_shard_size
    rank = base.rank
    node_group = across_group = None
    size = 1
    if hierarchical_gather:
        size = max(1, min(node_size, mics_shard_size))
        if mics_shard_size % size:
            raise ValueError(
                f"mics_hierarchical_params_gather: mics_shard_size={mics_shard_size} is not a "
                f"multiple of the {size} ranks per node; use whole nodes per shard group"
            )
        # Collective: every rank creates every group, in the same order.
        for start in range(0, world, size):
            ranks = list(range(start, start + size))
            made = dist.new_group(ranks)
            if rank in ranks:
                node_group = made
        for first in range(0, world, mics_shard_size):
            for local in range(size):
                ranks = list(range(first + local, first + mics_shard_size, size))
                made = dist.new_group(ranks)
                if rank in ranks:
                    across_group = made
    shard_group = replica_group = None
    # new_group is collective: every rank creates every group, in the same order.
    for index in range(replicas):
        ranks = list(range(index * mics_shard_size, (index + 1) * mics_shard_size))
        made = dist.new_group(ranks)
        if rank in ranks:
            shard_group = made
    for offset in range(mics_shard_size):
        ranks = list(range(offset, world, mics_shard_size))
        made = dist.new_group(ranks)
        if rank in ranks:
            replica_group = made
    return ZeroPlusPlusGroup(
        shard_group,
        mics_shard_size,
        rank % mics_shard_size,
        quantize_weights=quantize_weights,
        quantize_gradients=quantize_gradients,
        gradient_bits=gradient_bits,
        replica_group=replica_group,
        replicas=replicas,
        node_group=node_group,
        node_size=size,
        across_group=across_group,
    )
