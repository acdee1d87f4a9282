"""Data-parallel attention with expert parallelism through the engine (issue 28): a
Qwen3-MoE model over 2 real gloo worker processes with ``data_parallel_size=2`` and
``enable_expert_parallel`` (4 experts a rank) generates the single process's tokens and
logprobs, bitwise under batch-invariant mode, while each rank runs attention for its own
requests only (and an idle rank pads its forward so the MoE all-to-all still meets).

Why bitwise: a request's attention runs on one rank over its own KV, through per-row
invariant kernels, whatever else that rank's batch holds; its MoE rows are routed by
the same router and computed by per-row invariant experts wherever they live.
"""

import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from shared.engine.config import EngineConfig
from shared.engine.dp_scheduler import DataParallelScheduler
from shared.engine.engine_request import EngineRequest
from shared.engine.executor.multiproc import WorkerFailed
from shared.engine.llm import LLM
from shared.engine.llm_engine import LLMEngine
from shared.engine.outputs import RequestOutput
from shared.engine.request import Request
from shared.engine.sampling_params import SamplingParams
from tests.helpers.hf_models import random_prompts, save_tiny_hf_model

pytest.importorskip("transformers")

ENGINE = dict(block_size=4, prefill_chunk_size=8, max_num_batched_tokens=24, batch_invariant=True)
"""Small blocks and chunks: prompts span blocks, prefill is chunked beside decoding."""
DP = dict(data_parallel_size=2, enable_expert_parallel=True)
EPLB = '{"window_size": 4, "step_interval": 3, "num_redundant_experts": 2}'
PROMPTS = random_prompts([5, 17, 11, 9, 23], vocab=500, seed=3)
PARAMS = [
    SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1),
    # Keyed noise: rank-free. Bad words: rank 1's steps sample after the read-back, rank 0's need not.
    SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True, logprobs=1,
                   bad_words_token_ids=[[5], [6, 7]]),
    SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1),
    SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1),
    SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1, prompt_logprobs=2),  # scored
]
Result = tuple[list[int], list[float], list[Any] | None]
"""A request's tokens, chosen-token logprobs and prompt logprobs."""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_hf_model("qwen3_moe", tmp_path_factory.mktemp("dp-engine") / "qwen3_moe", seed=1))


@pytest.fixture(scope="module")
def single(model: str) -> list[Result]:
    """The single process's results of PROMPTS."""
    engine = LLMEngine(EngineConfig(model=model, **ENGINE))
    try:
        done, _, _ = _drive(engine, PROMPTS, PARAMS)
        return [_result(done[str(i)]) for i in range(len(PROMPTS))]
    finally:
        engine.close()


def _result(out: RequestOutput) -> Result:
    return out.token_ids, out.new_logprobs, out.prompt_logprobs  # type: ignore[return-value]


def _drive(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams], first_id: int = 0,
           abort: str | None = None) -> tuple[dict[str, RequestOutput], list[list[int]], dict[str, int]]:  # fmt: skip
    """Every request to its end (``abort``: that one aborted after the third step); the
    finished outputs by id, with each of their chosen logprobs gathered, and the running
    requests per rank after each step, and the rank each request was given (data-parallel)."""
    ids = [str(first_id + i) for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params):
        engine.add_request(EngineRequest(rid, prompt, p))
    given = dict(engine.scheduler.rank_of) if isinstance(engine.scheduler, DataParallelScheduler) else {}
    done: dict[str, RequestOutput] = {}
    logprobs: dict[str, list[float]] = {rid: [] for rid in ids}
    scored: dict[str, Any] = {}
    per_rank: list[list[int]] = []
    num_steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            logprobs[out.request_id] += [lp.logprob for lp in out.new_logprobs]
            if out.prompt_logprobs is not None:
                scored[out.request_id] = out.prompt_logprobs
            if out.finished:
                done[out.request_id] = out
        per_rank.append(engine.load().num_running_per_rank)
        num_steps += 1
        if num_steps == 3 and abort is not None:
            engine.abort_request(abort)
    for rid, out in done.items():
        out.new_logprobs = logprobs[rid]  # type: ignore[assignment]
        out.prompt_logprobs = scored.get(rid)
    return done, per_rank, given


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async-scheduling+eplb"])
def test_data_parallel_attention_generates_the_tokens_of_one_process(
    model: str, single: list[Result], overlap: bool
) -> None:
    """Synchronous steps; and overlapped ones (launch, then collect) with EPLB moving
    experts between the ranks mid-generation (a placement every 3 steps, two redundant
    experts), which changes no token either."""
    eplb = dict(enable_eplb=True, eplb_config=EPLB) if overlap else {}
    engine = LLMEngine(EngineConfig(model=model, async_scheduling=overlap, **ENGINE, **DP, **eplb))
    try:
        assert isinstance(engine.scheduler, DataParallelScheduler)
        done, per_rank, given = _drive(engine, PROMPTS, PARAMS)
        # Both ranks ran requests of their own, at once (neither ran the others' attention).
        assert any(a > 0 and b > 0 for a, b in per_rank)
        assert max(a for a, _ in per_rank) < len(PROMPTS) and max(b for _, b in per_rank) < len(PROMPTS)
        assert [_result(done[str(i)]) for i in range(len(PROMPTS))] == single
        assert given == {"0": 0, "1": 1, "2": 0, "3": 0, "4": 1}  # by KV tokens held, as added
        assert single[4][2] is not None and len(single[4][2]) == len(PROMPTS[4])  # rank 1 scored its prompt
        load = engine.load()
        assert load.num_running_per_rank == [0, 0] and load.num_free_kv_blocks == load.num_total_kv_blocks
        assert load.tokens_per_expert is not None and sum(map(sum, load.tokens_per_expert)) > 0
        if overlap:
            assert engine._experts is not None and engine._experts.num_layer_moves >= 2
            assert load.steps.sampled_after_read_back > 0
    finally:
        engine.close()
    assert multiprocessing.active_children() == []


