"""Block tables per request over a :class:`BlockPool`: prefix-cache lookup and slot allocation."""

from __future__ import annotations

from slipstream.inference.serving.block_pool import BlockPool, hash_block
from slipstream.inference.serving.request import Request


class KVCacheManager:
    """Maps each running request to the blocks holding its keys/values (its block table).

    Logical block ``i`` of a request holds its tokens ``i * block_size .. (i + 1) * block_size
    - 1``; the table names the physical block. Full blocks are indexed by content hash so that
    requests sharing a prompt prefix share its blocks (reference counted).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.block_tables: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}  # leading blocks already indexed by hash

    def _hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        hashes = request.block_hashes
        size = self.block_size
        while len(hashes) < num_full_blocks:
            index = len(hashes)
            tokens = request.token_ids[index * size : (index + 1) * size]
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens))
        return hashes[:num_full_blocks]

    def computed_blocks(self, request: Request) -> list[int]:
        """The longest run of cached blocks matching the start of ``request``'s tokens.

        At least one token is always left to compute, since its forward gives the logits of
        the next token: a fully cached prompt reuses all but its last block.
        """
        if not self.pool.enable_caching:
            return []
        hits = []
        for block_hash in self._hashes(request, (len(request.token_ids) - 1) // self.block_size):
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: list[int] | None = None
    ) -> bool:
        """Give ``request`` room for ``num_new_tokens`` after its computed tokens (and after
        ``computed``, prefix blocks found by :meth:`computed_blocks` for a newly admitted one).

        Returns False, changing nothing, when the pool lacks free blocks.
        """
        if not computed:
            # Fast path, a decode inside its last block: nothing to allocate or register.
            current = self.block_tables.get(request.request_id)
            total = request.num_computed_tokens + num_new_tokens
            if (
                current is not None
                and total <= len(current) * self.block_size
                and (
                    not self.pool.enable_caching
                    or total // self.block_size <= self._num_registered.get(request.request_id, 0)
                )
            ):
                return True
        computed = computed or []
        table = self.block_tables.setdefault(request.request_id, [])
        start = request.num_computed_tokens + len(computed) * self.block_size
        total = start + num_new_tokens
        needed = max(0, -(-total // self.block_size) - len(table) - len(computed))
        revived = sum(1 for block in computed if self.pool.ref_counts[block] == 0)
        if needed + revived > self.pool.num_free:
            if not table:
                del self.block_tables[request.request_id]
            return False
        self.pool.touch(computed)
        table += computed
        table += self.pool.allocate(needed)
        if self.pool.enable_caching:
            done = self._num_registered.get(request.request_id, 0)
            # Only blocks whose tokens are all known (asynchronous scheduling allocates a slot
            # for a token still being sampled).
            full = min(total, len(request.token_ids)) // self.block_size
            hashes = self._hashes(request, full)
            for index in range(done, full):
                self.pool.register(table[index], hashes[index])
            self._num_registered[request.request_id] = max(done, full)
        return True

    def free(self, request: Request) -> None:
        """Release ``request``'s blocks, tail first (see :class:`BlockPool`)."""
        table = self.block_tables.pop(request.request_id, [])
        self._num_registered.pop(request.request_id, None)
        self.pool.free(reversed(table))

    def block_table(self, request: Request) -> list[int]:
        """The physical blocks of ``request``, in logical order."""
        return self.block_tables.get(request.request_id, [])
