"""The paged KV cache's bookkeeping: a pool of fixed-size blocks with reference counts, an LRU
queue of free blocks, and a content-hash index of full blocks for prefix caching."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Content hash of one full block: its tokens and, through ``parent``, every token before.

    Chaining the parent's hash makes equal blocks at different prefixes hash differently, so a
    hit on block ``i`` implies hits on blocks ``0 .. i - 1``. A 128-bit digest: a collision would
    silently attend to another prompt's keys, which Python's 64-bit ``hash`` makes too likely.
    """
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(b",".join(str(token).encode() for token in token_ids))
    return digest.digest()


class BlockPool:
    """Fixed-size KV blocks, numbered ``0 .. num_blocks - 1``, shared through reference counts.

    A block with reference count 0 sits in the free queue. With prefix caching, a freed block
    keeps its content hash and can be revived by a later request with the same prefix
    (:meth:`touch`) until it is handed out again (:meth:`allocate`), which evicts its hash.
    The queue is LRU: allocation takes the block freed longest ago; callers free a request's
    blocks tail first so the prompt's shared head stays cached longest.

    [Note: caching blocks before they are written] A block is registered under its hash when
    it is allocated for tokens scheduled in the current step, before the forward writes it. A
    second request reusing it in the same step is still correct: the model writes every token's
    keys/values of a layer before any attention of that layer reads them.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"BlockPool: num_blocks={num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict(
            (block, None) for block in range(num_blocks)
        )
        self._cached: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks that :meth:`allocate` can hand out now (free, cached or not)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request (0 to 1)."""
        return 1.0 - self.num_free / self.num_blocks

    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding content ``block_hash``, or None."""
        return self._cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: Iterable[int]) -> None:
        """Take one more reference to each block (reviving free cached ones)."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1

    def allocate(self, count: int) -> list[int]:
        """Hand out ``count`` blocks with reference count 1; evict their old hashes."""
        if count > len(self._free):
            raise RuntimeError(
                f"BlockPool: asked for {count} blocks with {len(self._free)} free; check "
                "num_free first (the scheduler preempts or queues instead)"
            )
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            old = self.block_hash[block]
            if old is not None:
                if self._cached.get(old) == block:
                    del self._cached[old]
                self.block_hash[block] = None
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block, in order; blocks reaching 0 join the free queue."""
        for block in blocks:
            if self.ref_counts[block] <= 0:
                raise RuntimeError(f"BlockPool: block {block} freed more often than taken")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None

    def register(self, block: int, block_hash: bytes) -> None:
        """Index full ``block`` under ``block_hash`` (keeps an existing block with that hash)."""
        if not self.enable_caching or self.block_hash[block] is not None:
            return
        if block_hash not in self._cached:
            self._cached[block_hash] = block
            self.block_hash[block] = block_hash

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after the weights changed)."""
        self._cached.clear()
        self.block_hash = [None] * self.num_blocks
