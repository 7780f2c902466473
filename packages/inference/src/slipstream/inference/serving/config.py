"""The ``serving`` config block: KV-cache size and layout, token budget, batch limits."""

from __future__ import annotations

import dataclasses
from typing import Literal

from slipstream.kernels.config_schema import ConfigBlock, config_fail, key_path


@dataclasses.dataclass(kw_only=True)
class ServingConfig(ConfigBlock):
    """How a deployment batches requests and sizes its paged KV cache.

    Attributes:
        block_size: tokens per KV-cache block (a power of two >= 16 for the Triton kernel).
        num_blocks: KV-cache blocks; None sizes the cache from ``kv_cache_memory_fraction``
            of the free GPU memory after the weights are loaded (on the CPU, from
            ``cpu_kv_cache_bytes``).
        kv_cache_memory_fraction: share of the GPU's free memory given to the KV cache.
        cpu_kv_cache_bytes: KV-cache bytes on the CPU when ``num_blocks`` is None.
        max_num_batched_tokens: the token budget of one forward pass (Dynamic SplitFuse fills
            it with decodes first, then prompt chunks).
        max_num_seqs: most requests holding KV blocks at once.
        max_model_len: longest prompt + output; None takes the model's
            ``max_position_embeddings``.
        enable_prefix_caching: share the KV blocks of equal prompt prefixes across requests.
        dtype: weights and KV cache; "auto" keeps the model's dtype.
        tensor_parallel: ranks to shard the model over (AutoTP of ``init_inference``); the
            engine is built on every rank, rank 0 schedules and the others ``run_worker()``.
        cuda_graph: replay decode-only steps from CUDA graphs captured per batch-size bucket
            (1, 2, 4, 8, then every 16); steps with a prompt chunk run eagerly. Ignored on the
            CPU and for MoE models.
        cuda_graph_max_batch_size: the largest bucket; a decode step of more requests runs
            eagerly. Every bucket is captured when the engine starts.
        async_scheduling: launch step N+1 before step N's tokens reach the host, while every
            request of step N decodes on (no request waiting): step N+1's token ids are read
            on the device from step N's samples, so the GPU does not idle while the host
            samples, updates and plans. A request that stops at step N (end of sequence, stop
            string, cancellation) has one extra token computed and dropped.
    """

    block_size: int = dataclasses.field(default=16, metadata={"ge": 1})
    num_blocks: int | None = dataclasses.field(default=None, metadata={"ge": 1})
    kv_cache_memory_fraction: float = dataclasses.field(
        default=0.9, metadata={"gt": 0.0, "le": 1.0}
    )
    cpu_kv_cache_bytes: int = dataclasses.field(default=1 << 30, metadata={"ge": 1})
    max_num_batched_tokens: int = dataclasses.field(default=2048, metadata={"ge": 1})
    max_num_seqs: int = dataclasses.field(default=256, metadata={"ge": 1})
    max_model_len: int | None = dataclasses.field(default=None, metadata={"ge": 2})
    enable_prefix_caching: bool = True
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = dataclasses.field(
        default="auto",
        metadata={"allow_auto": True},  # "auto" means the model's own dtype
    )
    tensor_parallel: int = dataclasses.field(default=1, metadata={"ge": 1})
    cuda_graph: bool = True
    cuda_graph_max_batch_size: int = dataclasses.field(default=256, metadata={"ge": 1})
    async_scheduling: bool = True

    def validate(self, path: str) -> None:
        """Block size a power of two."""
        if self.block_size & (self.block_size - 1):
            config_fail(key_path(path, "block_size"), self.block_size, "a power of two")
