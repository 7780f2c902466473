"""Tensor parallelism: TP-region collectives, column/row/vocab-parallel layers, vocab-parallel
cross-entropy, sequence-parallel variants, and AutoTP sharding of Hugging Face decoders.

Groups come from :class:`slipstream.comm.topology.ProcessGrid` (``grid.group("tensor")``);
passing None everywhere means no tensor parallelism. See docs/tensor-parallel.md.

>>> grid = ProcessGrid(PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=1))  # doctest: +SKIP
>>> up = ColumnParallelLinear(64, 256, group=grid.group("tensor"))  # doctest: +SKIP
>>> down = RowParallelLinear(256, 64, group=grid.group("tensor"))  # doctest: +SKIP
>>> y = down(torch.relu(up(x)))   # equals the unsplit MLP  # doctest: +SKIP
"""

from __future__ import annotations

from slipstream.comm.tensor_parallel.autotp import (
    SUPPORTED_MODEL_TYPES,
    shard_hf_decoder_for_training,
)
from slipstream.comm.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from slipstream.comm.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_tensor_parallel_state_dict,
    mark_sequence_parallel,
    reduce_sequence_parallel_gradients,
    set_tensor_parallel_attributes,
)
from slipstream.comm.tensor_parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_flat_from_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
    split_flat_to_tensor_parallel_region,
    tensor_parallel_rank,
    tensor_parallel_world_size,
)

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_to_tensor_parallel_region",
    "gather_flat_from_tensor_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_parallel_region",
    "gather_tensor_parallel_state_dict",
    "mark_sequence_parallel",
    "reduce_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "reduce_sequence_parallel_gradients",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_parallel_region",
    "set_tensor_parallel_attributes",
    "shard_hf_decoder_for_training",
    "split_flat_to_tensor_parallel_region",
    "tensor_parallel_rank",
    "tensor_parallel_world_size",
    "vocab_parallel_cross_entropy",
]
