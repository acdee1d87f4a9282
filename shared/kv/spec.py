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
shared/engine/kv/replay.py). No torch here.
"""

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FullAttentionSpec:
    """Every past token's KV is kept; persisted to the kvcache service."""

    @property
    def persistent(self) -> bool:
        return True

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


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    spec: KVCacheSpec
    layers: tuple[int, ...]
    """Model layers of this group; the k-th of them uses the cache tensor k."""


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroup, ...]
    num_layers: int

    @property
    def group_size(self) -> int:
        """Cache tensors, i.e. layers one block id spans."""
        return max(len(g.layers) for g in self.groups)

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
    if not sliding_windows:
        raise ValueError("a model needs at least one layer")
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for layer, window in enumerate(sliding_windows):
        spec: KVCacheSpec = FullAttentionSpec() if window is None else SlidingWindowSpec(window)
        by_spec.setdefault(spec, []).append(layer)
    size = min(len(layers) for layers in by_spec.values())
    groups = [
        KVCacheGroup(spec, tuple(layers[i : i + size]))
        for spec, layers in by_spec.items()
        for i in range(0, len(layers), size)
    ]
    return KVCacheLayout(tuple(groups), len(sliding_windows))
