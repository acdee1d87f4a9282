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
# noise must not count as progress (the refinement would cycle). The refinement adds
# in float32 (eps 6e-8): this is some 16 of its ulps.
_MIN_GAIN = 1e-6
_THRESHOLD_STEPS = 6
"""Regula falsi steps on the replica threshold: after six the greedy has at most a
few (<= 5 measured) slots left per row at 16-256 experts, sigma 0.3-2.5 (it is exact
whatever the number)."""
_PAIR_SHIFTS = (0, 1, 0, 2, 0, 3, 0, 4, 0, 5, 0, 6, 0, 7, 0, 8)
_PAIR_ROUNDS = 6
"""The refinement's pair rounds and the rotation of each (see _refine)."""
_HEAVIEST_ROUNDS = 8
"""Bound on the heaviest-pack rounds, each lowering one pack per layer. Both counts
are bounded by the placement's time budget, not by convergence (at 48 x 128 x EP64,
1 redundant per rank, more rounds still help a little); each round costs some
0.2-0.4 ms there on a 2-core EPYC, mostly numpy's per-call cost."""


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


def initial_placement(num_layers: int, num_experts: int, spec: PlacementSpec) -> Placement:
    """The placement an expert-parallel instance starts on, before any load is known:
    physical slot s holds expert s % num_experts, so experts 0 .. R-1 get the R redundant
    slots (vLLM starts the same way). Every later placement has the same slots per
    rank: the memory the experts take never changes."""
    spec.check(num_experts)
    slots = np.arange(spec.num_slots(num_experts), dtype=np.int64) % num_experts
    phy_to_log = np.broadcast_to(slots, (num_layers, slots.shape[0])).copy()
    return _finish(phy_to_log, num_experts, spec.num_ranks, Policy.STATIC)


