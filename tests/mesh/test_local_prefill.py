"""Conditional disaggregation (issue 10): the balancer sends a request whose prompt is
short (or when prefill is the bottleneck, or no prefill instance is live) to its decode
instance whole, which prefills it in its own steps and decodes it. Real processes:
nats-server, kvcache, prefill, two decode instances and the balancer.

Checked: the policy's rules; short prompts computed on decode and long ones on prefill
in one mesh, every output (tokens, logprobs, the prompt's logprobs, usage) equal to the
offline engine's; a prompt extending one prefill computed, prefilled on decode from the
cached blocks; the requests of a killed decode instance moving on within seconds; and
requests still served, on decode, once the only prefill instance is dead."""

import random
import urllib.request
import signal
import threading
import time

import openai
import pytest

from services.balancer.router.policies import choose_decode_by_cache, choose_prefill_site
from services.balancer.router.registry import Instance
from shared.engine.engine_request import EngineRequest
from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from shared.kv.block_hash import hash_block_chain
from shared.proto import mesh_pb2
from shared.runtime import subjects
from tests.helpers.mesh_procs import span_attributes
from tests.helpers.mesh import kv_blocks_settled, kv_stats
from tests.helpers.metrics import balancer_metric as metric
from tests.helpers.nats_listener import Listener

BLOCK = 16
SHORT = 40
"""Prompts with at most this many tokens to compute are prefilled on decode."""
MESH = dict(
    num_prefill=1,
    num_decode=2,
    extra_env={
        "INFERMESH_ENGINE__BLOCK_SIZE": str(BLOCK),
        "INFERMESH_WORKER__HEARTBEAT_INTERVAL_S": "0.2",
        "INFERMESH_BALANCER__LOCAL_PREFILL_MAX_TOKENS": str(SHORT),
        "INFERMESH_KVCACHE__LOAD_WHEN_FASTER": "false",  # a hit is loaded, however cheap recomputing it is here
        # On a loaded 2-core CI machine a lookup can take over the default 1 s, and the
        # hit then counts as a miss ("slow"): a test of hits waits for the answer.
        "INFERMESH_KVCACHE__LOOKUP_TIMEOUT_S": "20",
    },
)
SHORT_PROMPT = [11, 22, 33, 44, 55, 66, 77, 88, 99, 110]
MAX_TOKENS = 400
"""A stream long enough on the CPU to be killed mid-way."""
LONG_PROMPT = [(7 * i + 3) % 500 + 5 for i in range(96)]  # 6 full blocks: computed on prefill


# -- the policy ----------------------------------------------------------------------------


def _prefill(iid: str, queued: int, blocks=()) -> Instance:  # noqa: ANN001
    inst = Instance("prefill", iid, mesh_pb2.Load(num_queued_tokens=queued), last_seen=0.0, interval_s=0.5)
    inst.blocks = set(blocks)
    return inst


def test_policy_rules() -> None:
    prompt = list(range(100))
    hashes = hash_block_chain(prompt, BLOCK, "fp", None)
    idle, busy = _prefill("p0", 0), _prefill("p1", 50_000)
    # Both rules off: always on a prefill instance, whatever the queue.
    assert not choose_prefill_site([busy], hashes, 100, BLOCK, 0, 0).local
    # Length: what is left beyond the longest prefix a prefill instance holds.
    assert not choose_prefill_site([idle], hashes, 100, BLOCK, 40, 0).local
    holder = _prefill("p2", 0, hashes[:4])  # 64 of 100 tokens held: 36 left
    site = choose_prefill_site([idle, holder], hashes, 100, BLOCK, 40, 0)
    assert site.local and site.reason == "short_prompt"
    assert not choose_prefill_site([idle, holder], hashes, 100, BLOCK, 35, 0).local
    # Load: the least loaded prefill instance's queue, with what was sent since its heartbeat.
    assert not choose_prefill_site([idle, busy], hashes, 100, BLOCK, 0, 8192).local
    site = choose_prefill_site([busy], hashes, 100, BLOCK, 0, 8192)
    assert site.local and site.reason == "prefill_queue" and site.queued_tokens == 50_000
    idle.in_flight_tokens = 9000
    assert choose_prefill_site([idle, busy], hashes, 100, BLOCK, 0, 8192).local
    # No prefill instance: on decode with a rule on, else the balancer's usual 503.
    assert choose_prefill_site([], hashes, 100, BLOCK, 1, 0).reason == "no_prefill_instance"
    assert not choose_prefill_site([], hashes, 100, BLOCK, 0, 0).local


