"""The block tables of one KV cache group, one manager class per kind of group.

A full-attention group keeps every block of a request; a sliding-window group
drops the blocks that left its window (their table entries become the pool's
null block), so a sliding layer holds at most about W / block_size blocks per
request, however long the request runs. Both enter their full blocks into the
pool's prefix index under (chain hash, group), so a later request can take
them back. No tensors here.
"""

from shared.engine.request import Request
from shared.kv.block_hash import BlockHash
from shared.kv.memory.block_pool import BlockPool, KVBlock
from shared.kv.spec import CompressedSpec, FullAttentionSpec, KVCacheSpec, SlidingWindowSpec


class SingleTypeKVManager:
    def __init__(self, group: int, spec: KVCacheSpec, pool: BlockPool, block_size: int, size_class: int = 0) -> None:
        self.group = group
        self.spec = spec
        self.pool = pool
        self.block_size = block_size
        self.size_class = size_class
        """The pool's size class this group's blocks come from (its page size's)."""
        self.tables: dict[str, list[KVBlock]] = {}
        self._num_indexed: dict[str, int] = {}
        """Leading blocks of each request already entered in the prefix index (or never to be)."""

    # -- queries -------------------------------------------------------------

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.tables.get(request_id, ())]

    def table(self, request_id: str) -> list[KVBlock]:
        return self.tables.get(request_id, [])

    def num_new_blocks(self, request_id: str, num_tokens: int, adopted: list[KVBlock]) -> int:
        """Blocks to allocate so the table covers num_tokens, after adopting `adopted`."""
        held = len(self.tables.get(request_id, ())) + len(adopted)
        return max(-(-num_tokens // self.block_size) - held, 0)

    def _lookup(self, block_hash: BlockHash, tokens: list[int], index: int) -> KVBlock | None:
        bs = self.block_size
        return self.pool.lookup(block_hash, self.group, tuple(tokens[index * bs : (index + 1) * bs]))

    # -- changes -------------------------------------------------------------

    def adopt(self, request_id: str, blocks: list[KVBlock], num_indexed: int) -> None:
        """Start (or extend) a table with cached blocks found by a lookup, or null
        entries; the first num_indexed blocks count as indexed already."""
        self.pool.touch(blocks)
        self.tables.setdefault(request_id, []).extend(blocks)
        self._num_indexed[request_id] = max(self._num_indexed.get(request_id, 0), num_indexed)

    def allocate(self, request_id: str, num_blocks: int) -> list[KVBlock]:
        """Append num_blocks fresh blocks (the caller checked the pool has them)."""
        new = self.pool.allocate(num_blocks, self.size_class) if num_blocks else []
        assert new is not None, "allocate() called without room in the pool"
        self.tables.setdefault(request_id, []).extend(new)
        return new

    def index_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Enter into the prefix index the blocks full once num_tokens are computed.
        Their KV is written before any later step reads it: steps run in order."""
        bs = self.block_size
        num_full = min(num_tokens, request.num_tokens) // bs
        start = self._num_indexed.get(request.request_id, 0)
        table = self.tables[request.request_id]
        tokens = request.all_token_ids
        for i in range(start, num_full):
            self.pool.cache_block(table[i], request.block_hashes[i], self.group, tuple(tokens[i * bs : (i + 1) * bs]))
        self._num_indexed[request.request_id] = max(start, num_full)

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first (see BlockPool.free)."""
        self._num_indexed.pop(request_id, None)
        self.pool.free(self.tables.pop(request_id, [])[::-1])

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks no later query can see (sliding windows only)."""

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Free the blocks past the first num_tokens tokens (rejected drafted tokens'
        slots). They were never indexed: only blocks full of known tokens are."""
        table = self.tables.get(request_id)
        if not table:
            return
        keep = -(-num_tokens // self.block_size)
        assert self._num_indexed.get(request_id, 0) <= keep, "an indexed block cannot be rolled back"
        if len(table) > keep:
            self.pool.free(table[keep:][::-1])
            del table[keep:]


class FullAttentionManager(SingleTypeKVManager):
    def find_hit(self, request: Request, max_blocks: int) -> list[KVBlock]:
        """The longest run of leading blocks of the request that the index holds."""
        hits: list[KVBlock] = []
        for i, block_hash in enumerate(request.block_hashes[:max_blocks]):
            block = self._lookup(block_hash, request.all_token_ids, i)
            if block is None:
                break
            hits.append(block)
        return hits


class SlidingWindowManager(SingleTypeKVManager):
    spec: SlidingWindowSpec

    def first_needed_block(self, num_tokens: int) -> int:
        """The first block a query at position num_tokens can see."""
        return max(num_tokens - self.spec.window + 1, 0) // self.block_size

    def find_hit_at(self, request: Request, num_blocks: int) -> list[KVBlock] | None:
        """The table that resumes the request after its first num_blocks blocks:
        null entries, then the cached blocks a query at that boundary sees; None
        when one of those is not cached."""
        first = self.first_needed_block(num_blocks * self.block_size)
        window: list[KVBlock] = []
        for i in range(first, num_blocks):
            block = self._lookup(request.block_hashes[i], request.all_token_ids, i)
            if block is None:
                return None
            window.append(block)
        return [self.pool.null_of(self.size_class)] * first + window

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        # Keep what a query at the start of the current block sees, not only at
        # num_computed_tokens: the window at the last block boundary is then
        # intact when the request ends (the state cache saves it), for one block more.
        boundary = max(num_computed_tokens - 1, 0) // self.block_size * self.block_size
        num_skipped = self.first_needed_block(boundary)
        table = self.tables.get(request_id)
        if not table:
            return
        null = self.pool.null_of(self.size_class)
        for i in range(min(num_skipped, len(table)) - 1, -1, -1):
            if table[i] is null:
                break  # everything before was dropped already
            self.pool.free([table[i]])
            table[i] = null


def make_manager(
    group: int, spec: KVCacheSpec, pool: BlockPool, block_size: int, size_class: int = 0
) -> SingleTypeKVManager:
    if isinstance(spec, CompressedSpec):
        if block_size % spec.compress_rate and spec.compress_rate % block_size:
            raise ValueError(
                f"block_size {block_size} and the compression rate {spec.compress_rate} must divide one another: "
                "a block holds the compressed entries whose windows end in it"
            )
        # Compressed entries are kept, named and persisted block by block like full attention's.
        return FullAttentionManager(group, spec, pool, block_size, size_class)
    if isinstance(spec, FullAttentionSpec):
        return FullAttentionManager(group, spec, pool, block_size, size_class)
    return SlidingWindowManager(group, spec, pool, block_size, size_class)
