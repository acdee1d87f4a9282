"""How a model's KV cache is laid out: groups of layers, each with a spec.

A model declares what each attention layer keeps (full attention: every past
token; a sliding window: the last W tokens). Layers of one kind are cut into
groups of equal size, and every group has its own block table per request over
one shared block pool (vLLM v1's hybrid allocator). Equal sizes let one block
id name the same amount of memory in every group: the cache is ``group_size``
tensors, and layer ``k`` of any group lives in tensor ``k``, so a block id is a
page across those tensors whichever group holds it.

Groups are marked persistent or not. Full-attention KV is persisted (the
kvcache service stores it by chain hash); sliding-window KV never is: it stays
in the worker and is rebuilt by replay when it is gone (SWA bounded replay, see
shared/kv/memory/coordinator.py). DeepSeek-V4's compressed entries are a third
kind (``CompressedSpec``), persistent like full attention.

Page sizes: a model whose caches all have one row shape (Llama, Qwen, GPT-OSS)
declares none, and every group shares one pool of blocks as above. A model whose
caches' rows differ (DeepSeek-V4: state rows carry the compressor's planes,
compressed entries the indexer's key) declares each cache's ``CacheRow``; then
every group is a *size class* of its own, with its own tensors of its own rows and
its own block ids (SGLang's separate pools): nothing is padded to the widest row,
and a token costs the sum of its caches' rows. A compressed group's block then holds
only its entries (block_size / rate rows, ``block_rows``), not a row per raw token.
A persistent group's class has as many blocks as the pool (num_blocks); a sliding-window
group's class only what its requests hold of the window at once
(shared/kv/memory/coordinator.py's ``blocks_per_class``); each class has its own null
block (id: its block count). Two groups of equal rows do not share a class: sharing
would give each half the blocks. No torch here.
"""

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CacheRow:
    """One token's row in a cache tensor ``[planes, blocks, block_size, heads, channels]``."""

    planes: int
    heads: int
    channels: int

    def __post_init__(self) -> None:
        if min(self.planes, self.heads, self.channels) < 1:
            raise ValueError(f"a cache row needs at least one plane, head and channel, got {self}")

    @property
    def elements(self) -> int:
        """Elements one token takes in this cache."""
        return self.planes * self.heads * self.channels


@dataclass(frozen=True, slots=True)
class Page:
    """The part of a block a group's layer holds, i.e. what it persists per block: of a
    cache tensor [2, blocks, block_size, kv_heads, width], ``[:planes, block, :rows, :, :channels]``.
    Every group's blocks take the same memory (one block pool, the widest page, as vLLM
    unifies page sizes), but a connector moves only a group's page."""

    planes: int
    rows: int
    channels: int | None
    """None: the whole row."""

    def covers(self, block_size: int) -> bool:
        """Whether the page is the whole block."""
        return self.planes == 2 and self.rows == block_size and self.channels is None


@dataclass(frozen=True, slots=True)
class FullAttentionSpec:
    """Every past token's KV is kept; persisted to the kvcache service."""

    @property
    def persistent(self) -> bool:
        return True

    def page(self, block_size: int) -> Page:
        return Page(2, block_size, None)

    def rows_per_block(self, block_size: int) -> int:
        """Rows a block of this group's cache tensors holds: one per token."""
        return block_size

    @property
    def window(self) -> None:
        return None


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec:
    """A query at p sees keys j with p - j < window: older blocks are freed. Never persisted."""

    window: int

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"a sliding window must be at least 1 token, got {self.window}")

    @property
    def persistent(self) -> bool:
        return False

    def page(self, block_size: int) -> Page:
        return Page(2, block_size, None)

    def rows_per_block(self, block_size: int) -> int:
        """Rows a block of this group's cache tensors holds: one per token."""
        return block_size


