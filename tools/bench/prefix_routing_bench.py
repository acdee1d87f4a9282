"""Prefill routing when every request shares one system prompt (issue 32, point 4): the
policy before (prefix first: the instance holding most of the prompt's leading blocks,
load counted only when nobody holds any) against Dynamo's KV-router cost (overlap weight
x blocks to compute + blocks queued, services/balancer/router/policies.py), and the cost
at weight 0 (load only) for the hit rate a cache-blind router keeps. A simulation: the
balancer's own objects (Registry, choose_prefill, Reservation) route a Poisson stream to
a simulated fleet of prefill instances. Each instance computes its FIFO queue at a fixed
rate of tokens per second (the prompt tokens its cache does not hold when the request
starts; one instance holds the system prompt when the load starts, as after the first
request of the day), stores the prompt's blocks in an LRU cache when done (a KV event to the
registry at once) and beats every interval with its queued tokens (whole prompts, as a
worker counts them); between two beats the
balancer knows only what it dispatched itself (Reservation, counted off when the prompt
is done, as decode's first token tells the service).

    python -m tools.bench.prefix_routing_bench --out docs/perf/prefix_routing_sim_2026-12-07.txt

Prints, per policy and seed, the requests each instance got after the warm-up, max/even
(the busiest instance's count over the mean: the target is <= 1.5), the prefix hit rate
(prompt tokens found in the instance's cache when the request started, over all prompt
tokens; the ceiling is system/(system + user)), how many requests computed the system
prompt (found it in no cache; over the whole run, the warm-up too), and the time from arrival to the prompt
computed (TTFT without decode), p50 and p99."""

import argparse
import heapq
import random
import statistics
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from services.balancer.router.policies import Choice, choose_prefill, leading_blocks_held
from services.balancer.router.registry import Instance, Registry
from services.balancer.router.reservations import Reservation
from shared.engine.outputs import queued_prompt_tokens
from shared.kv.block_hash import BlockHash, hash_block_chain
from shared.proto import mesh_pb2
from tools.bench.raw_file import add_json_flag, tee_stdout, write_rows

Policy = Callable[[Sequence[Instance], Sequence[BlockHash], int, int, random.Random], Choice]


def prefix_first(
    candidates: Sequence[Instance], hashes: Sequence[BlockHash], prompt_tokens: int, block_size: int,
    rng: random.Random,
) -> Choice:
    """The policy before issue 32 (a89bc47's choose_prefill), for comparison only: most
    leading blocks held wins outright; with none held anywhere, the least queued tokens
    plus requests sent since the heartbeat."""
    held = {c.instance_id: leading_blocks_held(c, hashes) for c in candidates}
    if max(held.values()) > 0:
        best = max(held.values())
        return Choice(rng.choice([c for c in candidates if held[c.instance_id] == best]), "prefix",
                      {k: float(v) for k, v in held.items()}, held)  # fmt: skip
    load = {c.instance_id: float(c.load.num_queued_tokens + c.in_flight) for c in candidates}
    least = min(load.values())
    return Choice(rng.choice([c for c in candidates if load[c.instance_id] == least]), "least_loaded", load, held)


def kv_cost(weight: float) -> Policy:
    def policy(candidates, hashes, prompt_tokens, block_size, rng):  # noqa: ANN001, ANN202
        return choose_prefill(candidates, hashes, prompt_tokens, block_size, rng, weight)

    return policy


POLICIES: dict[str, Policy] = {
    "prefix-first (before)": prefix_first,
    "kv cost, weight 1 (after)": kv_cost(1.0),
    "kv cost, weight 0 (load only)": kv_cost(0.0),
}


