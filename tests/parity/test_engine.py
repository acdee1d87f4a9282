"""The engine end to end on real (tiny, seeded) transformers checkpoints:
greedy generation equals transformers' `generate`; batching, chunked prefill,
prefix caching and preemption never change the tokens."""

import pytest
import torch

from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from tests.helpers.hf_models import hf_greedy, random_prompts, save_tiny_hf_model

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
NUM_NEW = 32


@pytest.fixture(scope="module", params=ARCHS)
def hf_checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_tiny_hf_model(request.param, path)
    return path


def test_greedy_generation_equals_transformers(hf_checkpoint):
    prompts = random_prompts([5, 17, 33, 9], vocab=500, seed=1)
    expected = hf_greedy(hf_checkpoint, prompts, NUM_NEW)
    # Small blocks and chunks so that prompts span blocks, prefill is chunked
    # and decode steps of some requests mix with prefill chunks of others.
    llm = LLM(str(hf_checkpoint), block_size=4, prefill_chunk_size=8, max_num_batched_tokens=24)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NUM_NEW, temperature=0.0))
    assert [o.token_ids for o in outs] == expected


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-engine")
    save_tiny_hf_model("llama", path)
    return str(path)


def test_batched_with_preemption_equals_one_at_a_time(llama):
    prompts = random_prompts([30, 12, 25, 7, 19, 40], vocab=500, seed=2)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = LLM(llama, block_size=4)
    expected = [alone.generate([p], params)[0].token_ids for p in prompts]
    # 24 blocks of 4 tokens cannot hold six requests of up to 64 tokens at once.
    tight = LLM(llama, block_size=4, num_kv_blocks=24, max_model_len=96, prefill_chunk_size=16)
    outs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == expected
    assert tight.engine.kv.pool.num_free_blocks == 24  # nothing leaked


def test_shared_prefix_reuses_blocks_and_gives_the_cold_output(llama):
    prefix = random_prompts([48], vocab=500, seed=3)[0]
    first, second = prefix + [11, 12, 13], prefix + [21, 22]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    cold = LLM(llama, block_size=8, enable_prefix_caching=False).generate([second], params)[0]

    warm = LLM(llama, block_size=8)
    warm.generate([first], params)
    computed_before = warm.engine.kv.num_hit_tokens
    out = warm.generate([second], params)[0]
    assert out.num_cached_tokens == 48  # six full blocks of the shared prefix
    assert warm.engine.kv.num_hit_tokens - computed_before == 48
    assert out.token_ids == cold.token_ids


def test_seeded_sampling_ignores_the_rest_of_the_batch(llama):
    seeded = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    prompt = random_prompts([10], vocab=500, seed=4)[0]
    alone = LLM(llama).generate([prompt], seeded)[0].token_ids
    others = random_prompts([5, 22, 13], vocab=500, seed=5)
    noise = SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)
    mixed = LLM(llama, seed=99).generate(others[:2] + [prompt] + others[2:], [noise, noise, seeded, noise])
    assert mixed[2].token_ids == alone
    other_seed = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=4321, ignore_eos=True)
    assert LLM(llama).generate([prompt], other_seed)[0].token_ids != alone