@dataclass(frozen=True, slots=True)
class CompressedSpec:
    """DeepSeek-V4's compressed KV (a CSA or HCA layer): one entry per ``compress_rate``
    raw tokens (CSA's entries carry the lightning indexer's key too). Kept for every
    past token like full attention, addressed like it (an entry sits in the block of
    its window's last raw token: block_size and the rate divide one another), persisted.
    A block holds ``rows_per_block`` rows, block_size / rate (one when the rate exceeds the
    block: the entry of a window ending in that block, or nothing), where the model's cache
    tensors are sized by them (a layout with declared rows: every group a size class of its
    own); its page is plane 0's rows and ``entry_width`` channels, so a block persists only
    its entries."""

    compress_rate: int
    entry_width: int | None = None
    """Channels of an entry (with the indexer's key); None: the whole row."""

    def __post_init__(self) -> None:
        if self.compress_rate < 1:
            raise ValueError(f"a compression rate must be at least 1 token, got {self.compress_rate}")
        if self.entry_width is not None and self.entry_width < 1:
            raise ValueError(f"an entry must be at least 1 channel wide, got {self.entry_width}")

    @property
    def persistent(self) -> bool:
        return True

    def page(self, block_size: int) -> Page:
        return Page(1, self.rows_per_block(block_size), self.entry_width)

    def rows_per_block(self, block_size: int) -> int:
        """Entries a block of block_size raw tokens holds (at least one row)."""
        return entries_per_block(self.compress_rate, block_size)

    @property
    def window(self) -> None:
        return None


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec | CompressedSpec


def entries_per_block(compress_rate: int, block_size: int) -> int:
    """Rows a compressed cache keeps per block of block_size raw tokens: one entry per
    compress_rate tokens, and one row when the rate exceeds the block (a block holding the
    entry of a window ending in it, or nothing)."""
    return max(1, block_size // compress_rate)


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    spec: KVCacheSpec
    layers: tuple[int, ...]
    """Model layers of this group; the k-th of them uses the cache tensor k."""


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroup, ...]
    num_layers: int
    rows: tuple[CacheRow, ...] | None = None
    """Each cache's row (one per "layer" of the layout); None: every cache has the model's
    one row shape (``CausalLM.kv_row_shape``, two planes), and all groups one size class."""

    def __post_init__(self) -> None:
        if self.rows is not None and len(self.rows) != self.num_layers:
            raise ValueError(f"{len(self.rows)} cache rows for {self.num_layers} caches")

    @property
    def group_size(self) -> int:
        """Cache tensors, i.e. layers one block id spans."""
        return max(len(g.layers) for g in self.groups)

    @property
    def size_classes(self) -> tuple[tuple[CacheRow, ...] | None, ...]:
        """Each size class's tensor rows (the k-th serves the k-th layer of its groups):
        ``(None,)``, one class of ``group_size`` tensors of the model's one row, when no
        rows are declared or all are alike (nothing to save); else one class per group."""
        if self.rows is None or len(set(self.rows)) == 1:
            return (None,)
        return tuple(tuple(self.rows[layer] for layer in g.layers) for g in self.groups)

    @property
    def size_class_of_group(self) -> tuple[int, ...]:
        """The size class (its block ids, its tensors) of each group."""
        if self.size_classes == (None,):
            return (0,) * len(self.groups)
        return tuple(range(len(self.groups)))

    def tensors_of_class(self, size_class: int) -> int:
        """Cache tensors of a size class."""
        rows = self.size_classes[size_class]
        return self.group_size if rows is None else len(rows)

    @property
    def num_tensors(self) -> int:
        """Cache tensors of every size class."""
        return sum(self.tensors_of_class(c) for c in range(len(self.size_classes)))

    def tensor_index(self, layer: int) -> int:
        """The cache tensor (over every size class, class by class) that ``layer`` uses."""
        group = self.group_of_layer(layer)
        size_class = self.size_class_of_group[group]
        return sum(self.tensors_of_class(c) for c in range(size_class)) + self.groups[group].layers.index(layer)

    def class_rows(self, row: CacheRow | None = None) -> list[tuple[CacheRow, ...]]:
        """Each size class's tensor rows (the k-th serves the k-th layer of its groups);
        ``row``: every cache's row when the layout declares none (the model's)."""
        if self.rows is None and row is None:
            raise ValueError("the layout declares no rows: give the model's row")
        one = row if self.rows is None else self.rows[0]
        return [(one,) * self.group_size if r is None else r for r in self.size_classes]  # type: ignore[misc]

    def block_rows(self, size_class: int, block_size: int) -> int:
        """Rows a block of the class's tensors holds: block_size (a row per token), but for a
        class of a compressed group, its entries (CompressedSpec.rows_per_block). A class
        shared by groups (no rows declared) keeps a row per token."""
        if self.size_classes == (None,):
            return block_size
        return self.groups[self.size_class_of_group.index(size_class)].spec.rows_per_block(block_size)

    def class_elements_per_block(self, block_size: int, row: CacheRow | None = None) -> list[int]:
        """Elements a block of each size class takes (its tensors' rows at its block_rows)."""
        return [
            self.block_rows(c, block_size) * sum(r.elements for r in rows) for c, rows in enumerate(self.class_rows(row))
        ]

    def elements_per_block(self, block_size: int, row: CacheRow | None = None) -> int:
        """Elements one block id takes in every size class together: what the cache spends
        per block where every class has the same number of blocks."""
        return sum(self.class_elements_per_block(block_size, row))

    def groups_of_class(self, size_class: int) -> int:
        return sum(1 for c in self.size_class_of_group if c == size_class)

    def group_of_layer(self, layer: int) -> int:
        return next(i for i, g in enumerate(self.groups) if layer in g.layers)

    def tensor_of_layer(self, layer: int) -> int:
        return self.groups[self.group_of_layer(layer)].layers.index(layer)

    @property
    def persistent_groups(self) -> tuple[int, ...]:
        return tuple(i for i, g in enumerate(self.groups) if g.spec.persistent)

    @property
    def sliding_groups(self) -> tuple[int, ...]:
        return tuple(i for i, g in enumerate(self.groups) if isinstance(g.spec, SlidingWindowSpec))

    @property
    def num_sliding_layers(self) -> int:
        return sum(len(self.groups[i].layers) for i in self.sliding_groups)

    @property
    def max_window(self) -> int | None:
        windows = [self.groups[i].spec.window for i in self.sliding_groups]
        return max(windows) if windows else None  # type: ignore[type-var]


