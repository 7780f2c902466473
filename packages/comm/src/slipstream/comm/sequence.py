"""Ulysses sequence parallelism: all-to-all head/sequence re-partitioning around attention.

Each rank of a sequence-parallel (SP) group holds ``1/SP`` of every sequence. Attention needs
the whole sequence, so :class:`DistributedAttention` (DeepSpeed-Ulysses' interface) trades
the layout with one all-to-all per tensor: before the local attention every rank gets the
*whole* sequence for ``1/SP`` of the heads; after it, the output goes back to ``1/SP`` of the
sequence with every head. Everything outside attention (projections, MLP, norms, the loss)
runs on the local sequence slice unchanged.

[Note: gradients under sequence parallelism] No parameter lives inside the all-to-all, so
each rank's parameter gradients are those of its own tokens. With the loss of each rank
scaled as :func:`sequence_parallel_cross_entropy` does (local sum × SP / tokens in the SP
group), averaging gradients over the whole DP×SP world — what ZeRO and plain data
parallelism already do over the default group — gives exactly the gradient of the mean loss
over all tokens of the global batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from slipstream.comm.collectives import all_reduce, all_to_all_single
from slipstream.comm.topology import ProcessTopology

__all__ = [
    "DistributedAttention",
    "SequenceParallelGrid",
    "check_ulysses_heads",
    "seq_all_to_all",
    "sequence_parallel_cross_entropy",
    "shard_sequence",
]


def _group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


class _SeqAllToAll(torch.autograd.Function):
    """Split along ``scatter_idx`` over the group, concatenate what arrives along
    ``gather_idx``; its gradient is the same exchange with the two dimensions swapped."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        group: dist.ProcessGroup | None,
        tensor: torch.Tensor,
        scatter_idx: int,
        gather_idx: int,
    ) -> torch.Tensor:
        ctx.group, ctx.scatter_idx, ctx.gather_idx = group, scatter_idx, gather_idx
        return _all_to_all(tensor, scatter_idx, gather_idx, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return (
            None,
            _SeqAllToAll.apply(ctx.group, grad, ctx.gather_idx, ctx.scatter_idx),
            None,
            None,
        )


def _all_to_all(
    tensor: torch.Tensor, scatter_idx: int, gather_idx: int, group: dist.ProcessGroup | None
) -> torch.Tensor:
    size = _group_size(group)
    if size == 1:
        return tensor
    if tensor.shape[scatter_idx] % size:
        raise ValueError(
            f"sequence-parallel all-to-all: dimension {scatter_idx} of a tensor of shape "
            f"{tuple(tensor.shape)} ({tensor.shape[scatter_idx]}) does not divide by the "
            f"sequence-parallel size {size}; choose a head count (or sequence length) that "
            "is a multiple of sequence_parallel_size"
        )
    # One contiguous [size, chunk...] send buffer: chunk i goes to group rank i, and what
    # arrives from rank i is the i-th piece of the gathered dimension.
    send = torch.stack(tensor.tensor_split(size, dim=scatter_idx))
    received = torch.empty_like(send)
    all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_idx)