def _decode(iid: str, used: int = 0, waiting: int = 0, blocks=()) -> Instance:  # noqa: ANN001
    load = mesh_pb2.Load(num_total_kv_blocks=1000, num_free_kv_blocks=1000 - used, num_waiting=waiting)
    inst = Instance("decode", iid, load, last_seen=0.0, interval_s=0.5)
    inst.blocks = set(blocks)
    return inst


def test_decode_by_cache_weighs_the_blocks_held_against_the_blocks_in_use() -> None:
    prompt = list(range(100))  # 7 blocks, 6 full
    hashes = hash_block_chain(prompt, BLOCK, "fp", None)
    rng = random.Random(0)
    holder, idle = _decode("d0", used=3, blocks=hashes[:6]), _decode("d1")
    choice = choose_decode_by_cache([idle, holder], hashes, 100, BLOCK, rng)
    # d0: 7 - 6 held + 3 in use = 4; d1: 7 to compute.
    assert choice.instance is holder and choice.scores == {"d1": 7.0, "d0": 4.0}
    holder.load.num_free_kv_blocks -= 4  # 7 in use: 8 against 7
    assert choose_decode_by_cache([idle, holder], hashes, 100, BLOCK, rng).instance is idle
    holder.load.num_free_kv_blocks += 4
    holder.in_flight = 1  # a request sent since its heartbeat: this prompt's 7 more
    assert choose_decode_by_cache([idle, holder], hashes, 100, BLOCK, rng).instance is idle
    with pytest.raises(LookupError):
        choose_decode_by_cache([], hashes, 100, BLOCK, rng)
    # What the chosen decode instance holds counts as computed for the site: 4 left, local.
    site = choose_prefill_site([_prefill("p0", 0)], hashes, 100, BLOCK, 40, 0, decode=holder)
    assert site.local and site.reason == "short_prompt"
    assert not choose_prefill_site([_prefill("p0", 0)], hashes, 100, BLOCK, 40, 0, decode=idle).local


# -- through a mesh ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def offline(mesh_model_dir):
    return LLM(mesh_model_dir, block_size=BLOCK)


@pytest.fixture
def client(mesh):
    return openai.OpenAI(base_url=mesh.api_url, api_key="x", max_retries=0, timeout=120)


def _complete(client, prompt: list[int], scored: bool = False, **kw):  # noqa: ANN001, ANN202
    """Greedy; scored: with the prompt's logprobs (a scored prompt is computed in full, not cached)."""
    name = client.models.list().data[0].id
    extra = {"return_token_ids": True, "ignore_eos": True} | ({"prompt_logprobs": 2} if scored else {})
    return client.completions.create(model=name, prompt=prompt, temperature=0, extra_body=extra, logprobs=2, **kw)


def _prompt_logprobs(offline: LLM, prompt: list[int]) -> list[float | None]:
    """Each prompt token's logprob, from the offline engine."""
    engine = offline.engine
    engine.add_request(EngineRequest("scored", prompt, SamplingParams(max_tokens=1, prompt_logprobs=2)))
    scored = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            scored = out.prompt_logprobs if out.prompt_logprobs is not None else scored
    assert scored is not None
    return [None] + [lp.logprob if lp.token_id == t else None for lp, t in zip(scored[1:], prompt[1:])]


