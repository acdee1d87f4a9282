"""Per-sequence block tables over the BlockPool, with prefix caching.

The scheduler asks three things: which leading blocks of a new request are
already cached (get_computed_blocks), room for the next tokens of a request
(allocate_slots, None when the pool is short: the scheduler then preempts),
and to release a request's blocks (free). No tensors here.
"""

from shared.engine.request import Request
from shared.kv.block_hash import hash_block_chain
from shared.engine.block_pool import BlockPool, KVBlock


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        model_fingerprint: str,
        enable_prefix_caching: bool = True,
        record_events: bool = False,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.model_fingerprint = model_fingerprint
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, record_events)
        self._blocks: dict[str, list[KVBlock]] = {}
        self._num_cached: dict[str, int] = {}
        """How many leading blocks of each request are entered in the prefix index."""
        self.num_queries = 0
        self.num_hit_tokens = 0
        self.num_query_tokens = 0

    # -- queries -------------------------------------------------------------

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def hash_chain(self, token_ids: list[int], cache_salt: str | None = None) -> list:
        """The chain hashes of the full blocks of token_ids, as this engine names them."""
        return hash_block_chain(token_ids, self.block_size, self.model_fingerprint, cache_salt)

    def update_block_hashes(self, request: Request) -> None:
        """Extend the request's chain hashes over its newly completed blocks."""
        known = len(request.block_hashes)
        if (request.num_tokens // self.block_size) > known:
            parent = request.block_hashes[-1] if known else None
            request.block_hashes += hash_block_chain(
                request.all_token_ids,
                self.block_size,
                self.model_fingerprint,
                request.cache_salt,
                start=known,
                parent=parent,
            )

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest run of leading blocks already cached, and its token count.
        At least the last token is always left to compute: the step needs its
        logits."""
        if not self.enable_prefix_caching:
            return [], 0
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        tokens = request.all_token_ids
        for i, block_hash in enumerate(request.block_hashes[:max_blocks]):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            block = self.pool.lookup(block_hash, chunk)
            if block is None:
                break
            hits.append(block)
        self.num_queries += 1
        self.num_query_tokens += request.num_tokens
        self.num_hit_tokens += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    # -- changes -------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVBlock] | None = None,
    ) -> list[KVBlock] | None:
        """Make room for ``num_new_tokens`` beyond the request's computed tokens
        (plus, at admission, the cached blocks it adopts). Returns the newly
        allocated blocks, or None, changing nothing, when the pool is short."""
        computed = new_computed_blocks or []
        held = self._blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed) * self.block_size
        needed = self.num_blocks_needed(num_computed + num_new_tokens) - len(held) - len(computed)
        # Cached blocks we adopt that sit in the free queue stop being free.
        num_free_adopted = sum(1 for b in computed if b.ref_cnt == 0)
        if needed > self.pool.num_free_blocks - num_free_adopted:
            return None
        self.pool.touch(computed)
        new_blocks = self.pool.allocate(max(needed, 0)) or []
        blocks = self._blocks.setdefault(request.request_id, [])
        blocks += computed
        blocks += new_blocks
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (see BlockPool.free)."""
        blocks = self._blocks.pop(request.request_id, [])
        self._num_cached.pop(request.request_id, None)
        self.pool.free(blocks[::-1])

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Index the blocks that are full once the step in flight computes
        ``num_tokens`` tokens. Their KV is written before any later step can
        read it, since steps run in order."""
        self.update_block_hashes(request)
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self._num_cached.get(request.request_id, 0)
        blocks = self._blocks[request.request_id]
        tokens = request.all_token_ids
        for i in range(start, num_full):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            self.pool.cache_block(blocks[i], request.block_hashes[i], chunk)
        self._num_cached[request.request_id] = max(start, num_full)