@dataclass(frozen=True, slots=True)
class Workload:
    instances: int
    block_size: int
    system_tokens: int
    user_tokens: int
    tokens_per_s: float
    """Each instance's compute rate (prompt tokens per second)."""
    load: float
    """Arrivals as a fraction of the fleet's rate when every request hits the system prompt."""
    heartbeat_s: float
    cache_blocks: int
    duration_s: float
    warmup_s: float
    count_off: bool = True
    """Reservations counted off when the prompt is done (the service); False: only at the next heartbeat (before)."""

    @property
    def arrivals_per_s(self) -> float:
        return self.load * self.instances * self.tokens_per_s / self.user_tokens


@dataclass(slots=True)
class Job:
    arrival: float
    tokens: list[int]
    hashes: list[BlockHash]
    left: float = -1.0
    """Tokens still to compute (-1: not started: what its cache holds is read when it starts)."""
    hit_tokens: int = 0
    done: float = 0.0
    reservation: Reservation | None = None


@dataclass(slots=True)
class SimInstance:
    """A prefill instance: one FIFO computed at a fixed rate, an LRU block cache."""

    instance_id: str
    w: Workload
    queue: deque[Job] = field(default_factory=deque)
    cache: OrderedDict[BlockHash, None] = field(default_factory=OrderedDict)
    now: float = 0.0
    kv_seq: int = 0

    def _start(self, job: Job) -> None:
        held = 0
        for h in job.hashes:
            if h not in self.cache:
                break
            self.cache.move_to_end(h)
            held += 1
        job.hit_tokens = held * self.w.block_size
        job.left = float(len(job.tokens) - job.hit_tokens)

    def queued_tokens(self) -> int:
        """What its heartbeat reports: the whole prompt of each job not done, as a worker's
        engine counts it (queued_prompt_tokens)."""
        return sum(queued_prompt_tokens(len(job.tokens), 0) for job in self.queue)

    def run_until(self, t: float) -> list[tuple[float, Job, mesh_pb2.KvEvent]]:
        """Compute up to time t; the jobs finished, with their finish times and KV events
        (each stored as it finishes: the next one starts with its blocks there)."""
        done: list[tuple[float, Job, mesh_pb2.KvEvent]] = []
        while self.queue and self.now < t:
            job = self.queue[0]
            if job.left < 0:
                self._start(job)
            need = job.left / self.w.tokens_per_s
            if self.now + need > t:
                job.left -= (t - self.now) * self.w.tokens_per_s
                self.now = t
                return done
            self.now += need
            self.queue.popleft()
            done.append((self.now, job, self.store(job)))
        self.now = max(self.now, t)
        return done

    def store(self, job: Job) -> mesh_pb2.KvEvent:
        stored: list[bytes] = []
        for h in job.hashes:
            if h in self.cache:
                self.cache.move_to_end(h)
            else:
                self.cache[h] = None
                stored.append(h)
        removed: list[bytes] = []
        while len(self.cache) > self.w.cache_blocks:
            removed.append(self.cache.popitem(last=False)[0])
        self.kv_seq += 1
        return mesh_pb2.KvEvent(instance_id=self.instance_id, seq=self.kv_seq, stored=stored, removed=removed)


def max_over_even(counts: dict[str, int]) -> float:
    """The busiest instance's requests over the mean (1.0: even; the issue's target is <= 1.5)."""
    total = sum(counts.values())
    return max(counts.values()) / (total / len(counts)) if total else 0.0


@dataclass(slots=True)
class Result:
    counts: dict[str, int]
    hit_rate: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    system_misses: int
    """Requests, over the whole run (warm-up too), that found the system prompt in no cache and computed it."""

    @property
    def max_over_even(self) -> float:
        return max_over_even(self.counts)