def test_short_on_decode_long_on_prefill_equal_offline(mesh, client, offline) -> None:
    before = {site: metric(mesh, "prefill_site_total", site=site) for site in ("local", "remote")}
    for prompt, site in ((SHORT_PROMPT, "local"), (LONG_PROMPT, "remote")):
        expected = offline.generate(
            [prompt], SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, prompt_logprobs=2, ignore_eos=True)
        )[0]
        out = _complete(client, prompt, scored=True, max_tokens=12)
        choice = out.choices[0]
        assert choice.token_ids == expected.token_ids, site
        got = [lp for lp in choice.logprobs.token_logprobs]
        want = [lp.logprob for lp in expected.logprobs]
        assert got == pytest.approx(want, abs=1e-4), site
        scored = choice.prompt_logprobs
        assert scored[0] is None and len(scored) == len(prompt)
        want_prompt = _prompt_logprobs(offline, prompt)
        for pos, entry in enumerate(scored[1:], start=1):
            token = str(prompt[pos])
            assert entry[token]["logprob"] == pytest.approx(want_prompt[pos], abs=1e-4), (site, pos)
        assert out.usage.prompt_tokens == len(prompt) and out.usage.completion_tokens == 12
        assert metric(mesh, "prefill_site_total", site=site) == before[site] + 1
        before[site] += 1
        streamed = client.completions.create(model=out.model, prompt=prompt, max_tokens=12, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})  # fmt: skip
        assert "".join(c.choices[0].text for c in streamed if c.choices) == expected.text
        before[site] += 1


