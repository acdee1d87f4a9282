"""Instances over two ranks in the mesh (issue 28, point 1): `up`'s Mesh with the
settings `infermesh up --tensor-parallel-size 2 [--enable-expert-parallel]` hands every
instance (tools/launch/up.py parallel_env), on the CPU over gloo.

- Tensor parallelism (the default tiny Llama: 4 KV heads, 2 per rank), one prefill and
  two decode instances of two ranks each: chat and completions give the one-process
  engine's greedy text, a second chat that shares the first's system prompt is served
  from prefill's prefix cache (cached tokens in usage) and gives it too, and decode
  copied every prompt block straight from prefill's ranks (kv.path "peer", rank to
  rank: shared/kv/memory/ranked_region.py). Exact tokens, as the engine parity tests
  compare them: the tensor-parallel logits are within 1e-5 * max|logit| of one
  process's (tests/parity/test_tensor_parallel.py), far below these prompts' top-two gaps.
- The registry holds one entry per instance (the balancer's /ready counts), not one
  per rank.
- A rank killed under load (SIGKILL of decode-0's rank-1 worker) takes its instance
  down at once: the instance fails its requests (the balancer moves them to decode-1,
  where they finish with the same text), leaves the registry and exits 1, well within
  the stream timeouts.
- Expert parallelism (the tiny Qwen3-MoE: attention tensor-parallel over the two
  ranks, experts expert-parallel, as vLLM's `--tensor-parallel-size 2
  --enable-expert-parallel`): each decode rank receives its KV head; greedy text
  equals one process's (the logits within float rounding of one process's:
  tests/parity/test_expert_parallel_engine.py, far below these prompts' top-two gaps).
- Data-parallel attention with expert parallelism (`--data-parallel-size 2
  --enable-expert-parallel`, the tiny Qwen3-MoE): concurrent requests over both ranks
  of each instance give one process's greedy text, the handoff copies rank to rank by
  instance-wide block ids, a repeated system prompt is a prefix hit, and each instance
  is one registry entry. Two such prefill instances: a repeated prefix is routed by the
  instances' KV events to the one that computed it, and there to the rank that holds it
  (a local hit, nothing loaded from kvcache)."""

import json
import os
import signal
import threading
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from tests.helpers.mesh import kv_blocks_settled, running_mesh
from tests.helpers.mesh_procs import span_attributes
from tests.helpers.metrics import balancer_metric
from tools.make_model import make_model

BLOCK = 16
SYSTEM = "You are a careful assistant. " * 12  # 3+ blocks shared by both chats
CHATS = [
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name three sorting algorithms."}],
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which of them is stable?"}],
]
PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
MAX_TOKENS = 16


def _env(split: str) -> dict[str, str]:
    env = {"INFERMESH_ENGINE__BLOCK_SIZE": str(BLOCK), "INFERMESH_ENGINE__TENSOR_PARALLEL_SIZE": "2",
           "INFERMESH_WORKER__HEARTBEAT_INTERVAL_S": "0.2"}  # fmt: skip
    if split == "ep":
        env["INFERMESH_ENGINE__ENABLE_EXPERT_PARALLEL"] = "true"
    return env


def _client(mesh) -> openai.OpenAI:  # noqa: ANN001
    return openai.OpenAI(base_url=mesh.api_url, api_key="x", max_retries=0, timeout=300)