def test_logprobs_and_max_tokens(llama):
    prompt = random_prompts([6], vocab=500, seed=6)[0]
    out = LLM(llama).generate([prompt], SamplingParams(max_tokens=5, temperature=0.0, logprobs=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    # Greedy: the chosen token is the most likely one.
    assert all(lp.rank == 1 and lp.top[0][0] == lp.token_id and len(lp.top) == 3 for lp in out.logprobs)


def test_bad_requests_are_refused_clearly(llama):
    llm = LLM(llama, max_model_len=64)
    with pytest.raises(ValueError, match="at most 64 tokens"):
        llm.generate([list(range(3, 70))])
    with pytest.raises(ValueError, match=r"in \[0, "):
        llm.generate([[1, 2, 10**6]])
    with pytest.raises(ValueError, match="token ids"):
        llm.generate(["text needs a tokenizer"])
    assert not llm.engine.has_unfinished_requests()


def test_async_scheduling_gives_the_same_tokens(llama):
    """Step N+1 launched before step N's tokens are read back (placeholders
    filled on the device) must not change a single token: greedy, seeded,
    chunked prefill, preemption, and requests that end early."""
    prompts = random_prompts([30, 12, 25, 7, 19, 40], vocab=500, seed=12)
    params = [
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.9, top_p=0.8, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[7, 8, 9, 10, 11, 12]),
        SamplingParams(max_tokens=9, temperature=1.0, seed=9, ignore_eos=True),
    ]
    settings = dict(block_size=4, num_kv_blocks=24, max_model_len=96, prefill_chunk_size=16)
    step_by_step = LLM(llama, async_scheduling=False, **settings).generate(prompts, params)
    overlapped = LLM(llama, async_scheduling=True, **settings)
    outs = overlapped.generate(prompts, params)
    assert overlapped.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in step_by_step]
    assert [o.finish_reason for o in outs] == [o.finish_reason for o in step_by_step]
    assert overlapped.engine.kv.pool.num_free_blocks == 24


def _count_launches(llm: LLM) -> list[int]:
    """Counts the runner's overlapped launches (execute() is the step-by-step path)."""
    calls = [0]
    launch = llm.engine.runner.launch

    def counted(sched):  # noqa: ANN001, ANN202
        calls[0] += 1
        return launch(sched)

    llm.engine.runner.launch = counted
    return calls


def test_async_scheduling_keeps_host_side_masks_overlapped(llama):
    """min_tokens and bad words (masks made on the host) no longer turn overlap off: their
    steps launch, and sample once the step before is read back (tests/unit/test_overlap_masks.py)."""
    prompts = random_prompts([11, 23, 17], vocab=500, seed=13)
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, min_tokens=3, stop_token_ids=[7, 8, 9]),
        SamplingParams(max_tokens=12, temperature=0.8, seed=2, ignore_eos=True, bad_words_token_ids=[[5], [6, 7]]),
    ]
    sync = LLM(llama, async_scheduling=False).generate(prompts, params)
    overlapped = LLM(llama, async_scheduling=True)
    launches = _count_launches(overlapped)
    outs = overlapped.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in sync]
    assert launches[0] >= 12  # every step launched
    steps = overlapped.engine.load().steps
    assert steps.synchronous == 0 and steps.sampled_after_read_back >= 11


def test_logprobs_travel_with_overlapped_steps(llama):
    """Logprobs no longer force step-by-step decoding: they are computed on the device
    with the tokens and read back with them, and equal the step-by-step ones."""
    prompts = random_prompts([11, 23, 17], vocab=500, seed=13)
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.8, seed=3, logprobs=0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
    ]
    sync = LLM(llama, async_scheduling=False).generate(prompts, params)
    overlapped = LLM(llama, async_scheduling=True)
    launches = _count_launches(overlapped)
    outs = overlapped.generate(prompts, params)
    assert launches[0] >= 12  # the decode steps were overlapped
    assert [o.token_ids for o in outs] == [o.token_ids for o in sync]
    assert [len(o.logprobs) for o in outs] == [12, 12, 0]
    for got, want in zip(outs[:2], sync[:2]):
        for a, b in zip(got.logprobs, want.logprobs):
            assert (a.token_id, a.rank, [t for t, _ in a.top]) == (b.token_id, b.rank, [t for t, _ in b.top])
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-5)
    assert len(outs[0].logprobs[0].top) == 2 and outs[1].logprobs[0].top == []


