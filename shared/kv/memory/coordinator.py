"""The KV cache of one engine over its groups: one manager per group, one pool
(with a size class per page size, whose blocks a group of that page size takes).

The scheduler asks five things: the prefix hit of a new request
(find_prefix_hit), room for the next tokens of a request (allocate_slots,
False when the pool is short: the scheduler then preempts), the block tables
per group (block_ids), to release a request's blocks (free), and to give back
the slots of drafted tokens that verification rejected (rollback).

A prefix hit is found per group at the block granularity all groups share.
Full-attention groups give the longest run of cached leading blocks, H tokens.
Sliding-window groups then need the window a query at H sees; when it is not at
hand, the host state cache may hold it, and otherwise the engine *replays*:
it computes again from s = H - R, writing sliding-window KV only (SWA bounded
replay; see docs/architecture.md). A hit of H <= R is no hit. No tensors here.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from shared.engine.config import SWA_REPLAY_CHOICES
from shared.engine.request import Request
from shared.kv.block_hash import BlockHash, ImageSpan, hash_block_chain
from shared.kv.memory.block_pool import BlockPool, KVBlock
from shared.kv.memory.single_type import FullAttentionManager, SlidingWindowManager, make_manager
from shared.kv.memory.state_cache import SlidingState, SlidingStateCache
from shared.kv.spec import KVCacheLayout

SwaReplay = Literal["bounded", "exact"]


def blocks_per_class(
    layout: KVCacheLayout, num_blocks: int, block_size: int, max_num_seqs: int, max_step_tokens: int
) -> tuple[int, ...]:
    """Blocks of each size class of a pool whose persistent classes have num_blocks.

    A class whose groups are all sliding-window ones (with declared rows, a class per group:
    DeepSeek-V4's state caches) needs only what its requests hold at once. After a step
    schedules c tokens of a request, its table keeps the blocks a query at the last block
    boundary sees (SlidingWindowManager.remove_skipped_blocks) up to its last token: at
    most ceil((W - 1) / bs) + 1 + ceil(c / bs) blocks. Summed over max_num_seqs requests
    whose c add up to max_step_tokens: S * (ceil(W / bs) + 2) + ceil(T / bs). One step's
    tokens more covers requests left unscheduled in a step, which keep their last chunk's
    blocks until they run again; past that the class is short like any class (admission
    waits, the scheduler preempts). The window's freed blocks stay in the prefix index
    only until reused: with a class this small a later hit finds its window in the host
    state cache or replays it sooner. Capped at num_blocks (never more than the tokens)."""
    if layout.size_classes == (None,):
        return (num_blocks,)
    window = layout.max_window or 0
    step_blocks = -(-max_step_tokens // block_size)
    sliding = max_num_seqs * (-(-window // block_size) + 2) + 2 * step_blocks
    sliding_groups = set(layout.sliding_groups)
    counts = []
    for size_class in range(len(layout.size_classes)):
        groups = {g for g, c in enumerate(layout.size_class_of_group) if c == size_class}
        counts.append(min(num_blocks, sliding) if groups <= sliding_groups else num_blocks)
    return tuple(counts)


def blocks_in_budget(
    layout: KVCacheLayout, class_bytes: Sequence[int], budget_bytes: int, block_size: int, max_num_seqs: int,
    max_step_tokens: int,
) -> int:
    """The largest num_blocks (the persistent classes' blocks) whose pool (blocks_per_class)
    fits budget_bytes, a block of class c taking class_bytes[c]."""
    num_blocks = budget_bytes // sum(class_bytes)
    counts = blocks_per_class(layout, num_blocks, block_size, max_num_seqs, max_step_tokens)
    fixed = [c for c, n in enumerate(counts) if n < num_blocks]
    if not fixed:
        return num_blocks
    # The sliding classes' blocks no longer grow with num_blocks: the rest of the budget
    # goes to the other classes.
    rest = budget_bytes - sum(counts[c] * class_bytes[c] for c in fixed)
    return rest // sum(b for c, b in enumerate(class_bytes) if c not in fixed)


def blocks_for_one_request(layout: KVCacheLayout, num_tokens: int, block_size: int) -> int:
    """Blocks of one size class (the pool's num_blocks) that one request of num_tokens
    may need: every block of every group of the busiest class (an upper bound: a
    sliding group drops what leaves its window). One class: all groups together."""
    num_classes = len(layout.size_classes)
    return -(-num_tokens // block_size) * max(layout.groups_of_class(c) for c in range(num_classes))


@dataclass(slots=True)
class PrefixHit:
    tables: list[list[KVBlock]]
    """Per group, the blocks the request adopts: cached blocks and null entries."""
    num_tokens: int = 0
    """H: leading tokens served from the cache (block aligned)."""
    num_computed: int = 0
    """Where computing starts: H, or s < H when the sliding-window state is replayed."""
    state: SlidingState | None = None
    """A saved sliding-window state to load into the window blocks before the first step."""

    @property
    def is_replay(self) -> bool:
        return self.num_computed < self.num_tokens


@dataclass(slots=True)
class StateSave:
    """Sliding-window blocks of a request that just ended, to copy into the state cache
    before the next schedule can hand them out."""

    block_hash: BlockHash
    num_blocks: int
    first_block: int
    block_ids: dict[int, list[int]] = field(default_factory=dict)
    """Per sliding group: the ids of blocks first_block .. num_blocks - 1."""


class KVCacheCoordinator:
    def __init__(
        self,
        layout: KVCacheLayout,
        num_blocks: int | Sequence[int],
        block_size: int,
        model_fingerprint: str,
        enable_prefix_caching: bool = True,
        record_events: bool = False,
        swa_replay: SwaReplay = "exact",
        state_cache: SlidingStateCache | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if swa_replay not in SWA_REPLAY_CHOICES:
            raise ValueError(f"swa_replay must be one of {SWA_REPLAY_CHOICES}, got {swa_replay!r}")
        windows = {layout.groups[g].spec.window for g in layout.sliding_groups}
        if len(windows) > 1:
            raise ValueError(f"sliding layers with different windows ({sorted(windows)}) are not supported")  # type: ignore[type-var]
        self.layout = layout
        self.block_size = block_size
        self.model_fingerprint = model_fingerprint
        self.enable_prefix_caching = enable_prefix_caching
        self.swa_replay = swa_replay
        self.state_cache = state_cache if layout.sliding_groups else None
        persistent = layout.persistent_groups
        self.size_class_of_group = layout.size_class_of_group
        self.pool = BlockPool(
            num_blocks, record_events, event_group=persistent[0] if persistent else 0,
            num_size_classes=len(layout.size_classes),
        )  # fmt: skip
        self.managers = [
            make_manager(g, group.spec, self.pool, block_size, self.size_class_of_group[g])
            for g, group in enumerate(layout.groups)
        ]
        self._full = [m for m in self.managers if isinstance(m, FullAttentionManager)]
        self._sliding = [m for m in self.managers if isinstance(m, SlidingWindowManager)]
        self.num_queries = 0
        self.num_hit_tokens = 0
        self.num_query_tokens = 0
        self.num_replays = 0
        self.num_replayed_tokens = 0
        self._reserved: dict[str, dict[int, list[KVBlock]]] = {}
        """Per request waiting for a connector load: per group, the blocks it goes into (the
        persistent groups', and the sliding groups' window from a peer that holds it)."""
        self._window_first: dict[str, int] = {}
        """Per request whose reservation has a window: the block its window starts at."""

    # -- queries -------------------------------------------------------------

    @property
    def replay_length(self) -> int:
        """R: tokens replayed before a hit whose sliding-window state is gone. Bounded:
        the window (approximate by design); exact: L_swa * (W - 1), after which every
        sliding layer's state equals a cold run's."""
        window = self.layout.max_window
        if window is None:
            return 0
        if self.swa_replay == "exact":
            return self.layout.num_sliding_layers * (window - 1)
        return window

    def block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block table of every group (null entries are the null block's id)."""
        return [m.block_ids(request_id) for m in self.managers]

    def num_blocks_needed(self, num_tokens: int) -> int:
        """See blocks_for_one_request."""
        return blocks_for_one_request(self.layout, num_tokens, self.block_size)

    def hash_chain(
        self, token_ids: list[int], cache_salt: str | None = None, images: Sequence[ImageSpan] = ()
    ) -> list[BlockHash]:
        """The chain hashes of the full blocks of token_ids, as this engine names them."""
        return hash_block_chain(token_ids, self.block_size, self.model_fingerprint, cache_salt, images=images)

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
                images=request.image_spans,
            )

    def find_prefix_hit(self, request: Request) -> PrefixHit:
        """The longest usable prefix of the request in this engine's cache. At
        least the last token is always left to compute: the step needs its logits."""
        empty = PrefixHit([[] for _ in self.managers])
        if not self.enable_prefix_caching:
            return empty
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        self.num_queries += 1
        self.num_query_tokens += request.num_tokens
        if self._full:
            full: dict[int, list[KVBlock]] = {}
            num_blocks = max_blocks
            for m in self._full:
                full[m.group] = m.find_hit(request, num_blocks)
                num_blocks = min(num_blocks, len(full[m.group]))
            hit = self.resolve_hit(request, num_blocks, full, allow_replay=True) or empty
        else:
            # Only sliding layers: nothing persists, so a hit is a boundary whose window is at hand.
            hit = next(
                (h for k in range(max_blocks, 0, -1) if (h := self.resolve_hit(request, k, {}, False)) is not None),
                empty,
            )
        self.num_hit_tokens += hit.num_tokens
        return hit

    def resolve_hit(
        self, request: Request, num_blocks: int, full: dict[int, list[KVBlock]], allow_replay: bool
    ) -> PrefixHit | None:
        """A hit of the first num_blocks blocks, given the full groups' cached blocks
        (`full`, at least num_blocks each; missing groups get no blocks: the caller
        fills them, e.g. from a connector): the sliding-window state from the index,
        else from the state cache, else by replay when allowed; None if none works."""
        tables = [list(full.get(m.group, []))[:num_blocks] for m in self.managers]
        tokens = num_blocks * self.block_size
        if num_blocks == 0:
            return PrefixHit(tables)
        windows = [m.find_hit_at(request, num_blocks) for m in self._sliding]
        if all(w is not None for w in windows):
            for m, window in zip(self._sliding, windows):
                tables[m.group] = window  # type: ignore[assignment]
            return PrefixHit(tables, tokens, tokens)
        state = self._saved_state(request, num_blocks)
        if state is not None:
            for m in self._sliding:
                tables[m.group] = [self.pool.null_of(m.size_class)] * state.first_block
            return PrefixHit(tables, tokens, tokens, state)
        replay = self.replay_length
        if allow_replay and tokens > replay:
            start = tokens - replay
            for m in self._sliding:
                tables[m.group] = [self.pool.null_of(m.size_class)] * (start // self.block_size)
            return PrefixHit(tables, tokens, start)
        return None

    def _saved_state(self, request: Request, num_blocks: int) -> SlidingState | None:
        if self.state_cache is None:
            return None
        state = self.state_cache.get(request.block_hashes[num_blocks - 1])
        return state if state is not None and state.num_blocks == num_blocks else None

    # -- changes -------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Make room for num_new_tokens beyond the request's computed tokens (at
        admission: beyond the hit's, adopting its blocks). False, changing nothing,
        when the pool is short."""
        rid = request.request_id
        if hit is None:
            for m in self.managers:
                m.remove_skipped_blocks(rid, request.num_computed_tokens)
        tables = hit.tables if hit is not None else [[] for _ in self.managers]
        total = (hit.num_computed if hit is not None else request.num_computed_tokens) + num_new_tokens
        # Per size class: the blocks to take, and the cached blocks we adopt that sit in its
        # free queue (they stop being free).
        needed = [0] * self.pool.num_size_classes
        for m, t in zip(self.managers, tables):
            needed[m.size_class] += m.num_new_blocks(rid, total, t) + sum(1 for b in t if b.ref_cnt == 0)
        if any(n > self.pool.num_free(c) for c, n in enumerate(needed)):
            return False
        if hit is not None:
            indexed = hit.num_tokens // self.block_size
            for m, t in zip(self.managers, tables):
                m.adopt(rid, t, indexed)
            if hit.is_replay:
                self.num_replays += 1
                self.num_replayed_tokens += hit.num_tokens - hit.num_computed
        for m in self.managers:
            m.allocate(rid, m.num_new_blocks(rid, total, []))
        if self.enable_prefix_caching:
            self.update_block_hashes(request)
            for m in self.managers:
                m.index_full_blocks(request, total)
        return True

    def rollback(self, request: Request) -> None:
        """After verification rejected drafted tokens (request.num_computed_tokens already
        lowered to the accepted length): free every group's blocks past that length."""
        for m in self.managers:
            m.truncate(request.request_id, request.num_computed_tokens)

    # -- loads from a KV connector -------------------------------------------

    def num_cached_persistent_blocks(self, request: Request, max_blocks: int) -> int:
        """Leading blocks of the request that every persistent group holds here."""
        self.update_block_hashes(request)
        return self.persistent_blocks(request, 0, max_blocks)[0]

    def reserve_for_load(self, request: Request, num_blocks: int) -> bool:
        """Take fresh blocks for `num_blocks` blocks of every persistent group and, when
        the request's peer source holds the sliding window (KVTransferParams.source), for
        that window in every sliding group; held for the request until its admission (or
        its end), so a load has somewhere to land that nothing evicts. False, taking
        nothing, when the pool is short."""
        window_first, num_window = self._window_to_load(request)
        sizes = [(g, num_blocks) for g in self.layout.persistent_groups]
        sizes += [(g, num_window) for g in self.layout.sliding_groups if num_window]
        per_class = [0] * self.pool.num_size_classes
        for g, n in sizes:
            per_class[self.size_class_of_group[g]] += n
        if any(n > self.pool.num_free(c) for c, n in enumerate(per_class)):
            return False
        reserved: dict[int, list[KVBlock]] = {}
        for g, n in sizes:
            new = self.pool.allocate(n, self.size_class_of_group[g])
            assert new is not None, "checked above"
            reserved[g] = new
        self._reserved[request.request_id] = reserved
        if num_window:
            self._window_first[request.request_id] = window_first
        return True

    def _window_to_load(self, request: Request) -> tuple[int, int]:
        """(first block, blocks per sliding group) of the window the request's peer source
        holds; (0, 0) when it holds none, or one that does not fit this model's groups."""
        source = request.kv_transfer.source if request.kv_transfer is not None else None
        if source is None or not source.window or set(source.window) != set(self.layout.sliding_groups):
            return 0, 0
        num = source.num_blocks - source.window_first
        if num <= 0 or any(len(ids) != num for ids in source.window.values()):
            return 0, 0
        return source.window_first, num

    def reserved_block_ids(self, request_id: str) -> dict[int, list[int]]:
        """Per group, the ids a load writes: the persistent groups' and, for a window, the
        sliding groups' (what a connector's start_load gets as block_ids)."""
        return {g: [b.block_id for b in blocks] for g, blocks in self._reserved.get(request_id, {}).items()}

    def index_loaded(self, request: Request, first_block: int, num_blocks: int, window: bool = False) -> None:
        """Enter the first num_blocks reserved blocks of each persistent group (now holding
        blocks first_block, ... of the request) into the prefix index, so the request's
        admission hits them; with `window` (the whole load arrived, the window with it),
        the sliding groups' reserved window too, so admission finds it and replays nothing.
        A window not loaded is never indexed: its blocks hold nothing."""
        rid = request.request_id
        reserved = self._reserved.get(rid, {})
        for g in self.layout.persistent_groups:
            for i, block in enumerate(reserved.get(g, [])[:num_blocks], start=first_block):
                self._cache_loaded(request, block, i, g)
        if window and rid in self._window_first:
            for g in self.layout.sliding_groups:
                for i, block in enumerate(reserved.get(g, []), start=self._window_first[rid]):
                    if i < len(request.block_hashes):
                        self._cache_loaded(request, block, i, g)

    def _cache_loaded(self, request: Request, block: KVBlock, index: int, group: int) -> None:
        bs = self.block_size
        chunk = tuple(request.all_token_ids[index * bs : (index + 1) * bs])
        self.pool.cache_block(block, request.block_hashes[index], group, chunk)

    def release_reserved(self, request_id: str) -> None:
        """Drop the reservation's references (after admission the request holds its own)."""
        self._window_first.pop(request_id, None)
        for blocks in self._reserved.pop(request_id, {}).values():
            self.pool.free(blocks[::-1])

    def persistent_blocks(
        self, request: Request, first_block: int, num_blocks: int
    ) -> tuple[int, list[list[KVBlock]]]:
        """The longest run of the request's blocks first_block, first_block + 1, ... (at
        most num_blocks) that every persistent group holds in the prefix index: its
        length, and its blocks in each persistent group (in layout order). A model with
        no persistent group holds no run."""
        groups = self.layout.persistent_groups
        bs, tokens = self.block_size, request.all_token_ids
        blocks: list[list[KVBlock]] = [[] for _ in groups]
        if not groups:
            return 0, blocks
        last = min(first_block + num_blocks, len(request.block_hashes))
        for i in range(first_block, last):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            found = [self.pool.lookup(request.block_hashes[i], g, chunk) for g in groups]
            if any(b is None for b in found):
                return i - first_block, blocks
            for run, block in zip(blocks, found):
                run.append(block)  # type: ignore[arg-type]
        return max(last - first_block, 0), blocks

    def window_blocks(self, request: Request, num_blocks: int) -> tuple[int, dict[int, list[KVBlock]]]:
        """The sliding groups' blocks a query at the end of the request's first num_blocks
        blocks sees, from the prefix index (a block the sliding manager dropped from the
        table stays there until it is handed out again): (the first of them, per sliding
        group its blocks first .. num_blocks - 1). (0, {}) when one is gone, or there is
        no sliding group."""
        if not self._sliding or num_blocks == 0:
            return 0, {}
        first = self._sliding[0].first_needed_block(num_blocks * self.block_size)
        window: dict[int, list[KVBlock]] = {}
        for m in self._sliding:
            table = m.find_hit_at(request, num_blocks)
            if table is None:
                return 0, {}
            window[m.group] = table[first:]
        return first, window

    def state_block_ids(self, request_id: str, state: SlidingState) -> dict[int, list[int]]:
        """Per sliding group, the blocks a loaded state goes into."""
        return {m.group: m.block_ids(request_id)[state.first_block : state.num_blocks] for m in self._sliding}

    def free(self, request: Request, save_state: bool = True) -> StateSave | None:
        """Release the request's blocks. With a state cache, first say which
        sliding-window blocks to save: the window a query at the request's last
        full block boundary whose KV is written sees (the caller copies them
        before anything can reuse them)."""
        save = self._state_to_save(request) if save_state else None
        for m in self.managers:
            m.free(request.request_id)
        return save

    def _state_to_save(self, request: Request) -> StateSave | None:
        if self.state_cache is None or not self.enable_prefix_caching or not request.block_hashes:
            return None
        # KV is written for every token but the last sampled one (with async scheduling
        # the step in flight writes that one, in a later block or later in this one).
        num_blocks = min(request.num_tokens - 1, request.num_computed_tokens) // self.block_size
        num_blocks = min(num_blocks, len(request.block_hashes))
        if num_blocks == 0:
            return None
        first = self._sliding[0].first_needed_block(num_blocks * self.block_size)
        save = StateSave(request.block_hashes[num_blocks - 1], num_blocks, first)
        for m in self._sliding:
            blocks = m.table(request.request_id)[first:num_blocks]
            if len(blocks) < num_blocks - first or any(self.pool.is_null(b) for b in blocks):
                return None
            save.block_ids[m.group] = [b.block_id for b in blocks]
        return save