def test_prefix_hits_preemption_and_aborts_hold_per_rank(model: str, single: list[Result]) -> None:
    """A pool of 10 blocks a rank (40 tokens) for requests of up to 33: requests are
    preempted and recomputed on their rank, and the tokens stay those of one process.
    One request aborted mid-generation ends, the others do not notice. Then a repeated
    prompt goes to the rank that computed it, and its full blocks are a prefix hit there."""
    engine = LLMEngine(EngineConfig(model=model, num_kv_blocks=10, max_model_len=40, **ENGINE, **DP))
    try:
        done, _, _ = _drive(engine, PROMPTS, PARAMS, abort="3")
        assert engine.load().num_preemptions > 0
        assert sorted(done) == ["0", "1", "2", "4"]  # aborted before its end: no output, no rank
        assert isinstance(engine.scheduler, DataParallelScheduler) and engine.scheduler.rank_of == {}
        for i in (0, 1, 2, 4):
            assert _result(done[str(i)]) == single[i]
        scheduler = engine.scheduler
        assert isinstance(scheduler, DataParallelScheduler)
        holder = [kv.num_cached_persistent_blocks(_request(PROMPTS[4]), 5) for kv in engine.kv_ranks]
        assert sorted(holder) == [0, 5]  # prompt 4 (23 tokens, 5 full blocks) is cached on its rank alone
        engine.add_request(EngineRequest("again", PROMPTS[4], PARAMS[0]))  # PARAMS[4] but not scored: hits
        assert scheduler.rank_of["again"] == holder.index(5)
        outputs = [out for _ in range(40) if engine.has_unfinished_requests() for out in engine.step()]
        again = next(out for out in outputs if out.finished)
        assert again.num_cached_tokens == 20 and again.token_ids == single[4][0]
        # Two unseeded sampled requests of one prompt, one on each rank: each rank seeds its
        # unseeded requests apart (as one process's n-th request does), so they draw differently.
        unseeded = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
        engine.add_request(EngineRequest("u0", PROMPTS[0], unseeded))
        engine.add_request(EngineRequest("u1", PROMPTS[0], unseeded))
        assert sorted((scheduler.rank_of["u0"], scheduler.rank_of["u1"])) == [0, 1]
        outputs = [out for _ in range(40) if engine.has_unfinished_requests() for out in engine.step()]
        drawn = {out.request_id: out.token_ids for out in outputs if out.finished}
        assert len(drawn["u0"]) == len(drawn["u1"]) == 8 and drawn["u0"] != drawn["u1"]
    finally:
        engine.close()
    assert multiprocessing.active_children() == []


def _request(prompt: list[int]) -> Request:
    return Request("probe", prompt, SamplingParams())


def test_a_worker_killed_mid_run_fails_the_engine_within_seconds(model: str) -> None:
    """Rank 1 runs requests of its own, whose tokens only it sends: killed, it fails the
    engine (a broken collective, or no result for its step) naming it, never a hang."""
    llm = LLM(model, **ENGINE, **DP)
    (worker,) = llm.engine.executor._workers  # type: ignore[attr-defined]
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=2))  # both ranks warm
    killer = threading.Timer(0.5, os.kill, (worker.pid, signal.SIGKILL))
    killer.start()
    start = time.monotonic()
    with pytest.raises(WorkerFailed, match=r"worker rank 1 .*exit code -9"):
        llm.generate(PROMPTS, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
    assert time.monotonic() - start < 10.0
    with pytest.raises(WorkerFailed):  # closed by the failure: no further step
        llm.engine.executor.execute(None)  # type: ignore[arg-type]
    llm.engine.close()
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize(
    ("settings", "refused"),
    [
        (dict(data_parallel_size=2), "data_parallel_size > 1 runs data-parallel attention beside expert-parallel"),
        (dict(tensor_parallel_size=2, **DP), "not implemented yet: tensor parallelism with data_parallel_size > 1"),
        (dict(speculative="ngram", **DP), "not implemented yet: speculative decoding with data_parallel_size > 1"),
        (dict(device="cuda", cuda_graphs=True, **DP), "not implemented yet: CUDA graphs with data_parallel_size > 1"),
        (dict(data_parallel_size=0), "data_parallel_size must be at least 1, got 0"),
    ],
)
def test_what_data_parallel_attention_does_not_run_is_refused_by_name(settings: dict, refused: str) -> None:
    with pytest.raises(ValueError, match=refused):
        EngineConfig(**settings)


def test_a_dense_model_is_refused_before_any_rank_starts(tmp_path: Path) -> None:
    dense = save_tiny_hf_model("llama", tmp_path / "llama")
    with pytest.raises(ValueError, match=r"enable_expert_parallel needs an MoE model: LlamaForCausalLM"):
        LLM(str(dense), **DP)
    assert multiprocessing.active_children() == []
