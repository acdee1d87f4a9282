"""Where each layer's experts live: a load matrix [layers, logical experts] (tokens per
expert over a window) to a placement of physical slots on ranks, with redundant
replicas of the hot experts.

The policy is the one DeepSeek's EPLB describes (our own code, vectorised across
layers so that a whole model's placement takes milliseconds):

1. hierarchical, where the expert groups divide evenly over the nodes: the groups are
   packed onto nodes (equal group counts, balanced load), so group-limited routing
   keeps a token's traffic inside few nodes; the rest runs per (layer, node);
   global otherwise: all ranks are one node;
2. replicas: every expert gets one slot, then each spare slot goes to the expert with
   the highest load per replica (the D'Hondt rule, greedy);
3. the replicas (each carrying load / replicas) are packed onto the node's ranks,
   each rank exactly `slots_per_rank` of them, balanced, and no rank holding two
   replicas of one expert where that can be avoided.

Physical slot `r * slots_per_rank + s` is slot s of rank r.
"""

import enum
from dataclasses import dataclass

import numpy as np

# A swap must lower the heavier rank by more than this share of its load: rounding
# noise must not count as progress (the refinement would cycle).
_MIN_GAIN = 1e-9
_MAX_SWAP_ROUNDS = 8
"""Bound on the paired refinement's rounds (each evens every heaviest/lightest pair
or stops): at 48 layers x 128 experts x EP16-64 they stop by the eighth."""
_MAX_HEAVIEST_ROUNDS = 8
"""Bound on the heaviest-pack refinement's rounds, each lowering one pack per layer:
the placement's time budget (5 ms at 48 x 128 x EP64) bounds it."""


class Policy(enum.Enum):
    HIERARCHICAL = "hierarchical"
    GLOBAL = "global"
    STATIC = "static"


@dataclass(frozen=True, slots=True)
class PlacementSpec:
    """The shape of an expert-parallel instance, as the placement needs it."""

    num_ranks: int
    """Expert-parallel ranks (devices), over all nodes."""
    num_redundant_experts: int = 0
    """Physical slots beyond one per logical expert, in total over all ranks."""
    num_nodes: int = 1
    """Nodes the ranks are spread over, equally (ranks r*k .. r*k+k-1 on one node)."""
    num_groups: int = 1
    """Expert groups of group-limited routing (DeepSeek-V3: 8); 1 when the model has none."""

    @classmethod
    def per_rank(cls, num_ranks: int, redundant_per_rank: int, num_nodes: int = 1, num_groups: int = 1) -> "PlacementSpec":
        return cls(num_ranks, num_ranks * redundant_per_rank, num_nodes, num_groups)

    def num_slots(self, num_experts: int) -> int:
        return num_experts + self.num_redundant_experts

    def slots_per_rank(self, num_experts: int) -> int:
        return self.num_slots(num_experts) // self.num_ranks

    def policy(self) -> Policy:
        """Hierarchical only where it says something: groups split evenly over >1 node."""
        if self.num_nodes > 1 and self.num_groups % self.num_nodes == 0:
            return Policy.HIERARCHICAL
        return Policy.GLOBAL

    def check(self, num_experts: int) -> None:
        if self.num_ranks < 1 or self.num_nodes < 1 or self.num_groups < 1 or self.num_redundant_experts < 0:
            raise ValueError(f"{self}: ranks, nodes and groups must be >= 1, redundant experts >= 0")
        if self.num_slots(num_experts) % self.num_ranks:
            raise ValueError(
                f"{num_experts} experts + {self.num_redundant_experts} redundant do not divide over "
                f"{self.num_ranks} ranks: choose redundant experts so that every rank has the same slot count"
            )
        if self.num_ranks % self.num_nodes:
            raise ValueError(f"{self.num_ranks} ranks do not divide over {self.num_nodes} nodes")
        if num_experts % self.num_groups:
            raise ValueError(f"{num_experts} experts do not divide into {self.num_groups} groups")
        if self.policy() is Policy.HIERARCHICAL and self.num_redundant_experts % self.num_nodes:
            raise ValueError(
                f"hierarchical placement gives each of the {self.num_nodes} nodes the same number of redundant "
                f"slots: {self.num_redundant_experts} redundant experts do not divide over them"
            )


