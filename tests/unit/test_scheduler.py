"""Scheduling decisions with exact assertions. The sampled tokens are inputs
here: these tests check the scheduler, the model is checked elsewhere."""

import pytest

from shared.engine.request import Request, RequestStatus
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import Scheduler, SchedulerConfig
from shared.kv.memory.coordinator import KVCacheCoordinator
from shared.kv.spec import kv_cache_layout


def make_scheduler(num_blocks=64, block_size=4, **cfg) -> Scheduler:
    cfg.setdefault("max_model_len", 64)
    config = SchedulerConfig(**{**dict(max_num_seqs=64, max_num_batched_tokens=2048, prefill_chunk_size=512), **cfg})
    return Scheduler(config, KVCacheCoordinator(kv_cache_layout([None]), num_blocks, block_size, "fp"))


def req(rid: str, n: int, max_tokens: int = 4, base: int = 0, **kw) -> Request:
    return Request(rid, [base + i for i in range(n)], SamplingParams(max_tokens=max_tokens, **kw))


def step(s: Scheduler, token: int = 7):
    out = s.schedule()
    sampled = {c.request_id: [token] for c in out.chunks if c.sample}
    s.update_from_output(out, sampled)
    return out


def test_prompt_is_prefilled_in_chunks_and_sampled_once_complete():
    s = make_scheduler(max_num_batched_tokens=4, prefill_chunk_size=4)
    s.add_request(req("a", 10))
    shapes = []
    for _ in range(4):
        out = step(s)
        shapes += [(c.start_pos, len(c.token_ids), c.sample) for c in out.chunks]
    assert shapes == [(0, 4, False), (4, 4, False), (8, 2, True), (10, 1, True)]


def test_prompts_are_chunked_only_while_others_decode():
    """A step of prompts alone takes the whole budget (a long prompt's TTFT is one
    big efficient step); once a request decodes, prompts go in chunks of
    prefill_chunk_size, so its next token waits for one chunk at most."""
    s = make_scheduler(max_num_batched_tokens=32, prefill_chunk_size=4)
    s.add_request(req("a", 20))
    assert [(c.start_pos, len(c.token_ids)) for c in step(s).chunks] == [(0, 20)]
    s.add_request(req("b", 10, base=100))
    shapes = [[(c.request_id, c.start_pos, len(c.token_ids)) for c in step(s).chunks] for _ in range(3)]
    assert shapes == [
        [("a", 20, 1), ("b", 0, 4)],
        [("a", 21, 1), ("b", 4, 4)],
        [("a", 22, 1), ("b", 8, 2)],
    ]


def test_a_request_whose_last_token_is_in_flight_does_not_cut_prompts_into_chunks():
    """Async scheduling plans step N+1 before step N's tokens are back. On a
    prefill instance (max_tokens 1) the request sampled in step N is then
    finishing, not decoding: the next prompt still gets the whole budget (H200,
    16 clients of 8k: counting it as decoding halved the prefill instance's rate)."""
    s = make_scheduler(max_num_batched_tokens=32, prefill_chunk_size=4)
    s.add_request(req("a", 20, max_tokens=1))
    s.add_request(req("b", 20, max_tokens=1, base=100))
    first = s.schedule()  # a in full, b gets what is left of the budget
    assert [(c.request_id, c.start_pos, len(c.token_ids)) for c in first.chunks] == [("a", 0, 20), ("b", 0, 12)]
    second = s.schedule()  # a's token is still on the device: b's rest in one chunk
    assert [(c.request_id, c.start_pos, len(c.token_ids)) for c in second.chunks] == [("b", 12, 8)]
    # A request that will decode on does cut prompts into chunks.
    s = make_scheduler(max_num_batched_tokens=32, prefill_chunk_size=4)
    s.add_request(req("a", 20, max_tokens=5))
    s.schedule()
    s.add_request(req("b", 20, base=100))
    assert [(c.request_id, len(c.token_ids)) for c in s.schedule().chunks] == [("a", 1), ("b", 4)]


def test_decode_goes_first_and_prefill_fills_the_token_budget():
    s = make_scheduler(max_num_batched_tokens=6, prefill_chunk_size=8)
    s.add_request(req("a", 3))
    step(s)  # a prefilled, now decoding
    s.add_request(req("b", 12, base=100))
    out = step(s)
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("a", 1), ("b", 5)]
    out = step(s)
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("a", 1), ("b", 5)]