def seq_all_to_all(
    tensor: torch.Tensor,
    scatter_idx: int,
    gather_idx: int,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Autograd-aware all-to-all: ``tensor`` split along ``scatter_idx`` across ``group``,
    the pieces received concatenated (in group-rank order) along ``gather_idx``.

    With ``scatter_idx`` the head dimension and ``gather_idx`` the sequence dimension it turns
    a sequence shard with every head into the whole sequence for ``1/SP`` of the heads.
    """
    scatter_idx %= tensor.dim()
    gather_idx %= tensor.dim()
    if scatter_idx == gather_idx:
        raise ValueError(f"scatter_idx and gather_idx must differ, both are {scatter_idx}")
    return _SeqAllToAll.apply(group, tensor, scatter_idx, gather_idx)  # type: ignore[no-any-return]


def check_ulysses_heads(
    num_heads: int,
    num_kv_heads: int | None,
    sequence_parallel_size: int,
    tensor_parallel_size: int = 1,
) -> None:
    """Raise ``ValueError`` unless Ulysses can split these heads over SP (after TP took its share).

    Tensor parallelism leaves each rank ``num_heads / TP`` query heads and ``num_kv_heads / TP``
    key/value heads; Ulysses then splits those over the ``sequence_parallel_size`` ranks: the
    query heads must divide by SP, the key/value heads must divide by SP or divide SP (then
    they are replicated). Messages name the counts and the sizes.
    """
    sp, tp = sequence_parallel_size, tensor_parallel_size
    where = f" after tensor_parallel.autotp_size = {tp} took its share" if tp > 1 else ""
    if num_heads % tp:
        raise ValueError(
            f"{num_heads} attention heads do not divide by the tensor-parallel size {tp}"
        )
    local = num_heads // tp
    if local % sp:
        raise ValueError(
            f"Ulysses sequence parallelism splits each rank's {local} attention heads (of "
            f"{num_heads}{where}) over sequence_parallel_size = {sp} ranks, which does not "
            f"divide them; choose sizes with num_attention_heads divisible by "
            f"autotp_size × sequence_parallel_size ({tp} × {sp})"
        )
    if num_kv_heads is None:
        return
    if num_kv_heads % tp:
        raise ValueError(
            f"{num_kv_heads} key/value heads do not divide by the tensor-parallel size {tp}"
        )
    local_kv = num_kv_heads // tp
    if local_kv % sp and sp % local_kv:
        raise ValueError(
            f"each rank has {local_kv} key/value heads (of {num_kv_heads}{where}), which "
            f"neither divide by sequence_parallel_size = {sp} nor divide it; choose a "
            "sequence_parallel_size that is a multiple or a divisor of "
            "num_key_value_heads / autotp_size"
        )


class DistributedAttention(torch.nn.Module):
    """DeepSpeed-Ulysses attention: wraps a local attention with sequence↔head all-to-alls.

    Args:
        local_attention: a module or function ``(q, k, v, *args, **kwargs) -> context`` that
            attends over the whole sequence (it sees ``1/SP`` of the heads).
        sequence_process_group: the sequence-parallel group (None: the default group).
        scatter_idx: the head dimension of q/k/v (2 for Megatron's ``[s, b, h, d]``).
        gather_idx: the sequence dimension (0 for ``[s, b, h, d]``; 1 for ``[b, s, h, d]``).

    The context comes back in the input layout, sequence-sharded with every head. Heads must
    divide by the SP size. Grouped-query attention: key/value heads that divide by SP are
    split as they are; fewer key/value heads than SP ranks, where SP is a multiple of their
    count, are replicated first (each rank needs the key/value head of its query heads);
    anything else raises.

    >>> attn = DistributedAttention(local_attn, sp_group, scatter_idx=2, gather_idx=1)  # doctest: +SKIP
    >>> out = attn(q, k, v)  # [b, s/SP, h, d] each  # doctest: +SKIP
    """

    def __init__(
        self,
        local_attention: Any,
        sequence_process_group: dist.ProcessGroup | None,
        scatter_idx: int = 2,
        gather_idx: int = 0,
        sp_stream: Any = None,
    ) -> None:
        super().__init__()
        if sp_stream is not None:
            raise NotImplementedError(
                "DistributedAttention(sp_stream=...): overlapping the all-to-alls on a side "
                "stream is not implemented; leave sp_stream=None"
            )
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        batch_dim_idx: int | None = None,
        rotary_pos_emb: Any = None,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Attention over the whole sequence for sequence-sharded ``query``/``key``/``value``.

        ``batch_dim_idx`` (DeepSpeed's argument, 0 or 1) is checked but not needed: the
        exchange is layout-generic. Extra ``args``/``kwargs`` go to the local attention.
        """
        if batch_dim_idx is not None and batch_dim_idx in (
            self.scatter_idx % query.dim(),
            self.gather_idx % query.dim(),
        ):
            raise ValueError(
                f"batch_dim_idx={batch_dim_idx} is the head or sequence dimension "
                f"(scatter_idx={self.scatter_idx}, gather_idx={self.gather_idx})"
            )
        if rotary_pos_emb is not None:
            raise NotImplementedError(
                "DistributedAttention(rotary_pos_emb=...): apply rotary embeddings to q/k "
                "before this layer, with each rank's global positions (shard_sequence gives "
                "them)"
            )
        size = _group_size(self.spg)
        heads = query.shape[self.scatter_idx]
        if heads % size:
            raise ValueError(
                f"Ulysses sequence parallelism splits heads over the {size} ranks of the "
                f"sequence-parallel group, but the query has {heads} heads; use a "
                "sequence_parallel_size that divides the number of attention heads"
            )
        key = self._spread_kv(key, size, "key")
        value = self._spread_kv(value, size, "value")
        q = seq_all_to_all(query, self.scatter_idx, self.gather_idx, self.spg)
        k = seq_all_to_all(key, self.scatter_idx, self.gather_idx, self.spg)
        v = seq_all_to_all(value, self.scatter_idx, self.gather_idx, self.spg)
        context = self.local_attn(q, k, v, *args, **kwargs)
        return seq_all_to_all(context, self.gather_idx, self.scatter_idx, self.spg)

    def _spread_kv(self, tensor: torch.Tensor, size: int, name: str) -> torch.Tensor:
        heads = tensor.shape[self.scatter_idx]
        if heads % size == 0:
            return tensor
        if size % heads == 0:
            # Rank r holds query heads [r*h/SP, (r+1)*h/SP), all of key/value group r*kv/SP:
            # repeating each kv head SP/kv times gives rank r exactly that head.
            return tensor.repeat_interleave(size // heads, dim=self.scatter_idx)
        raise ValueError(
            f"the {name} has {heads} heads, which neither divide by the sequence-parallel "
            f"size {size} nor divide it; use a sequence_parallel_size that is a multiple or a "
            "divisor of the number of key/value heads"
        )


class SequenceParallelGrid:
    """The data × sequence (× tensor) layout of the world: SP groups, DP across them.

    Without tensor parallelism, ranks ``[k*SP, (k+1)*SP)`` form sequence-parallel group ``k``
    (adjacent, so one node keeps the all-to-alls local); ranks with the same SP index form the
    data-parallel groups. ZeRO and gradient averaging run over the whole world (DP×SP, see
    [Note: gradients under sequence parallelism]); the data loader shards over DP only.

    With ``tensor_parallel_size`` TP > 1 the axes are ``data × sequence × tensor``, tensor
    fastest: TP groups are adjacent ranks, SP groups are ranks ``TP`` apart, and ZeRO's group
    (:meth:`get_sequence_data_parallel_group`) is DP×SP at one tensor index — the same ranks
    as the data axis of AutoTP's ``PipeModelDataParallelTopology(1, TP, DP*SP)``, whose data
    coordinate is ``dp * SP + sp``. Every rank must build it (group creation is collective).

    >>> grid = SequenceParallelGrid(sequence_parallel_size=2)  # doctest: +SKIP
    >>> grid.sequence_parallel_rank, grid.data_parallel_world_size  # doctest: +SKIP
    """

    def __init__(self, sequence_parallel_size: int, tensor_parallel_size: int = 1) -> None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        sp, tp = sequence_parallel_size, tensor_parallel_size
        if sp < 1 or tp < 1 or world % (sp * tp):
            raise ValueError(
                f"sequence_parallel_size={sp} (× tensor-parallel size {tp}) must be a positive "
                f"divisor of the world size {world}"
            )
        self.topology = ProcessTopology(
            axes=["data", "sequence", "tensor"], dims=[world // (sp * tp), sp, tp]
        )
        rank = dist.get_rank() if dist.is_initialized() else 0
        coord = self.topology.get_coord(rank)
        self.sequence_parallel_world_size = sp
        self.sequence_parallel_rank = int(coord.sequence)
        self.tensor_parallel_world_size = tp
        self.data_parallel_world_size = world // (sp * tp)
        self.data_parallel_rank = int(coord.data)
        self.sequence_group: dist.ProcessGroup | None = None
        self.data_group: dist.ProcessGroup | None = None
        # DP×SP at this rank's tensor index (None: the whole world, when TP is 1).
        self.sequence_data_group: dist.ProcessGroup | None = None
        if world == 1:
            return
        for axis in ("sequence", "data"):
            for ranks in self.topology.get_axis_comm_lists(axis):
                made = dist.new_group(ranks)
                if rank in ranks:
                    setattr(self, f"{axis}_group", made)
        if tp > 1:
            for index in range(tp):
                ranks = self.topology.filter_match(tensor=index)
                made = dist.new_group(ranks)
                if rank in ranks:
                    self.sequence_data_group = made

    # DeepSpeed's mpu names for the sequence axis.
    def get_sequence_parallel_group(self) -> dist.ProcessGroup | None:
        """This rank's sequence-parallel group."""
        return self.sequence_group

    def get_sequence_parallel_world_size(self) -> int:
        """The sequence-parallel degree."""
        return self.sequence_parallel_world_size

    def get_sequence_parallel_rank(self) -> int:
        """This rank's index in its sequence-parallel group."""
        return self.sequence_parallel_rank

    def get_sequence_data_parallel_group(self) -> dist.ProcessGroup | None:
        """The group ZeRO shards over: DP×SP (the whole world when TP is 1: None)."""
        return self.sequence_data_group

    def get_data_parallel_world_size(self) -> int:
        """Number of data-parallel replicas (world / (SP × TP)): what the data loader shards over."""
        return self.data_parallel_world_size

    def get_data_parallel_rank(self) -> int:
        """This rank's data-parallel index (equal across its SP group)."""
        return self.data_parallel_rank


def shard_sequence(
    input_ids: torch.Tensor,
    labels: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    ignore_index: int = -100,
) -> dict[str, torch.Tensor]:
    """This SP rank's slice of a batch of ``[batch, seq]`` token ids, for a causal LM.

    Returns ``input_ids`` and ``position_ids`` (global positions, so rotary embeddings are
    those of the unsplit sequence) of the rank's contiguous ``seq/SP`` slice and, with
    ``labels``, ``shift_labels``: the labels shifted left by one over the *whole* sequence
    before slicing (the next-token target of a slice's last token lives on the next rank),
    ``ignore_index`` at the very end. Pass ``shift_labels`` to the loss, not ``labels``.
    """
    size = _group_size(group)
    rank = dist.get_rank(group) if size > 1 else 0
    seq = input_ids.shape[1]
    if seq % size:
        raise ValueError(
            f"sequence length {seq} does not divide by the sequence-parallel size {size}; "
            "pad or pack the sequences to a multiple of sequence_parallel_size"
        )
    local = seq // size
    window = slice(rank * local, (rank + 1) * local)
    positions = torch.arange(seq, device=input_ids.device).expand(input_ids.shape[0], seq)
    out = {"input_ids": input_ids[:, window], "position_ids": positions[:, window]}
    if labels is not None:
        shifted = torch.full_like(labels, ignore_index)
        shifted[:, :-1] = labels[:, 1:]
        out["shift_labels"] = shifted[:, window]
    return out


def sequence_parallel_cross_entropy(
    logits: torch.Tensor,
    shift_labels: torch.Tensor,
    group: dist.ProcessGroup | None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """The causal-LM loss of one SP rank's slice, scaled for exact averaging.

    Returns ``sum of this slice's token losses × SP / tokens counted in the SP group``: the
    mean of these values over the SP group is the mean token loss of the whole sequences, and
    averaging gradients over DP×SP (ZeRO, data parallelism) gives that mean's gradient (see
    [Note: gradients under sequence parallelism]). One all-reduce of a scalar count (no grad).
    """
    losses = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        shift_labels.reshape(-1).to(logits.device),
        ignore_index=ignore_index,
        reduction="sum",
    )
    count = (shift_labels != ignore_index).sum().to(device=logits.device, dtype=torch.float32)
    size = _group_size(group)
    if size > 1:
        all_reduce(count, group=group)
    return losses * size / count.clamp(min=1.0)
