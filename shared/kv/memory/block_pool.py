"""The pool of fixed-size KV blocks of one worker: reference counts, an LRU
queue of free blocks, and the prefix index ((block hash, KV group) -> block).

Every KV cache group draws from this one pool; the same chain hash names a
different block in each group (the groups hold different layers' KV), so the
index is keyed by both. Groups whose pages differ in size draw from different
*size classes* of the pool (shared/kv/spec.py): each class has its
own block ids 0 .. n - 1 (they index its own tensors), its own free queue and its own
null block (id n); the prefix index is shared. Classes may differ in n: a class whose
groups are all sliding-window ones needs only a window's blocks per request
(coordinator.blocks_per_class), a persistent group's class as many as tokens.

A freed block keeps its content and its place in the prefix index until it is
handed out again, so a later request with the same prefix can take it back
("a cache hit on a free block"). Blocks are handed out from the front of the
free queue, so the least recently freed cached block is evicted first.
No tensors here: block ids index the model runner's KV tensors.
"""

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from shared.kv.block_hash import BlockHash


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    group: int = 0
    """The KV group whose index entry this block is (meaningful with block_hash)."""
    size_class: int = 0
    """The size class whose tensors the id indexes (see BlockPool)."""
    token_ids: tuple[int, ...] | None = None
    """The tokens the block holds once full: compared on every hit, so a hash
    collision can never serve wrong KV."""


class BlockPool:
    def __init__(
        self,
        num_blocks: int | Sequence[int],
        record_events: bool = False,
        event_group: int = 0,
        num_size_classes: int = 1,
    ) -> None:
        """num_blocks: blocks of each size class, or per size class. event_group: the KV
        group whose index changes are recorded as events (a prefix is usable where that
        group's blocks are: the first persistent one)."""
        if num_size_classes < 1:
            raise ValueError(f"a pool needs at least one size class, got {num_size_classes}")
        counts = (num_blocks,) * num_size_classes if isinstance(num_blocks, int) else tuple(num_blocks)
        if len(counts) != num_size_classes:
            raise ValueError(f"{len(counts)} block counts for {num_size_classes} size classes")
        if min(counts) < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.blocks_per_class = counts
        self.num_blocks = max(counts)
        """The largest class's blocks (with one class, or classes alike, every class's)."""
        self.num_size_classes = num_size_classes
        self.blocks_of_class = [[KVBlock(i, size_class=c) for i in range(n)] for c, n in enumerate(counts)]
        self.blocks = self.blocks_of_class[0]
        self._nulls = [KVBlock(n, ref_cnt=1, size_class=c) for c, n in enumerate(counts)]
        """Per size class, a block no request owns and the free queue never holds (the
        class's tensors have one row more for it, id n): block tables point at it where a
        sliding window has dropped a block, and writes that must not land anywhere go to it."""
        self.null_block = self._nulls[0]
        """Size class 0's null block (every class's id, where the classes are alike)."""
        # OrderedDict gives O(1) append, pop-front and removal from the middle
        # (a hit on a free cached block), which a deque cannot.
        self._free_of_class = [OrderedDict((b.block_id, b) for b in blocks) for blocks in self.blocks_of_class]
        self._free = self._free_of_class[0]
        """Size class 0's free queue (the only one of a pool with one class)."""
        self._cached: dict[tuple[BlockHash, int], KVBlock] = {}
        self._record_events = record_events
        self._event_group = event_group
        self.stored_events: list[BlockHash] = []
        self.removed_events: list[BlockHash] = []
        """Hashes that entered / left the prefix index since the last drain_events()
        (a service publishes them for cache-aware routing)."""

    @property
    def num_free_blocks(self) -> int:
        """Free blocks of every size class."""
        return sum(len(free) for free in self._free_of_class)

    @property
    def num_total_blocks(self) -> int:
        """Blocks of every size class."""
        return sum(self.blocks_per_class)

    def null_of(self, size_class: int) -> KVBlock:
        """The null block of a size class."""
        return self._nulls[size_class]

    def is_null(self, block: KVBlock) -> bool:
        return block is self._nulls[block.size_class]

    def num_free(self, size_class: int) -> int:
        return len(self._free_of_class[size_class])

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        """The fullest size class's share in use (the one that stops admission first)."""
        return 1.0 - min(len(free) / n for free, n in zip(self._free_of_class, self.blocks_per_class))

    def lookup(self, block_hash: BlockHash, group: int, token_ids: tuple[int, ...]) -> KVBlock | None:
        block = self._cached.get((block_hash, group))
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def allocate(self, num_blocks: int, size_class: int = 0) -> list[KVBlock] | None:
        """Take blocks of a size class from the front of its free queue, evicting their
        cached content; None (and nothing taken) if there are not enough."""
        free = self._free_of_class[size_class]
        if num_blocks > len(free):
            return None
        out: list[KVBlock] = []
        for _ in range(num_blocks):
            _, block = free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cached blocks found by lookup() (the null block is skipped)."""
        for block in blocks:
            if self.is_null(block):
                continue
            if block.ref_cnt == 0:
                del self._free_of_class[block.size_class][block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop a reference; blocks that reach zero join the back of the free
        queue in the order given (callers pass a sequence's blocks tail first,
        so its tail is evicted before its shared head). The null block is skipped."""
        for block in blocks:
            if self.is_null(block):
                continue
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_of_class[block.size_class][block.block_id] = block

    def cache_block(self, block: KVBlock, block_hash: BlockHash, group: int, token_ids: tuple[int, ...]) -> None:
        """Enter a full block of a group into the prefix index. If another block
        already holds this content, the index keeps the first one (both stay valid)."""
        if block.block_hash is not None or self.is_null(block):
            return
        block.block_hash = block_hash
        block.group = group
        block.token_ids = token_ids
        if self._cached.setdefault((block_hash, group), block) is block and self._records(group):
            self.stored_events.append(block_hash)

    def _records(self, group: int) -> bool:
        return self._record_events and group == self._event_group

    def drain_events(self) -> tuple[list[BlockHash], list[BlockHash]]:
        stored, removed = self.stored_events, self.removed_events
        self.stored_events, self.removed_events = [], []
        return stored, removed

    def holds(self, block_hash: BlockHash) -> bool:
        """Whether the event group's prefix index holds the hash now (what its events say,
        net: a data-parallel instance joins its ranks' by it, shared/engine/dp_kv.py)."""
        return (block_hash, self._event_group) in self._cached

    def snapshot_events(self) -> list[BlockHash]:
        """Every hash of the event group in the prefix index now. The pending events are
        dropped: the snapshot already says all they would."""
        self.stored_events, self.removed_events = [], []
        return [block_hash for block_hash, group in self._cached if self._records(group)]

    def drop_cached(self) -> int:
        """Empty the prefix index (a prefix-cache reset); each hash dropped is a removed
        event. Blocks in use (a running request's, a lease's for a peer's copy) keep their
        content for their holders but leave the index: no new request hits them, as none
        would after a restart. Returns how many blocks the index held."""
        cached = list(self._cached.values())
        for block in cached:
            self._evict(block)
        return len(cached)

    def _evict(self, block: KVBlock) -> None:
        key = (block.block_hash, block.group)
        if block.block_hash is not None and self._cached.get(key) is block:  # type: ignore[arg-type]
            del self._cached[key]  # type: ignore[arg-type]
            if self._records(block.group):
                self.removed_events.append(block.block_hash)
        block.block_hash = None
        block.token_ids = None
