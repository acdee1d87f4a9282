"""The pool of fixed-size KV blocks of one worker: reference counts, an LRU
queue of free blocks, and the prefix index (block hash -> block).

A freed block keeps its content and its place in the prefix index until it is
handed out again, so a later request with the same prefix can take it back
("a cache hit on a free block"). Blocks are handed out from the front of the
free queue, so the least recently freed cached block is evicted first.
No tensors here: block ids index the model runner's KV tensors.
"""

from collections import OrderedDict
from dataclasses import dataclass

from shared.kv.block_hash import BlockHash


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None
    """The tokens the block holds once full: compared on every hit, so a hash
    collision can never serve wrong KV."""


class BlockPool:
    def __init__(self, num_blocks: int, record_events: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # OrderedDict gives O(1) append, pop-front and removal from the middle
        # (a hit on a free cached block), which a deque cannot.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}
        self._record_events = record_events
        self.stored_events: list[BlockHash] = []
        self.removed_events: list[BlockHash] = []
        """Hashes that entered / left the prefix index since the last drain_events()
        (a service publishes them for cache-aware routing)."""

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def lookup(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> KVBlock | None:
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def allocate(self, num_blocks: int) -> list[KVBlock] | None:
        """Take blocks from the front of the free queue, evicting their cached
        content; None (and nothing taken) if there are not enough."""
        if num_blocks > len(self._free):
            return None
        out: list[KVBlock] = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cached blocks found by lookup()."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop a reference; blocks that reach zero join the back of the free
        queue in the order given (callers pass a sequence's blocks tail first,
        so its tail is evicted before its shared head)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_block(self, block: KVBlock, block_hash: BlockHash, token_ids: tuple[int, ...]) -> None:
        """Enter a full block into the prefix index. If another block already
        holds this content, the index keeps the first one (both stay valid)."""
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        block.token_ids = token_ids
        if self._cached.setdefault(block_hash, block) is block and self._record_events:
            self.stored_events.append(block_hash)

    def drain_events(self) -> tuple[list[BlockHash], list[BlockHash]]:
        stored, removed = self.stored_events, self.removed_events
        self.stored_events, self.removed_events = [], []
        return stored, removed

    def evict_all_cached(self) -> int:
        """Forget every cached free block (e.g. after weights change)."""
        num = 0
        for block in self._free.values():
            if block.block_hash is not None:
                self._evict(block)
                num += 1
        return num

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None and self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
            if self._record_events:
                self.removed_events.append(block.block_hash)
        block.block_hash = None
        block.token_ids = None