def test_max_num_seqs_limits_the_running_batch():
    s = make_scheduler(max_num_seqs=2)
    for i in range(3):
        s.add_request(req(f"r{i}", 3, base=10 * i))
    out = step(s)
    assert [c.request_id for c in out.chunks] == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_preemption_when_blocks_run_out_then_everything_finishes():
    # 6 blocks of 4 = 24 tokens; two requests of 10 prompt + 8 output need 10 blocks.
    s = make_scheduler(num_blocks=6, block_size=4, max_model_len=24)
    a, b = req("a", 10, max_tokens=8), req("b", 10, max_tokens=8, base=50)
    s.add_request(a)
    s.add_request(b)
    preempted: list[str] = []
    finished: dict[str, RequestStatus] = {}
    for _ in range(100):
        if not s.num_unfinished:
            break
        out = step(s)
        preempted += sorted(out.preempted_request_ids)
        for r in (a, b):
            if r.status.is_finished:
                finished[r.request_id] = r.status
        # Blocks held by the running requests and free blocks always add up to the pool.
        held = sum(len(s.kv.block_ids(r.request_id)[0]) for r in s.running)
        assert held + s.kv.pool.num_free_blocks == 6
    assert preempted and preempted[0] == "b"  # the youngest is preempted first
    assert finished == {"a": RequestStatus.FINISHED_LENGTH, "b": RequestStatus.FINISHED_LENGTH}
    assert b.num_preemptions >= 1
    assert len(a.output_token_ids) == len(b.output_token_ids) == 8
    assert s.kv.pool.num_free_blocks == 6


def test_preempted_request_recomputes_prompt_and_output():
    s = make_scheduler(num_blocks=6, block_size=4, max_model_len=24)
    a, b = req("a", 10, max_tokens=8), req("b", 10, max_tokens=8, base=50)
    s.add_request(a)
    s.add_request(b)
    while b.status != RequestStatus.PREEMPTED:
        step(s)
    num_out = b.num_output_tokens
    while b.status != RequestStatus.RUNNING:
        out = step(s)
    chunk = next(c for c in out.chunks if c.request_id == "b")
    # Recompute covers prompt + already generated tokens (minus a prefix hit).
    assert chunk.start_pos + len(chunk.token_ids) == 10 + num_out
    assert chunk.token_ids[-num_out:] == b.output_token_ids[:num_out]


def test_eos_stop_tokens_and_min_tokens():
    s = make_scheduler()
    r = Request("a", [1, 2, 3], SamplingParams(max_tokens=10, min_tokens=2), eos_token_ids=frozenset({7}))
    s.add_request(r)
    step(s, token=7)  # EOS before min_tokens: ignored
    assert not r.status.is_finished
    step(s, token=7)
    assert r.status == RequestStatus.FINISHED_STOPPED
    r2 = req("b", 3, max_tokens=10, stop_token_ids=[9])
    s.add_request(r2)
    step(s, token=9)
    assert r2.status == RequestStatus.FINISHED_STOPPED and r2.stop_reason == 9
    r3 = Request("c", [1], SamplingParams(max_tokens=3, ignore_eos=True), eos_token_ids=frozenset({7}))
    s.add_request(r3)
    for _ in range(3):
        step(s, token=7)
    assert r3.status == RequestStatus.FINISHED_LENGTH and r3.output_token_ids == [7, 7, 7]


def test_abort_frees_blocks_and_reports_to_runner():
    s = make_scheduler()
    s.add_request(req("a", 9))
    step(s)
    assert s.kv.pool.num_free_blocks < 64
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert s.kv.pool.num_free_blocks == 64
    assert s.schedule().finished_request_ids == {"a"}
    # An abort racing a normal finish: the second changes nothing and is not reported again.
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert s.kv.pool.num_free_blocks == 64
    assert s.schedule().finished_request_ids == set()


def test_rejects_prompt_longer_than_model_len_and_undersized_cache():
    s = make_scheduler(max_model_len=16)
    with pytest.raises(ValueError, match="at most 16 tokens"):
        s.add_request(req("a", 16))
    with pytest.raises(ValueError, match="could never fit"):
        make_scheduler(num_blocks=2, block_size=4, max_model_len=16)


def test_a_replayed_request_carries_its_floor_only_while_a_window_can_see_past_it():
    kv = KVCacheCoordinator(kv_cache_layout([None, 8]), 64, 4, "fp", swa_replay="bounded")
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4, prefill_chunk_size=4, max_model_len=64), kv)
    # The full group holds the first 5 blocks (20 tokens) as if loaded from kvcache; no sliding state.
    r = req("a", 22, max_tokens=4)
    kv.update_block_hashes(r)
    blocks = kv.pool.allocate(5)
    assert blocks is not None
    for i, b in enumerate(blocks):
        kv.pool.cache_block(b, r.block_hashes[i], 0, tuple(r.all_token_ids[i * 4 : (i + 1) * 4]))
    kv.pool.free(blocks)
    s.add_request(r)
    chunks = [step(s).chunks[0] for _ in range(4)]
    # Replay from 20 - 8 = 12 in chunks of 4: sliding KV only below 20, and no key below 12 for a
    # query that could see one (p - 7 < 12, i.e. p <= 18); then the prompt's tail and a decode step.
    assert [(c.start_pos, c.replay_until, c.sliding_floor) for c in chunks] == [
        (12, 20, 12), (16, 20, 12), (20, 0, 0), (22, 0, 0)
    ]
    assert r.num_cached_tokens == 20 and r.num_replayed_tokens == 8