def simulate(w: Workload, policy: Policy, seed: int) -> Result:
    """One run: the same arrivals and prompts for every policy at a seed."""
    arrivals = random.Random(seed)
    rng = random.Random(seed + 1)
    clock = [0.0]
    registry = Registry(misses=3, clock=lambda: clock[0])
    fleet = [SimInstance(f"prefill-{i}", w) for i in range(w.instances)]
    by_id = {inst.instance_id: inst for inst in fleet}
    beats = [(i * w.heartbeat_s / w.instances, i) for i in range(w.instances)]
    heapq.heapify(beats)
    seqs = Counter[str]()
    system = [arrivals.randrange(1, 30000) for _ in range(w.system_tokens)]
    finished: list[Job] = []
    counts = Counter[str]({inst.instance_id: 0 for inst in fleet})

    def beat(inst: SimInstance) -> None:
        seqs[inst.instance_id] += 1
        load = mesh_pb2.Load(num_queued_tokens=inst.queued_tokens(), num_waiting=len(inst.queue))
        registry.on_heartbeat(mesh_pb2.Heartbeat(
            stage="prefill", instance_id=inst.instance_id, seq=seqs[inst.instance_id], interval_s=w.heartbeat_s,
            load=load,
        ))  # fmt: skip

    def advance(t: float) -> None:
        while beats[0][0] <= t:
            tb, i = heapq.heappop(beats)
            for inst in fleet:
                run(inst, tb)
            clock[0] = tb
            beat(fleet[i])
            heapq.heappush(beats, (tb + w.heartbeat_s, i))
        for inst in fleet:
            run(inst, t)
        clock[0] = t

    def run(inst: SimInstance, t: float) -> None:
        for done, job, event in inst.run_until(t):
            registry.on_kv_event(event)
            job.done = done
            if w.count_off and job.reservation is not None:  # decode's first token reaches the balancer (attempt.py)
                job.reservation.done()
            finished.append(job)

    for inst in fleet:
        beat(inst)
    # The system prompt served once before the load starts (the day's first request): one
    # instance holds it, which is all prefix-first routing needs to send it everything.
    first = Job(0.0, system, hash_block_chain(system, w.block_size, "sim"))
    registry.on_kv_event(fleet[0].store(first))
    t = 0.0
    while True:
        t += arrivals.expovariate(w.arrivals_per_s)
        if t >= w.duration_s:
            break
        advance(t)
        tokens = system + [arrivals.randrange(1, 30000) for _ in range(w.user_tokens)]
        hashes = hash_block_chain(tokens, w.block_size, "sim")
        choice = policy(registry.live("prefill"), hashes, len(tokens), w.block_size, rng)
        inst = choice.instance
        # What dispatch.py reserves on the choice (the whole prompt, as the heartbeat counts
        # it) and keeps once the instance accepts (one request more): counted until the
        # prompt is done or the instance's next heartbeat.
        reservation = Reservation(inst, tokens=queued_prompt_tokens(len(tokens), 0))
        reservation.keep(requests=1)
        by_id[inst.instance_id].queue.append(Job(t, tokens, hashes, reservation=reservation))
        if t >= w.warmup_s:
            counts[inst.instance_id] += 1
    for inst in fleet:  # drain: no routing is left to beat for
        run(inst, float("inf"))
    measured = [job for job in finished if job.arrival >= w.warmup_s]
    ttft = sorted((job.done - job.arrival) * 1e3 for job in measured)
    hit = sum(job.hit_tokens for job in measured) / sum(len(job.tokens) for job in measured)
    misses = sum(job.hit_tokens < w.system_tokens for job in finished)
    return Result(dict(counts), hit, ttft[len(ttft) // 2], ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))], misses)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="prefix_routing_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--instances", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--system-tokens", type=int, default=1024, help="the system prompt every request shares")
    p.add_argument("--user-tokens", type=int, default=128, help="each request's own tokens after it")
    p.add_argument("--tokens-per-s", type=float, default=8000.0, help="each instance's prefill rate")
    p.add_argument("--load", type=float, default=0.7,
                   help="arrivals over the fleet's rate when every request hits the system prompt")
    p.add_argument("--heartbeat-s", type=float, default=0.5)
    p.add_argument("--cache-blocks", type=int, default=2048, help="each instance's KV cache, in blocks (LRU)")
    p.add_argument("--duration-s", type=float, default=30.0)
    p.add_argument("--warmup-s", type=float, default=5.0, help="requests arriving before this are not counted")
    p.add_argument("--seeds", type=int, default=5, help="repeats, each a new arrival stream and prompts")
    p.add_argument("--count-until-heartbeat", action="store_true",
                   help="keep what the balancer dispatched counted until the instance's next heartbeat, not until "
                        "the prompt is done (the reservations before issue 32)")
    p.add_argument("--out", help="the raw file (the printed output under raw_file's header)")
    add_json_flag(p)
    args = p.parse_args(argv)
    w = Workload(args.instances, args.block_size, args.system_tokens, args.user_tokens, args.tokens_per_s, args.load,
                 args.heartbeat_s, args.cache_blocks, args.duration_s, args.warmup_s,
                 not args.count_until_heartbeat)  # fmt: skip
    ceiling = args.system_tokens / (args.system_tokens + args.user_tokens)
    names = list(POLICIES)
    with tee_stdout(args.out):
        print(f"# simulated fleet: {w.instances} prefill instances at {w.tokens_per_s:g} prompt tokens/s each, "
              f"heartbeat {w.heartbeat_s} s, LRU cache {w.cache_blocks} blocks of {w.block_size}")
        print(f"# load: every prompt = the same {w.system_tokens}-token system prompt + {w.user_tokens} own tokens; "
              f"Poisson arrivals at {w.arrivals_per_s:.1f}/s (load {w.load}); {w.duration_s:g} s, first "
              f"{w.warmup_s:g} s not counted; hit-rate ceiling {ceiling:.3f}")
        print("# prefill-0 holds the system prompt when the load starts (it served it once before)")
        print("# dispatched load counted " + ("until the prompt is done" if w.count_off else
                                              "until the instance's next heartbeat (--count-until-heartbeat)"))
        print(f"# policies run side by side on the same arrivals per seed, their order rotated by seed")
        print(f"{'seed':>4} {'policy':<30} {'requests per instance':<28} {'max/even':>8} {'hit rate':>8} "
              f"{'TTFT p50 ms':>11} {'p99 ms':>9} {'system prompt computed':>22}")
        results: dict[str, list[Result]] = {name: [] for name in names}
        rows: list[dict] = []
        for seed in range(args.seeds):
            order = names[seed % len(names):] + names[: seed % len(names)]
            for name in order:
                r = simulate(w, POLICIES[name], seed)
                results[name].append(r)
                rows.append({"seed": seed, "policy": name, "requests_per_instance": dict(sorted(r.counts.items())),
                             "max_over_even": r.max_over_even, "hit_rate": r.hit_rate, "ttft_p50_ms": r.ttft_p50_ms,
                             "ttft_p99_ms": r.ttft_p99_ms, "system_prompt_computed": r.system_misses})  # fmt: skip
                per = " ".join(str(r.counts[k]) for k in sorted(r.counts))
                print(f"{seed:>4} {name:<30} {per:<28} {r.max_over_even:>8.2f} {r.hit_rate:>8.4f} "
                      f"{r.ttft_p50_ms:>11.1f} {r.ttft_p99_ms:>9.1f} {r.system_misses:>22}")
        print()
        print(f"# over {args.seeds} seeds: median [min - max]")
        print(f"{'policy':<30} {'max/even':<20} {'hit rate':<22} {'TTFT p50 ms':<24} {'p99 ms'}")
        for name in names:
            rs = results[name]

            def spread(values: list[float], fmt: str) -> str:
                return f"{statistics.median(values):{fmt}} [{min(values):{fmt}} - {max(values):{fmt}}]"

            print(f"{name:<30} {spread([r.max_over_even for r in rs], '.2f'):<20} "
                  f"{spread([r.hit_rate for r in rs], '.4f'):<22} {spread([r.ttft_p50_ms for r in rs], '.0f'):<24} "
                  f"{spread([r.ttft_p99_ms for r in rs], '.0f')}")
    write_rows(args.json, rows, workload=asdict(w), hit_rate_ceiling=ceiling)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
