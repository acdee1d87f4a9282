"""Data-parallel attention's scheduling (shared/engine/dp_scheduler.py) with exact
assertions, on the CPU: which rank each request goes to, that it stays there, that an
idle rank pads while another runs, and that each rank's step carries that rank's own
block ids. The sampled tokens are inputs here; the model is checked by
tests/parity/test_data_parallel_engine.py."""

import pytest

from shared.engine.dp_scheduler import DataParallelScheduler
from shared.engine.request import Request, RequestStatus
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import Scheduler, SchedulerConfig
from shared.kv.memory.coordinator import KVCacheCoordinator
from shared.kv.spec import kv_cache_layout

BLOCK = 4


def make(num_ranks: int = 2, num_blocks: int = 64, max_model_len: int = 64) -> DataParallelScheduler:
    config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048, prefill_chunk_size=512,
                             max_model_len=max_model_len)  # fmt: skip
    return DataParallelScheduler([
        Scheduler(config, KVCacheCoordinator(kv_cache_layout([None]), num_blocks, BLOCK, "fp"))
        for _ in range(num_ranks)
    ])  # fmt: skip


def req(rid: str, n: int, max_tokens: int = 4, base: int = 0) -> Request:
    return Request(rid, [base + i for i in range(n)], SamplingParams(max_tokens=max_tokens))


def step(s: DataParallelScheduler, token: int = 7):
    out = s.schedule()
    s.update_from_output(out, {c.request_id: [token] for c in out.chunks if c.sample})
    return out


def run_all(s: DataParallelScheduler) -> None:
    for _ in range(200):
        if not s.num_unfinished:
            return
        step(s)
    raise AssertionError("requests did not finish")


def test_requests_go_to_the_least_loaded_rank_and_stay_there() -> None:
    s = make()
    s.add_request(req("a", 20))
    s.add_request(req("b", 8, base=100))  # rank 0 holds (will hold) 20 KV tokens: rank 1
    s.add_request(req("c", 8, base=200))  # 20 against 8: rank 1 again
    s.add_request(req("d", 8, base=300))  # 20 against 16: rank 1 (24 vs 28 with it)
    s.add_request(req("e", 8, base=400))  # 20 against 24: rank 0
    assert s.rank_of == {"a": 0, "b": 1, "c": 1, "d": 1, "e": 0}
    out = step(s)
    assert [sorted(c.request_id for c in part.chunks) for part in out.ranks] == [["a", "e"], ["b", "c", "d"]]
    assert sorted(c.request_id for c in out.chunks) == ["a", "b", "c", "d", "e"]  # the step's lists: both ranks'
    assert [[n.request_id for n in part.new_requests] for part in out.ranks] == [["a", "e"], ["b", "c", "d"]]
    assert s.num_running_per_rank == [2, 3]
    run_all(s)
    assert s.rank_of == {} and s.num_unfinished == 0


def test_a_rank_of_long_decoding_requests_counts_as_loaded() -> None:
    """Balance is by KV tokens held, not by tokens left to compute: a rank whose requests
    decode (one token a step each) over long contexts is still the busier one."""
    s = make()
    s.add_request(req("long", 30, max_tokens=20))
    s.add_request(req("short", 4, max_tokens=20, base=100))
    for _ in range(3):
        step(s)
    assert s.rank_of == {"long": 0, "short": 1}
    s.add_request(req("next", 8, base=200))  # 33 KV tokens on rank 0, 7 on rank 1; 1 to compute on each
    assert s.rank_of["next"] == 1


def test_each_ranks_step_carries_block_ids_of_its_own_pool() -> None:
    """Both ranks' pools hand out their first blocks: the same ids on two ranks name two caches."""
    s = make()
    s.add_request(req("a", 8))
    s.add_request(req("b", 8, base=100))
    out = s.schedule()
    first = s.ranks[0].kv.block_ids("a")
    assert len(first[0]) == 2 and s.ranks[1].kv.block_ids("b") == first
    assert [part.chunks[0].block_ids for part in out.ranks] == [first, first]
    assert [kv.kv.pool.num_free_blocks for kv in s.ranks] == [62, 62]


def test_an_idle_rank_pads_while_another_runs_and_nobody_pads_when_all_are_idle() -> None:
    s = make()
    assert not any(p.pad_forward for p in s.schedule().ranks)  # nothing anywhere: no forward at all
    s.add_request(req("a", 6, max_tokens=2))
    out = step(s)
    assert [p.is_empty for p in out.ranks] == [False, True]
    assert [p.pad_forward for p in out.ranks] == [False, True]
    run_all(s)
    out = s.schedule()
    assert [p.pad_forward for p in out.ranks] == [False, False] and out.is_empty


def test_a_repeated_prompt_goes_to_the_rank_that_caches_its_prefix() -> None:
    s = make()
    s.add_request(req("a", 17))
    s.add_request(req("b", 17, base=100))
    assert s.rank_of == {"a": 0, "b": 1}
    run_all(s)
    # Both ranks idle: a repeat of b costs 17 tokens on rank 0, 1 on rank 1 (its 4 blocks cached).
    again = req("b-again", 17, base=100)
    s.add_request(again)
    assert s.rank_of["b-again"] == 1
    step(s)
    assert again.num_cached_tokens == 16
    # Unless the holder is busier by more than the hit saves: then the idle rank computes it.
    run_all(s)
    s.add_request(req("long", 40, base=500))  # rank 0 (both idle: the lower rank)
    s.add_request(req("a-again", 17))  # rank 0 holds a's 16 tokens but 40 queued: 41 vs 17 on rank 1
    assert s.rank_of["long"] == 0 and s.rank_of["a-again"] == 1


def test_preemption_stays_on_the_rank_and_every_request_finishes() -> None:
    """Two requests too big for one rank's 6 blocks together: pinned to that rank by
    their prefix, one is preempted and recomputed there, never moved."""
    s = make(num_blocks=6, max_model_len=24)
    s.add_request(req("a", 10, max_tokens=8))
    s.add_request(req("b", 10, max_tokens=8, base=50))
    assert s.rank_of == {"a": 0, "b": 1}
    s.ranks[1].add_request(req("c", 10, max_tokens=8, base=90))  # a third on rank 1, by hand: its pool is short
    s.rank_of["c"] = 1
    preempted: set[str] = set()
    for _ in range(100):
        if not s.num_unfinished:
            break
        out = step(s)
        preempted |= out.preempted_request_ids
        assert s.rank_of.get("c", 1) == 1 and s.rank_of.get("b", 1) == 1
    assert preempted == {"c"} and s.num_preemptions >= 1
    assert [sch.kv.pool.num_free_blocks for sch in s.ranks] == [6, 6]


def test_an_abort_reaches_the_requests_rank() -> None:
    s = make()
    a, b = req("a", 8, max_tokens=10), req("b", 8, max_tokens=10, base=100)
    s.add_request(a)
    s.add_request(b)
    step(s)
    s.finish_request("b", RequestStatus.FINISHED_ABORTED)
    assert b.status == RequestStatus.FINISHED_ABORTED and "b" not in s.rank_of
    out = s.schedule()
    assert out.ranks[1].finished_request_ids == {"b"} and out.ranks[1].pad_forward
    s.finish_request("b", RequestStatus.FINISHED_ABORTED)  # twice, or after it finished: ignored
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(req("a", 3))