def test_placeholders_take_the_previous_steps_samples():
    """The one fill both the eager and the CUDA-graph paths use: rows whose source is
    >= 0 take that row of the last step's samples, the others keep their token."""
    from shared.engine.step_inputs import fill_placeholders, to_device

    ids = to_device([5, -1, 7, -1], torch.long, torch.device("cpu"))
    sources = torch.tensor([-1, 2, -1, 0])
    last = torch.tensor([40, 41, 42])
    assert fill_placeholders(ids, sources, last).tolist() == [5, 42, 7, 40]
    # No step before (the first step): nothing to take, the inputs stay.
    assert fill_placeholders(ids, torch.full((4,), -1), torch.empty(0, dtype=torch.long)).tolist() == [5, -1, 7, -1]


def test_load_counts_the_tokens_of_the_step_on_the_device(llama):
    """A prompt scheduled in the step in flight is still work to do: the balancer's
    least-loaded choice and conditional disaggregation read num_queued_tokens."""
    from shared.engine.engine_request import EngineRequest

    engine = LLM(llama, async_scheduling=True, max_num_batched_tokens=64).engine
    engine.add_request(EngineRequest("a", random_prompts([40], vocab=500, seed=3)[0], SamplingParams(max_tokens=4)))
    engine.add_request(EngineRequest("b", random_prompts([50], vocab=500, seed=4)[0], SamplingParams(max_tokens=4)))
    assert engine.load().num_queued_tokens == 90
    engine.step()  # launches 64 of the 90 tokens (the first prompt and a chunk of the second)
    assert engine._in_flight is not None
    assert engine.load().num_queued_tokens == 90  # 26 waiting + 64 on the device
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.load().num_queued_tokens == 0


def test_load_counts_a_preempted_request_whole_until_it_caught_up(llama):
    """A preempted request's KV is freed: until it has computed its prompt and its output
    again, all of those tokens are queued work (they counted 0 once it had output, so a
    preempting instance looked lightest when it was most overloaded)."""
    from shared.engine.engine_request import EngineRequest

    # As in test_batched_with_preemption_equals_one_at_a_time: 24 blocks cannot hold them all.
    engine = LLM(llama, block_size=4, num_kv_blocks=24, max_model_len=96, prefill_chunk_size=16).engine
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(random_prompts([30, 12, 25, 7, 19, 40], vocab=500, seed=2)):
        engine.add_request(EngineRequest(str(i), prompt, params))
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        sched = engine.scheduler
        requests = [*sched.waiting, *sched.running]
        behind = [r for r in requests if r.num_preemptions and r.num_computed_tokens < r.num_tokens - 1]
        if not any(r.num_output_tokens for r in behind):
            continue
        fresh = [r for r in requests if r not in behind and r.num_output_tokens == 0]
        load = engine.load().num_queued_tokens
        assert load == sum(r.num_prompt_tokens + r.num_output_tokens for r in behind) + sum(
            r.num_prompt_tokens for r in fresh)
        checked += 1
    assert checked > 0 and engine.scheduler.num_preemptions > 0
    assert engine.load().num_queued_tokens == 0


def test_load_counts_a_cached_prefix_as_the_balancer_reserves_it(llama):
    """One definition of queued load (queued_prompt_tokens): a prompt counts whole until its
    first token, its cached prefix too, waiting or on the device, as the balancer's
    reservation counts it. (Before, a request found cached counted only its new tokens
    once scheduled, the whole prompt while waiting.)"""
    from shared.engine.engine_request import EngineRequest

    engine = LLM(llama, async_scheduling=True, block_size=8).engine
    prefix = random_prompts([48], vocab=500, seed=3)[0]
    engine.add_request(EngineRequest("a", prefix + [11, 12], SamplingParams(max_tokens=1)))
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request(EngineRequest("b", prefix + [21, 22, 23], SamplingParams(max_tokens=2)))
    assert engine.load().num_queued_tokens == 51
    engine.step()  # b's 3 new tokens on the device, its 48 cached
    assert engine._in_flight is not None
    assert engine.load().num_queued_tokens == 51
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.load().num_queued_tokens == 0