@dataclass(frozen=True)
class Placement:
    """One placement of every MoE layer's experts."""

    phy_to_log: np.ndarray
    """[layers, num_ranks * slots_per_rank] int64: the logical expert in each physical slot."""
    log_to_phy: np.ndarray
    """[layers, experts, max replicas] int64: an expert's physical slots, ascending,
    padded with -1 (an array's padding; `replicas()` gives the exact lists)."""
    replica_counts: np.ndarray
    """[layers, experts] int64, each >= 1."""
    num_ranks: int
    slots_per_rank: int
    policy: Policy

    @property
    def num_layers(self) -> int:
        return self.phy_to_log.shape[0]

    @property
    def num_experts(self) -> int:
        return self.replica_counts.shape[1]

    def replicas(self, layer: int, expert: int) -> list[int]:
        return [int(s) for s in self.log_to_phy[layer, expert, : self.replica_counts[layer, expert]]]

    def rank_experts(self) -> np.ndarray:
        """[layers, ranks, slots_per_rank]: the logical experts each rank holds."""
        return self.phy_to_log.reshape(self.num_layers, self.num_ranks, self.slots_per_rank)

    def rank_loads(self, load: np.ndarray) -> np.ndarray:
        """[layers, ranks] tokens per rank for a load [layers, experts] (or
        [steps, layers, experts]), each expert's tokens split evenly over its replicas."""
        per_replica = np.asarray(load, dtype=np.float64) / self.replica_counts
        slots = np.take_along_axis(per_replica, np.broadcast_to(self.phy_to_log, per_replica.shape[:-1] + self.phy_to_log.shape[-1:]), axis=-1)
        return slots.reshape(*slots.shape[:-1], self.num_ranks, self.slots_per_rank).sum(-1)


def static_placement(num_layers: int, num_experts: int, num_ranks: int) -> Placement:
    """Expert i on rank i // (experts / ranks), no replicas: what EP does without EPLB."""
    if num_experts % num_ranks:
        raise ValueError(f"{num_experts} experts do not divide over {num_ranks} ranks")
    phy_to_log = np.broadcast_to(np.arange(num_experts, dtype=np.int64), (num_layers, num_experts)).copy()
    return _finish(phy_to_log, num_experts, num_ranks, Policy.STATIC)