def test_an_extension_of_a_computed_prompt_prefills_on_decode_from_the_cache(mesh, client, offline) -> None:
    base = [(13 * i + 1) % 400 + 5 for i in range(80)]  # 5 blocks, computed on prefill
    extended = base + [9, 8, 7, 6, 5, 4, 3, 2]  # 8 more: 8 + the partial block left, on decode
    local_before = metric(mesh, "prefill_site_total", site="local", reason="short_prompt")
    stored = kv_stats(mesh).num_blocks
    first = _complete(client, base, max_tokens=4)
    assert first.usage.prompt_tokens == len(base)
    kv_blocks_settled(mesh, stored + 5)  # prefill writes behind; its KV events reach the balancer meanwhile
    out = _complete(client, extended, max_tokens=10)
    assert metric(mesh, "prefill_site_total", site="local", reason="short_prompt") == local_before + 1
    expected = offline.generate([extended], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    assert out.choices[0].token_ids == expected.token_ids
    # The base's full blocks were not computed again: from kvcache, or the decode
    # instance's own cache if it decoded the base.
    bypassed = {iid: _decode_metric_lines(mesh, iid, "kvcache_bypassed_total") for iid in ("decode-0", "decode-1")}
    assert out.usage.prompt_tokens_details.cached_tokens >= 64, f"kvcache not used on decode: {bypassed}"


def test_a_conversation_goes_back_to_the_decode_instance_holding_it_and_is_prefilled_there(
    mesh, client, offline
) -> None:
    seen: dict[str, set[str]] = {}  # instance -> the block hashes its KV events stored

    def on_kv_event(msg) -> None:  # noqa: ANN001
        ev = mesh_pb2.KvEvent()
        ev.ParseFromString(msg.data)
        seen.setdefault(ev.instance_id, set()).update(ev.stored)

    idle_beats: dict[str, int] = {}  # instance -> heartbeats in a row saying it runs nothing

    def on_heartbeat(msg) -> None:  # noqa: ANN001
        hb = mesh_pb2.Heartbeat()
        hb.ParseFromString(msg.data)
        idle = hb.load.num_running == 0 and hb.load.num_waiting == 0
        idle_beats[hb.instance_id] = idle_beats.get(hb.instance_id, 0) + 1 if idle else 0

    Listener(subjects.KV_EVENTS_ALL, on_kv_event).start(mesh.nats_url)
    Listener(subjects.heartbeats_of("decode"), on_heartbeat).start(mesh.nats_url)
    turn1 = [(17 * i + 3) % 400 + 5 for i in range(20)]  # short: computed on a decode instance
    first = _complete(client, turn1, max_tokens=60)
    holder = span_attributes(mesh.trace_dir, first.id, "route")["decode.choice"]
    history = turn1 + first.choices[0].token_ids  # 80 tokens; KV of 79: 4 full blocks on the holder
    hashes = [bytes(h) for h in offline.engine.kv.hash_chain(history)]
    deadline = time.monotonic() + 10
    while not set(hashes[:4]) <= seen.get(holder, set()):  # its events reach the balancer too
        assert time.monotonic() < deadline, "the holder's KV events did not come"
        time.sleep(0.05)
    # And its load: a heartbeat sent while turn 1 still ran counts turn 1's blocks as used,
    # which outweighs the holder's edge in the cost (2 blocks + 5 used > 6 elsewhere). Two
    # idle beats in a row: the balancer has taken the first (the policy under a stale load
    # is the policy's business; this test is about the cache).
    idle_beats[holder] = 0
    while idle_beats.get(holder, 0) < 2:
        assert time.monotonic() < deadline, "the holder never reported itself idle"
        time.sleep(0.05)
    # The next turn: 88 tokens, 24 beyond the holder's 4 blocks (at most SHORT = 40 are
    # computed on decode; no prefill instance holds any of it, so only the holder's own
    # cache makes it short), and back to the holder, which computes only those.
    turn2 = history + [9, 8, 7, 6, 5, 4, 3, 2]
    out = _complete(client, turn2, max_tokens=6)
    route = span_attributes(mesh.trace_dir, out.id, "route")
    assert route["decode.choice"] == holder and route["decode.reason"] == "kv_cost"
    assert route["prefill.local"] and route["prefill.site_reason"] == "short_prompt"
    assert out.usage.prompt_tokens_details.cached_tokens >= 64
    expected = offline.generate([turn2], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert out.choices[0].token_ids == expected.token_ids
    # A burst of six turns continuing it at once: each one routed counts on its instance
    # at once (before prefill's or decode's ack), so the holder's edge (its 5 blocks of
    # 6) is worth one request's blocks, and the burst alternates between the two instances
    # (before the reservation, all six saw an idle holder and went there).
    turns = [history + [i + 5] * 8 for i in range(6)]
    go = threading.Barrier(len(turns))
    outs: dict[int, object] = {}

    def one(i: int) -> None:
        go.wait()
        outs[i] = _complete(client, turns[i], max_tokens=4)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(turns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    choices = [span_attributes(mesh.trace_dir, outs[i].id, "route")["decode.choice"] for i in range(len(turns))]
    assert min(choices.count(holder), len(turns) - choices.count(holder)) >= 2, choices
    expected = offline.generate(turns, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert [outs[i].choices[0].token_ids for i in range(len(turns))] == [e.token_ids for e in expected]


def _decode_metric_lines(mesh, iid: str, name: str) -> list[str]:  # noqa: ANN001
    """A decode instance's samples of one metric, as text (for a failure's message)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{mesh.metrics_ports[iid]}/metrics", timeout=5) as resp:
        return [line for line in resp.read().decode().splitlines() if name in line and not line.startswith("#")]


def test_killed_decode_moves_its_requests_and_a_dead_prefill_costs_none(start_mesh, offline) -> None:
    mesh = start_mesh(num_prefill=1, num_decode=2, extra_env={
        "INFERMESH_ENGINE__BLOCK_SIZE": str(BLOCK), "INFERMESH_WORKER__HEARTBEAT_INTERVAL_S": "0.2",
        "INFERMESH_BALANCER__LOCAL_PREFILL_MAX_TOKENS": "100000",  # every request on decode
    })  # fmt: skip
    running: dict[str, int] = {}

    def on_heartbeat(msg) -> None:  # noqa: ANN001
        hb = mesh_pb2.Heartbeat()
        hb.ParseFromString(msg.data)
        running[hb.instance_id] = hb.load.num_running

    Listener(subjects.heartbeats_of("decode"), on_heartbeat).start(mesh.nats_url)
    client = openai.OpenAI(base_url=mesh.api_url, api_key="x", max_retries=0, timeout=120)
    name = client.models.list().data[0].id
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 500) for _ in range(20 + 7 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in offline.generate(prompts, params)]

    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    started = threading.Event()

    def one(i: int) -> None:
        try:
            tokens: list[int] = []
            for chunk in client.completions.create(model=name, prompt=prompts[i], max_tokens=MAX_TOKENS, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True,
                                                                            "return_token_ids": True}):  # fmt: skip
                if chunk.choices:
                    tokens += chunk.choices[0].token_ids or []
                    if len(tokens) >= 10:
                        started.set()
            got[i] = tokens
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    assert started.wait(60)
    running.clear()
    deadline = time.monotonic() + 30
    while not any(running.values()):  # a heartbeat since: which instance runs them now
        assert time.monotonic() < deadline, "no decode instance ran the requests"
        time.sleep(0.01)
    busiest = max(running, key=lambda iid: running[iid])
    killed_at = time.monotonic()
    dict(mesh.procs)[busiest].send_signal(signal.SIGKILL)  # no drain, no goodbye
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert time.monotonic() - killed_at < 30
    for i in range(len(prompts)):
        assert got[i] == expected[i], i  # greedy: the move changes nothing
    assert metric(mesh, "migrations_total") >= 1, (busiest, running)
    assert metric(mesh, "prefill_site_total", site="remote") == 0  # all computed on decode

    # The only prefill instance dies: with conditional disaggregation on, decode takes the requests whole.
    dict(mesh.procs)["prefill-0"].send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 10  # NATS's advisory or three missed heartbeats of 0.2 s: not a fixed sleep
    while not metric(mesh, "instances_left_total", stage="prefill"):
        assert time.monotonic() < deadline, "the balancer never dropped prefill-0"
        time.sleep(0.05)
    out = client.completions.create(model=name, prompt=prompts[0], max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    assert out.choices[0].token_ids == expected[0]


def test_a_burst_sees_the_tokens_routed_before_it_and_spills_onto_decode(start_mesh, offline) -> None:
    """With prefill counted as the bottleneck from BURST_QUEUE queued tokens, a burst of
    long prompts arriving together: the first goes to prefill, and the balancer reserves
    its tokens there at once, so the ones routed while it awaits prefill's ack see them
    queued and are prefilled on decode (before the reservation moved to the ack, a whole
    burst saw an idle prefill instance: on the H200, 0 of 32 8k prompts went to decode)."""
    mesh = start_mesh(num_prefill=1, num_decode=1, extra_env={
        "INFERMESH_ENGINE__BLOCK_SIZE": str(BLOCK), "INFERMESH_WORKER__HEARTBEAT_INTERVAL_S": "0.2",
        "INFERMESH_BALANCER__LOCAL_PREFILL_QUEUE_TOKENS": str(len(LONG_PROMPT) // 2),
    })  # fmt: skip
    client = openai.OpenAI(base_url=mesh.api_url, api_key="x", max_retries=0, timeout=120)
    name = client.models.list().data[0].id
    rng = random.Random(11)
    prompts = [[rng.randrange(5, 500) for _ in range(len(LONG_PROMPT))] for _ in range(6)]  # nothing shared
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in offline.generate(prompts, params)]
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    go = threading.Barrier(len(prompts))

    def one(i: int) -> None:
        try:
            go.wait()
            out = client.completions.create(model=name, prompt=prompts[i], max_tokens=8, temperature=0,
                                            extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
            got[i] = out.choices[0].token_ids
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert [got[i] for i in range(len(prompts))] == expected
    remote = metric(mesh, "prefill_site_total", site="remote")
    spilled = metric(mesh, "prefill_site_total", site="local", reason="prefill_queue")
    assert remote + spilled == len(prompts)
    assert remote >= 1 and spilled >= len(prompts) // 2, (remote, spilled)