def _serves_the_one_process_tokens(mesh, model: str, batch_invariant: bool = False) -> None:  # noqa: ANN001
    """The chats (the second a prefix hit) and a completion equal the one-process engine's greedy text."""
    offline = LLM(model, block_size=BLOCK, batch_invariant=batch_invariant)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    expected = offline.chat(CHATS, greedy)
    (completion,) = offline.generate([PROMPT], greedy)
    offline.engine.close()
    client = _client(mesh)
    name = client.models.list().data[0].id
    first = client.chat.completions.create(model=name, messages=CHATS[0], max_tokens=MAX_TOKENS, temperature=0)
    assert first.choices[0].message.content == expected[0].text
    assert first.usage.completion_tokens == len(expected[0].token_ids)
    # Decode copied every full prompt block straight out of prefill's two ranks.
    attrs = span_attributes(mesh.trace_dir, first.id, "decode")
    assert attrs["kv.path"] == "peer" and attrs["kv.load_failed"] is False
    assert attrs["kv.loaded_blocks"] == first.usage.prompt_tokens // BLOCK > 0
    # Written behind to kvcache by the writer process, which maps every rank's cache: the one-rank bytes.
    assert kv_blocks_settled(mesh, at_least=first.usage.prompt_tokens // BLOCK) >= first.usage.prompt_tokens // BLOCK
    second = client.chat.completions.create(model=name, messages=CHATS[1], max_tokens=MAX_TOKENS, temperature=0)
    assert second.choices[0].message.content == expected[1].text
    assert second.usage.prompt_tokens_details.cached_tokens >= len(SYSTEM) // 8  # the system prompt's blocks, at least
    out = client.completions.create(model=name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].text == completion.text


# -- tensor parallelism ----------------------------------------------------------


@pytest.fixture(scope="module")
def tp_mesh(mesh_model_dir: str, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    with running_mesh(mesh_model_dir, tmp_path_factory.mktemp("tp-mesh"), num_decode=2, extra_env=_env("tp")) as mesh:
        yield mesh


def test_tensor_parallel_instances_serve_the_one_process_tokens(tp_mesh, mesh_model_dir: str) -> None:  # noqa: ANN001
    _serves_the_one_process_tokens(tp_mesh, mesh_model_dir)
    assert _registered(tp_mesh) == {"prefill": 1, "decode": 2}  # one entry per instance, not one per rank


def _registered(mesh) -> dict[str, int]:  # noqa: ANN001
    """The balancer's registry: live instances per stage (its /ready says)."""
    with urllib.request.urlopen(mesh.api_url.removesuffix("/v1") + "/ready", timeout=5) as resp:
        counts = json.loads(resp.read())["instances"]
    return {stage: n for stage, n in counts.items() if stage in ("prefill", "decode")}


def _rank_worker(pid: int) -> int:
    """The pid of the instance's tensor-parallel worker (rank 1): its child started by
    multiprocessing's spawn (not the resource tracker)."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    workers = [c for c in children
               if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()
               and b"resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes()]  # fmt: skip
    assert len(workers) == 1, f"{pid}'s children: {children}"
    return workers[0]


def test_a_killed_rank_takes_its_instance_down_and_its_requests_move(tp_mesh, mesh_model_dir: str) -> None:  # noqa: ANN001
    prompts = [f"{i}: the quick brown fox jumps over the lazy dog, and then" for i in range(6)]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    offline = LLM(mesh_model_dir, block_size=BLOCK)
    expected = [o.text for o in offline.generate(prompts, params)]
    offline.engine.close()
    client = _client(tp_mesh)
    name = client.models.list().data[0].id
    texts: dict[int, str] = {}
    errors: list[str] = []
    started = threading.Barrier(len(prompts) + 1)

    def stream(i: int) -> None:
        text, signalled = "", False
        try:
            chunks = client.completions.create(model=name, prompt=prompts[i], max_tokens=48, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})  # fmt: skip
            for chunk in chunks:
                if chunk.choices and chunk.choices[0].text:
                    text += chunk.choices[0].text
                    if not signalled:
                        signalled = True
                        started.wait(timeout=120)
        except Exception as exc:  # noqa: BLE001  (counted)
            errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            if not signalled:
                started.abort()
        texts[i] = text

    migrations = balancer_metric(tp_mesh, "migrations_total")
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    started.wait(timeout=120)  # every stream has its first tokens: decoding on both instances
    (decode0,) = [p for n, p in tp_mesh.procs if n == "decode-0"]
    os.kill(_rank_worker(decode0.pid), signal.SIGKILL)
    killed = time.monotonic()
    assert decode0.wait(timeout=20) == 1  # the instance stopped on its own, and says it failed
    stopped_s = time.monotonic() - killed
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    assert [texts[i] for i in range(len(prompts))] == expected  # resumed elsewhere: the text is unchanged
    assert balancer_metric(tp_mesh, "migrations_total") > migrations  # decode-0's requests moved
    assert stopped_s < 10.0
    deadline = time.monotonic() + 5  # the balancer hears of the closed connection from nats-server
    while _registered(tp_mesh)["decode"] != 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _registered(tp_mesh) == {"prefill": 1, "decode": 1}  # it left the registry


# -- expert parallelism ------------------------------------------------------------


def test_expert_parallel_instances_serve_the_one_process_tokens(tmp_path_factory: pytest.TempPathFactory) -> None:
    model = str(tmp_path_factory.mktemp("ep-model"))
    make_model(model, arch="qwen3_moe", seed=0)
    with running_mesh(model, tmp_path_factory.mktemp("ep-mesh"), extra_env=_env("ep")) as mesh:
        _serves_the_one_process_tokens(mesh, model)
        assert _registered(mesh) == {"prefill": 1, "decode": 1}


# -- data-parallel attention ---------------------------------------------------------

DP_PROMPTS = [f"{i}: the quick brown fox jumps over the lazy dog, and then" for i in range(4)]


def test_data_parallel_instances_serve_the_one_process_tokens(tmp_path_factory: pytest.TempPathFactory) -> None:
    """`infermesh up --data-parallel-size 2 --enable-expert-parallel` (the tiny Qwen3-MoE,
    batch-invariant on both sides for exact tokens): each prefill and decode instance is
    two ranks, each running attention for the requests pinned to it, and is still one
    instance to the balancer. Concurrent completions (both ranks of each instance busy)
    give one process's greedy text; the chats copy every prompt block from prefill's ranks
    by instance-wide ids and hit prefill's prefix cache (shared/engine/dp_kv.py)."""
    model = str(tmp_path_factory.mktemp("dp-model"))
    make_model(model, arch="qwen3_moe", seed=0)
    env = {"INFERMESH_ENGINE__BLOCK_SIZE": str(BLOCK), "INFERMESH_ENGINE__DATA_PARALLEL_SIZE": "2",
           "INFERMESH_ENGINE__ENABLE_EXPERT_PARALLEL": "true", "INFERMESH_ENGINE__BATCH_INVARIANT": "true",
           "INFERMESH_WORKER__HEARTBEAT_INTERVAL_S": "0.2"}  # fmt: skip
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    offline = LLM(model, block_size=BLOCK, batch_invariant=True)
    expected = [o.text for o in offline.generate(DP_PROMPTS, params)]
    offline.engine.close()
    with running_mesh(model, tmp_path_factory.mktemp("dp-mesh"), extra_env=env) as mesh:
        client = _client(mesh)
        name = client.models.list().data[0].id
        texts: dict[int, str] = {}
        errors: list[str] = []

        def complete(i: int) -> None:
            try:
                out = client.completions.create(model=name, prompt=DP_PROMPTS[i], max_tokens=24, temperature=0,
                                                extra_body={"ignore_eos": True})  # fmt: skip
                texts[i] = out.choices[0].text
            except Exception as exc:  # noqa: BLE001  (counted)
                errors.append(f"{type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=complete, args=(i,)) for i in range(len(DP_PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert errors == []
        assert [texts.get(i) for i in range(len(DP_PROMPTS))] == expected
        _serves_the_one_process_tokens(mesh, model, batch_invariant=True)
        assert _registered(mesh) == {"prefill": 1, "decode": 1}  # one entry per instance, not one per rank


def test_data_parallel_instances_route_a_repeated_prefix_to_the_rank_that_holds_it(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Two prefill instances of two data-parallel ranks each: the balancer learns which
    instance holds a prompt's blocks from its KV events (instance-wide block ids over both
    ranks, shared/engine/dp_kv.py InstanceBlockEvents), and the instance sends the repeat
    to the rank that holds it (dp_scheduler.choose_rank): the repeat is routed for its
    prefix, to the instance that computed it, and is served from that rank's own prefix
    cache (cached tokens, nothing loaded from kvcache). A repeat on the other instance, or
    on the other rank, would compute the prefix again or load it from kvcache."""
    model = str(tmp_path_factory.mktemp("dp-route-model"))
    make_model(model, arch="qwen3_moe", seed=0)
    env = {"INFERMESH_ENGINE__BLOCK_SIZE": str(BLOCK), "INFERMESH_ENGINE__DATA_PARALLEL_SIZE": "2",
           "INFERMESH_ENGINE__ENABLE_EXPERT_PARALLEL": "true", "INFERMESH_WORKER__HEARTBEAT_INTERVAL_S": "0.2"}  # fmt: skip
    blocks = 6
    prefixes = [list(range(100 + 200 * i, 100 + 200 * i + blocks * BLOCK)) for i in range(4)]
    with running_mesh(model, tmp_path_factory.mktemp("dp-route-mesh"), num_prefill=2, extra_env=env) as mesh:
        client = _client(mesh)
        name = client.models.list().data[0].id

        def complete(prompt: list[int]):  # noqa: ANN202
            return client.completions.create(model=name, prompt=prompt, max_tokens=1, temperature=0)

        # All at once: the reservations spread them over both instances (and each
        # instance's two over its ranks).
        firsts: dict[int, str] = {}
        threads = [threading.Thread(target=lambda i=i: firsts.__setitem__(i, complete(prefixes[i] + [7, 8, 9]).id))
                   for i in range(len(prefixes))]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert len(firsts) == len(prefixes)
        holders = {i: span_attributes(mesh.trace_dir, rid, "route")["prefill.choice"] for i, rid in firsts.items()}
        assert len(set(holders.values())) == 2, f"the first requests did not use both instances: {holders}"

        # The KV events reach the balancer within a few heartbeats.
        deadline = time.monotonic() + 30
        while span_attributes(mesh.trace_dir, complete(prefixes[0] + [10]).id, "route")["prefill.reason"] != "prefix":
            assert time.monotonic() < deadline, "the balancer never routed a repeat by its prefix"
            time.sleep(0.2)
        for i, prefix in enumerate(prefixes):
            out = complete(prefix + [20 + i, 21])
            route = span_attributes(mesh.trace_dir, out.id, "route")
            assert route["prefill.reason"] == "prefix" and route["prefill.choice"] == holders[i], (i, route, holders)
            prefill = span_attributes(mesh.trace_dir, out.id, "prefill")
            assert prefill["prompt.cached_tokens"] >= blocks * BLOCK, (i, prefill)
            assert prefill.get("kv.loaded_blocks", 0) == 0, f"the repeat {i} loaded its prefix instead of hitting its rank's cache"
        assert _registered(mesh) == {"prefill": 2, "decode": 1}