def compute_placement(load: np.ndarray, spec: PlacementSpec) -> Placement:
    """The placement for a load [layers, experts] (tokens per expert over a window)."""
    load = np.asarray(load, dtype=np.float64)
    if load.ndim != 2:
        raise ValueError(f"load must be [layers, experts], got shape {load.shape}")
    num_layers, num_experts = load.shape
    spec.check(num_experts)
    policy = spec.policy()
    nodes = spec.num_nodes if policy is Policy.HIERARCHICAL else 1
    # An all-zero layer (nothing routed yet) would divide by zero below; equal tiny loads
    # place it like the static placement would, and any nonzero load outweighs them.
    load = load + 1e-6

    if policy is Policy.HIERARCHICAL:
        per_group = num_experts // spec.num_groups
        group_load = load.reshape(num_layers, spec.num_groups, per_group).sum(-1)
        node_groups = _pack(group_load, nodes)  # [layers, nodes, groups per node]
        node_experts = (node_groups[..., None] * per_group + np.arange(per_group)).reshape(num_layers, nodes, -1)
    else:
        node_experts = np.broadcast_to(np.arange(num_experts), (num_layers, 1, num_experts))
    # From here on a row is one (layer, node), its experts numbered locally.
    rows = num_layers * nodes
    local_load = np.take_along_axis(load, node_experts.reshape(num_layers, -1), axis=1).reshape(rows, -1)
    slots_per_node = spec.num_slots(num_experts) // nodes
    counts = _replicate(local_load, slots_per_node)
    local_experts = local_load.shape[1]
    # Every row's counts sum to slots_per_node, so one flat repeat reshapes into rows.
    items = np.repeat(np.tile(np.arange(local_experts), rows), counts.ravel()).reshape(rows, slots_per_node)
    weights = np.take_along_axis(local_load / counts, items, axis=1)
    packs = _pack(weights, spec.num_ranks // nodes, keys=items)  # [rows, ranks per node, slots] item indices
    local = np.take_along_axis(items, packs.reshape(rows, -1), axis=1)
    logical = np.take_along_axis(node_experts.reshape(rows, -1), local, axis=1)
    return _finish(logical.reshape(num_layers, -1), num_experts, spec.num_ranks, policy)


def _replicate(load: np.ndarray, num_slots: int) -> np.ndarray:
    """Replica counts [rows, experts] summing to num_slots per row: one each, then each
    spare slot to the highest load per replica. The greedy is D'Hondt's rule, so a
    threshold gives most of it at once: with t = load sum / spare slots, an expert's
    extras whose quotient load/k is >= t number floor(load / t), at most `spare` in all,
    and every one of them is among the greedy's picks; the rest go one by one."""
    rows, experts = load.shape
    spare = num_slots - experts
    counts = np.ones((rows, experts), dtype=np.int64)
    if spare <= 0:
        return counts
    counts += np.floor(load * (spare / load.sum(1, keepdims=True))).astype(np.int64)
    # Rounding in the product may overshoot by one at a boundary: take those back.
    while (over := counts.sum(1) - num_slots).max() > 0:
        row = np.flatnonzero(over > 0)
        worst = np.argmin(load[row] / np.maximum(counts[row] - 1, 1) + (counts[row] == 1) * np.inf, axis=1)
        counts[row, worst] -= 1
    left = num_slots - counts.sum(1)
    per_replica = load / counts
    row_ids = np.arange(rows)
    for _ in range(int(left.max())):
        pick = np.argmax(per_replica, axis=1)
        give = left > 0
        counts[row_ids[give], pick[give]] += 1
        left -= give
        per_replica[row_ids, pick] = load[row_ids, pick] / counts[row_ids, pick]
    return counts


def _pack(weights: np.ndarray, num_packs: int, keys: np.ndarray | None = None) -> np.ndarray:
    """Items [rows, items] into num_packs packs of equal size, balanced: the item indices
    of each pack, [rows, packs, items / packs]. Items with equal keys (replicas of one
    expert) share a pack only where that cannot be avoided (more replicas than packs)."""
    rows, num_items = weights.shape
    per_pack = num_items // num_packs
    row_ids = np.arange(rows)[:, None]
    # Rounds of num_packs items, heaviest first; in each round the heaviest item goes to
    # the lightest pack so far (LPT under the equal-count constraint).
    order = np.argsort(-weights, axis=1, kind="stable")
    packs = np.empty((rows, num_packs, per_pack), dtype=np.int64)
    pack_load = np.zeros((rows, num_packs))
    for j in range(per_pack):
        chosen = order[:, j * num_packs : (j + 1) * num_packs]
        targets = np.argsort(pack_load, axis=1, kind="stable")
        if keys is not None and j > 0:
            targets = _keep_replicas_apart(targets, chosen, packs[:, :, :j], keys)
        packs[row_ids, targets, j] = chosen
        pack_load[row_ids, targets] += np.take_along_axis(weights, chosen, axis=1)
    if per_pack > 0 and num_packs > 1:
        flat = _FlatItems(weights, keys)
        _refine_pairs(packs, flat)
        _refine_heaviest(packs, flat)
    return packs


def _keep_replicas_apart(targets: np.ndarray, chosen: np.ndarray, earlier: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """A round's pack for each of its items, changed so that no item joins a pack that
    already holds its expert. Items are sorted by weight and an expert's replicas weigh
    the same, so they are one run: only the run that began in the round before can meet
    its own replicas, and it leads this round. Those of its items aimed at a pack that
    holds it trade packs with the round's first items aimed at packs that do not."""
    rows, num_packs = targets.shape
    chosen_keys = np.take_along_axis(keys, chosen, axis=1)
    lead = chosen_keys[:, :1]
    earlier_keys = np.take_along_axis(keys, earlier.reshape(rows, -1), axis=1).reshape(earlier.shape)
    holds_lead = np.take_along_axis((earlier_keys == lead[:, :, None]).any(-1), targets, axis=1)
    in_run = np.cumprod(chosen_keys == lead, axis=1).astype(bool)
    clash = in_run & holds_lead
    if not clash.any():
        return targets
    free = ~in_run & ~holds_lead
    n = np.minimum(clash.sum(1), free.sum(1))[:, None]
    # The k-th clash of a row trades with its k-th free item (nonzero walks rows in order).
    rc, ic = np.nonzero(clash & (np.cumsum(clash, axis=1) <= n))
    rf, jf = np.nonzero(free & (np.cumsum(free, axis=1) <= n))
    targets = targets.copy()
    targets[rc, ic], targets[rf, jf] = targets[rf, jf], targets[rc, ic]
    return targets


class _FlatItems:
    """Items' weights and keys, read by flat index (row * items + item): numpy's take on
    one flat array is several times faster than fancy indexing with broadcast rows."""

    def __init__(self, weights: np.ndarray, keys: np.ndarray | None) -> None:
        rows, num_items = weights.shape
        self.base = (np.arange(rows) * num_items)[:, None, None]
        self.weights = weights.ravel()
        self.keys = None if keys is None else keys.ravel()

    def clashes(self, packs: np.ndarray, src: np.ndarray, dst: np.ndarray) -> np.ndarray | None:
        """[rows, m, per_pack, per_pack] bool for m pairs (src pack, dst pack), each
        [rows, m]: trading src's item a for dst's item b would put one beside a replica
        of its own expert. (It also refuses two replicas of one expert trading places,
        which would change nothing.)"""
        if self.keys is None:
            return None
        item_keys = self.keys.take(packs + self.base)  # [rows, packs, per_pack]
        src_keys = np.take_along_axis(item_keys, src[..., None], axis=1)  # [rows, m, per_pack]
        dst_keys = np.take_along_axis(item_keys, dst[..., None], axis=1)
        per_pack = packs.shape[2]
        # Loops over the (few) slots: numpy's reductions over a short last axis are
        # ten times slower than the same ORs written out.
        a_joins = np.zeros(src_keys.shape, dtype=bool)
        b_joins = np.zeros(src_keys.shape, dtype=bool)
        for j in range(per_pack):
            a_joins |= src_keys == dst_keys[..., j : j + 1]
            b_joins |= dst_keys == src_keys[..., j : j + 1]
        return a_joins[..., :, None] | b_joins[..., None, :]


def _best_swaps(packs: np.ndarray, flat: _FlatItems, src: np.ndarray, dst: np.ndarray,
                loads: np.ndarray, w: np.ndarray, one_per_row: bool = False) -> int:
    """For each pair (src pack, dst pack) [rows, m], the one trade of an item each that
    best lowers the pair's heavier side (src), made where it lowers it at all; the
    number of trades made."""
    rows, num_packs, per_pack = packs.shape
    w_src = np.take_along_axis(w, src[..., None], axis=1)  # [rows, m, per_pack]
    w_dst = np.take_along_axis(w, dst[..., None], axis=1)
    top = np.take_along_axis(loads, src, axis=1)
    # src's item a for dst's item b: src changes by b - a, dst by a - b.
    delta = w_src[..., :, None] - w_dst[..., None, :]  # [rows, m, a, b]
    pair_max = np.maximum(top[..., None, None] - delta, np.take_along_axis(loads, dst, axis=1)[..., None, None] + delta)
    clash = flat.clashes(packs, src, dst)
    if clash is not None:
        pair_max[clash] = np.inf
    m = src.shape[1]
    if one_per_row:  # the pairs share src: one trade per row, the best of them all
        pair_max = pair_max.reshape(rows, 1, -1)
    else:
        pair_max = pair_max.reshape(rows, m, -1)
    best = pair_max.argmin(-1)
    lowered = np.take_along_axis(pair_max, best[..., None], axis=-1)[..., 0]
    r, k = np.nonzero(lowered < top[:, : lowered.shape[1]] * (1 - _MIN_GAIN))
    pair, ab = np.divmod(best[r, k], per_pack * per_pack) if one_per_row else (k, best[r, k])
    a, b = np.divmod(ab, per_pack)
    at_src = (r * num_packs + src[r, pair]) * per_pack + a
    at_dst = (r * num_packs + dst[r, pair]) * per_pack + b
    cells = packs.reshape(-1)
    cells[at_src], cells[at_dst] = cells[at_dst], cells[at_src]
    return len(r)


def _slot_sum(w: np.ndarray) -> np.ndarray:
    """w.sum(-1), written out over the slots (a short axis numpy reduces slowly)."""
    total = w[..., 0].copy()
    for j in range(1, w.shape[-1]):
        total += w[..., j]
    return total


def _refine_pairs(packs: np.ndarray, flat: _FlatItems) -> None:
    """Pair the k-th heaviest pack with the k-th lightest and make, in every pair at
    once, the best trade of an item each, while one helps: the rounds place items by
    weight order alone, this looks at the sums."""
    half = packs.shape[1] // 2
    for _ in range(_MAX_SWAP_ROUNDS):
        w = flat.weights.take(packs + flat.base)
        loads = _slot_sum(w)
        by_load = np.argsort(loads, axis=1)
        if not _best_swaps(packs, flat, by_load[:, : -half - 1 : -1], by_load[:, :half], loads, w):
            break


def _refine_heaviest(packs: np.ndarray, flat: _FlatItems) -> None:
    """Then the heaviest pack's best trade with any pack, while one helps: where the
    lightest had nothing to trade with it, another may."""
    rows, num_packs, _ = packs.shape
    others = np.arange(num_packs)
    for _ in range(_MAX_HEAVIEST_ROUNDS):
        w = flat.weights.take(packs + flat.base)
        loads = _slot_sum(w)
        heavy = np.broadcast_to(loads.argmax(1)[:, None], (rows, num_packs))
        # Trading with itself: delta 0 on both sides, never "better", so it may stay in.
        if not _best_swaps(packs, flat, heavy, np.broadcast_to(others, (rows, num_packs)), loads, w, one_per_row=True):
            break


def _finish(phy_to_log: np.ndarray, num_experts: int, num_ranks: int, policy: Policy) -> Placement:
    """The reverse map and the counts, from the slot map."""
    num_layers, num_slots = phy_to_log.shape
    counts = np.zeros((num_layers, num_experts), dtype=np.int64)
    np.add.at(counts, (np.arange(num_layers)[:, None], phy_to_log), 1)
    assert (counts >= 1).all(), "a placement lost an expert"
    # Slots grouped by expert (stable: ascending within one); a slot's index among its
    # expert's replicas is its position minus where the expert's run starts.
    order = np.argsort(phy_to_log, axis=1, kind="stable")
    expert_of = np.take_along_axis(phy_to_log, order, axis=1)
    starts = np.cumsum(counts, axis=1) - counts
    within = np.arange(num_slots) - np.take_along_axis(starts, expert_of, axis=1)
    log_to_phy = np.full((num_layers, num_experts, int(counts.max())), -1, dtype=np.int64)
    log_to_phy[np.arange(num_layers)[:, None], expert_of, within] = order
    return Placement(phy_to_log, log_to_phy, counts, num_ranks, num_slots // num_ranks, policy)