def kv_cache_layout(sliding_windows: Sequence[int | None]) -> KVCacheLayout:
    """Group the layers of a model whose layer i has window ``sliding_windows[i]``
    (None: full attention). Each kind is cut into groups of the smallest kind's
    layer count, the last group of a kind possibly shorter (its missing tensors
    stay unused), as vLLM does."""
    return kv_cache_layout_of_specs(
        [FullAttentionSpec() if window is None else SlidingWindowSpec(window) for window in sliding_windows]
    )


def kv_cache_layout_of_specs(specs: Sequence[KVCacheSpec], rows: Sequence[CacheRow] | None = None) -> KVCacheLayout:
    """kv_cache_layout for caches given by their specs: cache i (a "layer" of the
    layout) keeps what ``specs[i]`` says. A model whose layer keeps two kinds of KV
    (DeepSeek-V4: a window and compressed entries) declares one cache for each, and
    ``rows``, each cache's row, where they differ (see size_classes)."""
    if not specs:
        raise ValueError("a model needs at least one layer")
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for layer, spec in enumerate(specs):
        by_spec.setdefault(spec, []).append(layer)
    size = min(len(layers) for layers in by_spec.values())
    groups = [
        KVCacheGroup(spec, tuple(layers[i : i + size]))
        for spec, layers in by_spec.items()
        for i in range(0, len(layers), size)
    ]
    return KVCacheLayout(tuple(groups), len(specs), None if rows is None else tuple(rows))