def with_layer(placement: Placement, layer: int, slots: np.ndarray) -> Placement:
    """``placement`` with layer ``layer``'s slot map replaced by ``slots`` (a placement
    applied layer by layer passes through these)."""
    phy_to_log = placement.phy_to_log.copy()
    phy_to_log[layer] = slots
    return _finish(phy_to_log, placement.num_experts, placement.num_ranks, placement.policy)


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

    rows = num_layers * nodes
    if policy is Policy.HIERARCHICAL:
        per_group = num_experts // spec.num_groups
        group_load = load.reshape(num_layers, spec.num_groups, per_group).sum(-1)
        node_groups = _pack(group_load, nodes)  # [layers, nodes, groups per node]
        node_experts = (node_groups[..., None] * per_group + np.arange(per_group)).reshape(rows, -1)
        local_load = _take_rows(load, node_experts.reshape(num_layers, -1)).reshape(rows, -1)
    else:
        node_experts = None  # one node: local expert numbers are the logical ones
        local_load = load
    # From here on a row is one (layer, node), its experts numbered locally.
    slots_per_node = spec.num_slots(num_experts) // nodes
    counts = _replicate(local_load, slots_per_node)
    local_experts = local_load.shape[1]
    # Every row's counts sum to slots_per_node, so one flat repeat reshapes into rows.
    items = np.repeat(np.tile(np.arange(local_experts), rows), counts.ravel()).reshape(rows, slots_per_node)
    weights = _take_rows(local_load / counts, items)
    # [rows, ranks per node, slots]: the (local) expert in each slot.
    logical = _pack(weights, spec.num_ranks // nodes, keys=items).reshape(rows, -1)
    if node_experts is not None:
        logical = _take_rows(node_experts, logical)
    return _finish(logical.reshape(num_layers, -1), num_experts, spec.num_ranks, policy)


def _take_rows(values: np.ndarray, index: np.ndarray) -> np.ndarray:
    """np.take_along_axis(values, index, axis=1) for 2-D arrays, as one take on the flat
    array (take_along_axis costs tens of microseconds of Python per call)."""
    rows, width = values.shape
    return values.ravel().take(index + (np.arange(rows) * width)[:, None])


def _argsort_rows(x: np.ndarray, descending: bool = False) -> np.ndarray:
    """np.argsort(x, axis=1, kind="stable") for x >= 0 [rows, n], except that values
    equal but for the last log2(n) bits of their 52-bit mantissa count as ties (a
    relative 2**-44 at n = 256), kept in index order. numpy's argsort of short rows is
    a scalar sort, its sort a SIMD one three times faster: this sorts keys that carry
    each value's index in the mantissa's low bits (nonnegative floats order as their
    bits do) and reads the index back."""
    rows, n = x.shape
    bits = max(1, (n - 1).bit_length())
    if bits > 16:
        return np.argsort(-x if descending else x, axis=1, kind="stable")
    mask = (1 << bits) - 1
    index = np.arange(n)
    keys = (np.ascontiguousarray(x, dtype=np.float64).view(np.int64) & ~mask) | (mask - index if descending else index)
    keys = np.sort(keys.view(np.float64), axis=1).view(np.int64) & mask
    return mask - keys[:, ::-1] if descending else keys


def _replicate(load: np.ndarray, num_slots: int) -> np.ndarray:
    """Replica counts [rows, experts] summing to num_slots per row: one each, then each
    spare slot to the highest load per replica (the D'Hondt rule, greedy). The greedy's
    c-th extra replica of expert e is the quotient load_e / c, and it takes the `spare`
    largest quotients of all. Every quotient >= 1/u, for a u > 0, is floor(load_e * u)
    extras of expert e, a top set of the quotients; their number f(u) grows with u,
    almost linearly. Regula falsi on u, from f(spare / total) <= spare <= f((spare +
    experts) / total) (Illinois' variant), leaves a few extras per row; the greedy,
    started from the lower top set, gives them one by one, for all rows at once."""
    rows, experts = load.shape
    spare = num_slots - experts
    counts = np.ones((rows, experts), dtype=np.int64)
    if spare <= 0:
        return counts
    total = load.sum(1)
    # Illinois' regula falsi on g(u) = f(u) - spare - 1/2, kept bracketed: g(lo) < 0 < g(hi).
    lo, hi = spare / total, (spare + experts) / total
    g_lo = np.floor(load * lo[:, None]).sum(1) - (spare + 0.5)
    g_hi = np.floor(load * hi[:, None]).sum(1) - (spare + 0.5)
    kept_lo = np.zeros(rows, dtype=bool)  # the side kept last step
    kept_hi = np.zeros(rows, dtype=bool)
    for _ in range(_THRESHOLD_STEPS):
        u = lo - g_lo * (hi - lo) / (g_hi - g_lo)
        g = np.floor(load * u[:, None]).sum(1) - (spare + 0.5)
        below = g < 0
        # The side kept twice in a row has its g halved, so the next step leans past it.
        np.multiply(g_hi, 0.5, out=g_hi, where=below & kept_hi)
        np.multiply(g_lo, 0.5, out=g_lo, where=~below & kept_lo)
        np.copyto(lo, u, where=below)
        np.copyto(g_lo, g, where=below)
        np.copyto(hi, u, where=~below)
        np.copyto(g_hi, g, where=~below)
        kept_hi, kept_lo = below, ~below
    counts += np.floor(load * lo[:, None]).astype(np.int64)
    left = num_slots - counts.sum(1)
    while (add := np.flatnonzero(left > 0)).size:
        pick = np.argmax(load[add] / counts[add], axis=1)  # the largest quotient not yet taken
        counts[add, pick] += 1
        left[add] -= 1
    return counts


def _pack(weights: np.ndarray, num_packs: int, keys: np.ndarray | None = None) -> np.ndarray:
    """Items [rows, items] into num_packs packs of equal size, balanced: the keys of each
    pack's items, [rows, packs, items / packs] (their item indices where keys is None).
    Items with equal keys (replicas of one expert) share a pack only where that cannot
    be avoided (more replicas than packs)."""
    rows, num_items = weights.shape
    per_pack = num_items // num_packs
    row_ids = np.arange(rows)[:, None]
    apart = keys is not None
    # Rounds of num_packs items, heaviest first; in each round the heaviest item goes to
    # the lightest pack so far (LPT under the equal-count constraint).
    order = _argsort_rows(weights, descending=True)
    sorted_w = _take_rows(weights, order)
    sorted_k = _take_rows(keys, order) if apart else order
    # Slot-first, [per_pack, rows, packs]: the pack axis last, so that numpy's inner
    # loops run along it (broadcasting over a last axis of 2-4 slots is ten times
    # slower). Each slot's item weight and key, moved together; in float32 and 16-bit
    # keys where they fit: the refinement compares sums of a few weights, float32
    # decides as well, and halves what its arithmetic reads.
    key_type = np.int16 if sorted_k.max() < 2**15 else np.int64
    pack_w = np.empty((per_pack, rows, num_packs), dtype=np.float32)
    pack_k = np.empty((per_pack, rows, num_packs), dtype=key_type)
    pack_load = np.zeros((rows, num_packs))
    for j in range(per_pack):
        round_ = slice(j * num_packs, (j + 1) * num_packs)
        if j == 0:  # all packs empty: the stable order is the packs' own
            pack_w[0], pack_k[0], pack_load[:] = sorted_w[:, round_], sorted_k[:, round_], sorted_w[:, round_]
            continue
        targets = _argsort_rows(pack_load)
        # Only an expert whose run of replicas began in the round before can meet its
        # own replicas here (see _keep_replicas_apart): none crosses, nothing to check.
        if apart and (sorted_k[:, round_.start - 1] == sorted_k[:, round_.start]).any():
            targets = _keep_replicas_apart(targets, sorted_k[:, round_], pack_k[:j])
        pack_w[j, row_ids, targets] = sorted_w[:, round_]
        pack_k[j, row_ids, targets] = sorted_k[:, round_]
        pack_load[row_ids, targets] += sorted_w[:, round_]
    if per_pack > 0 and num_packs > 1:
        _refine(pack_w, pack_k, apart)
    return pack_k.transpose(1, 2, 0).astype(np.int64)


def _keep_replicas_apart(targets: np.ndarray, chosen_keys: np.ndarray, earlier_keys: np.ndarray) -> np.ndarray:
    """A round's pack for each of its items, changed so that no item joins a pack that
    already holds its expert. Items are sorted by weight and an expert's replicas weigh
    the same, so they are one run: only the run that began in the round before can meet
    its own replicas, and it leads this round. Those of its items aimed at a pack that
    holds it trade packs with the round's first items aimed at packs that do not."""
    lead = chosen_keys[:, :1]
    held = earlier_keys[0] == lead  # earlier_keys [slots so far, rows, packs]
    for i in range(1, earlier_keys.shape[0]):
        held |= earlier_keys[i] == lead
    holds_lead = _take_rows(held, targets)
    in_run = np.logical_and.accumulate(chosen_keys == lead, axis=1)
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


def _pair_max(w_src: np.ndarray, w_dst: np.ndarray, k_src: np.ndarray, k_dst: np.ndarray, top: np.ndarray,
              low: np.ndarray, apart: bool, out: tuple[np.ndarray, np.ndarray], dst_is_fresh: bool = True) -> np.ndarray:
    """[a, b, n]: for n pairs (src pack, dst pack), the heavier of the two packs' loads
    after src's item a and dst's item b trade places. w_src and w_dst [slots, n] are the
    items' weights, k_src and k_dst their keys, top and low [n] the packs' loads. The
    pairs (of all rows) are the last axis, long, so that numpy's inner loops run along
    it. apart: a trade that would put an item beside a replica of its own expert is
    refused, as +inf (so is two replicas of one expert trading places, which changes
    nothing). out: two flat buffers of at least slots**2 * n, the result is a view of
    the second (fresh arrays this size cost more in page faults than in arithmetic)."""
    per_pack, n = w_dst.shape
    if apart:
        same = k_src[:, None, :] == k_dst[None, :, :]  # [a, b, n]
        a_joins, b_joins = same[:, 0], same[0]  # or-ed out over the slots: .any() is slower
        for j in range(1, per_pack):
            a_joins, b_joins = a_joins | same[:, j], b_joins | same[j]
        # An infinite weight makes the trade's delta, and so its pair max, infinite.
        # w_src is always a fresh array here, w_dst only where dst_is_fresh.
        np.copyto(w_src, np.inf, where=a_joins)  # a replica of src's item a is in dst
        if dst_is_fresh:
            np.copyto(w_dst, -np.inf, where=b_joins)  # one of dst's item b is in src
        else:
            w_dst = np.where(b_joins, -np.inf, w_dst)
    shape = (per_pack, per_pack, n)
    size = per_pack * per_pack * n
    delta, pair_max = out[0][:size].reshape(shape), out[1][:size].reshape(shape)
    # src's item a for dst's item b: src changes by b - a, dst by a - b.
    np.subtract(w_src[:, None, :], w_dst[None, :, :], out=delta)
    np.subtract(top, delta, out=pair_max)
    np.add(low, delta, out=delta)
    return np.maximum(pair_max, delta, out=pair_max)


def _swap(cells: tuple[np.ndarray, ...], at_src: np.ndarray, at_dst: np.ndarray) -> None:
    """Each array's flat cells at_src and at_dst trade values."""
    for c in cells:
        flat = c.reshape(-1)
        flat[at_src], flat[at_dst] = flat[at_dst], flat[at_src]


def _slot_sum(w: np.ndarray) -> np.ndarray:
    """[per_pack, rows, packs] -> [rows, packs], written out over the slots."""
    total = w[0].copy()
    for j in range(1, w.shape[0]):
        total += w[j]
    return total


def _refine(w_all: np.ndarray, k_all: np.ndarray, apart: bool) -> None:
    """Trades of one item for one between two packs, each lowering the heavier of the
    two (by more than _MIN_GAIN), so that no pack's load ever rises above the heavier
    one's before: the rounds place items by weight order alone, this looks at the sums.
    w_all and k_all [per_pack, rows, packs] (slot-first: a slot's plane of all rows'
    packs is one flat stretch, and the candidates of all rows one long axis), traded in
    place.

    First pair rounds: the packs sorted by load, the k-th heaviest meets the
    (k + shift)-th lightest (shift from _PAIR_SHIFTS, one per round, so that a heavy
    pack the lightest could not help meets others), every pair making its best trade
    at once. Then heaviest rounds: each row's heaviest pack makes its best trade with
    any pack, the one that lowers the max, while one helps.

    Every row goes through every round (a row with nothing to trade costs arithmetic
    only; numpy's per-call cost, not the arithmetic, is what these shapes pay for)."""
    per_pack, rows, num_packs = w_all.shape
    half = num_packs // 2
    cells = (w_all, k_all)
    flat_w, flat_k = w_all.reshape(-1), k_all.reshape(-1)
    plane = rows * num_packs
    slot_off = (np.arange(per_pack) * plane)[:, None]
    pack_base = (np.arange(rows) * num_packs)[:, None]
    scratch = tuple(np.empty(per_pack * per_pack * plane, dtype=w_all.dtype) for _ in range(2))
    # Per round, the columns of the packs sorted by load: the lightest half, rotated by
    # the round's shift, then the heaviest half, heaviest first.
    heaviest = np.arange(num_packs - 1, num_packs - 1 - half, -1)
    picks = [np.concatenate([(np.arange(half) + shift) % half, heaviest]) for shift in _PAIR_SHIFTS[:_PAIR_ROUNDS]]
    for pick in picks if half else ():
        loads = _slot_sum(w_all).reshape(-1)
        packs = _argsort_rows(loads.reshape(rows, num_packs))[:, pick] + pack_base  # flat in a plane: dst then src
        dst, src = packs[:, :half].ravel(), packs[:, half:].ravel()
        top = loads.take(src)
        at_src, at_dst = slot_off + src, slot_off + dst
        pair_max = _pair_max(flat_w.take(at_src), flat_w.take(at_dst), flat_k.take(at_src), flat_k.take(at_dst),
                             top, loads.take(dst), apart, scratch).reshape(per_pack * per_pack, -1)
        # The best trade's index only where it helps.
        c = np.flatnonzero(pair_max.min(0) < top * (1 - _MIN_GAIN))
        if not len(c):
            continue
        a, b = np.divmod(pair_max[:, c].argmin(0), per_pack)
        _swap(cells, a * plane + src[c], b * plane + dst[c])
    all_rows = np.arange(rows)
    for _ in range(_HEAVIEST_ROUNDS):
        loads = _slot_sum(w_all)
        heavy = loads.argmax(1) + pack_base[:, 0]  # flat in a plane
        top = loads.reshape(-1).take(heavy)
        at = slot_off + heavy
        # The heaviest pack of each row against every pack of its row (itself too: delta
        # 0 or a clash, never "better").
        pair_max = _pair_max(np.repeat(flat_w.take(at), num_packs, axis=1), w_all.reshape(per_pack, -1),
                             np.repeat(flat_k.take(at), num_packs, axis=1), k_all.reshape(per_pack, -1),
                             np.repeat(top, num_packs), loads.reshape(-1), apart, scratch, dst_is_fresh=False)
        pair_max = pair_max.reshape(per_pack * per_pack, rows, num_packs)
        lowest = pair_max.min(0)  # [rows, packs]
        partner = lowest.argmin(1)
        r = np.flatnonzero(lowest[all_rows, partner] < top * (1 - _MIN_GAIN))
        if not len(r):
            break
        a, b = np.divmod(pair_max[:, r, partner[r]].argmin(0), per_pack)
        _swap(cells, a * plane + heavy[r], b * plane + pack_base[r, 0] + partner[r])


def _finish(phy_to_log: np.ndarray, num_experts: int, num_ranks: int, policy: Policy) -> Placement:
    """The reverse map and the counts, from the slot map."""
    num_layers, num_slots = phy_to_log.shape
    flat = (phy_to_log + (np.arange(num_layers) * num_experts)[:, None]).ravel()
    counts = np.bincount(flat, minlength=num_layers * num_experts).reshape(num_layers, num_experts)
    assert (counts >= 1).all(), "a placement lost an expert"
    # Slots grouped by expert (stable: ascending within one); a slot's index among its
    # expert's replicas is its position minus where the expert's run starts. A stable
    # sort of 16-bit keys is a radix sort, several times faster than a 64-bit one.
    small = np.int16 if num_experts < 2**15 else np.int64
    order = np.argsort(phy_to_log.astype(small), axis=1, kind="stable")
    expert_of = _take_rows(phy_to_log, order)
    starts = np.cumsum(counts, axis=1) - counts
    within = np.arange(num_slots) - _take_rows(starts, expert_of)
    width = int(counts.max())
    log_to_phy = np.full((num_layers, num_experts, width), -1, dtype=np.int64)
    log_to_phy.reshape(-1)[(expert_of + (np.arange(num_layers) * num_experts)[:, None]) * width + within] = order
    return Placement(phy_to_log, log_to_phy, counts, num_ranks, num_slots // num_ranks, policy)
