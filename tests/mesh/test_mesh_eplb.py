"""Live EPLB through the mesh (issue 28, points 3-5): `infermesh up --tensor-parallel-size 2
--enable-expert-parallel --enable-eplb --eplb-config JSON` (up's parallel_env, as `up`
hands it to every instance) on make-model's tiny Qwen3-MoE (3 MoE layers of 8 experts,
top 2), prefill and decode each over two gloo ranks, two redundant expert slots, a new
placement every few steps; batch-invariant mode, under which expert parallelism gives the
one-process logits bitwise (tests/parity/test_expert_parallel_engine.py).

Under a steady load of concurrent streaming requests (a closed loop: each stream sends
its next request when the last ends):

- every request completes, with the greedy tokens of the same requests run by one
  process without EPLB (no expert parallelism at all), although
- experts moved while they ran, on both instances: each instance's log has moves
  started in the background and switched on every rank, and the decode instance's
  heartbeat and infermesh_decode_eplb_rebalances_total count applied placements;
- the heartbeats carry the instance's per-layer expert load over its two ranks, with the
  redundant slots, and /metrics the same per layer (infermesh_<stage>_eplb_balancedness);
- the balancer routed every request by the EP policy (route span decode.reason
  "expert_balance") on the heartbeat's balancedness: a cost of (requests + 1) over a step
  balancedness below 1 is not a whole number.

With two such decode instances, the EP load balancer (policies.choose_expert_parallel)
routes each request by what the instances' own heartbeats say: requests sent one at a
time, each when both instances are idle, are each charged 1 / the instance's step
balancedness (the sum over MoE layers of the mean tokens per rank over the sum of the
busiest rank's, from its last heartbeat), and go to the cheaper one. Least-loaded
routing would tie the two idle instances and pick at random: the second request goes
to the instance that has seen no token yet (balancedness 1), whichever took the first."""

import json
import re
import threading
import time
from collections.abc import Sequence

import openai
import pytest

from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from shared.proto import mesh_pb2
from tests.helpers.expert_mesh import decode_heartbeats, moe_layers
from tests.helpers.mesh import running_mesh
from tests.helpers.mesh_procs import span_attributes
from tests.helpers.metrics import scrape
from tools.launch.up import parallel_env
from tools.make_model import make_model

BLOCK = 16
EPLB = {"window_size": 4, "step_interval": 2, "num_redundant_experts": 2}
"""A placement every 2 steps from the last 4: prefill, which steps once or so per request, moves experts too."""
ENV = {
    **parallel_env(2, True, True, json.dumps(EPLB)),
    "INFERMESH_ENGINE__BLOCK_SIZE": str(BLOCK),
    "INFERMESH_ENGINE__BATCH_INVARIANT": "true",
    "INFERMESH_WORKER__HEARTBEAT_INTERVAL_S": "0.2",
}
STREAMS = 6
REQUESTS = 18
MAX_TOKENS = 32
PROMPTS = [[(37 * i + 11 * j) % 4000 + 10 for j in range(20 + 3 * i)] for i in range(REQUESTS)]
"""Token-id prompts of 20 to 71 tokens (two to five blocks), each its own: prefill steps enough to move experts too."""
MOVE_STARTED = re.compile(r"EPLB: layer (\d+) moving, in the background")
MOVE_SWITCHED = re.compile(r"EPLB: layer (\d+) switched on every rank \(steps beside its move: (\d+)\)")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = str(tmp_path_factory.mktemp("qwen3_moe"))
    make_model(folder, arch="qwen3_moe", seed=0)
    return folder


def _one_process_tokens(model: str) -> list[list[int]]:
    """The requests' greedy tokens from one process: no expert parallelism, no EPLB."""
    offline = LLM(model, block_size=BLOCK, batch_invariant=True)
    try:
        outputs = offline.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    finally:
        offline.engine.close()
    return [o.token_ids for o in outputs]


def _steady_load(client: openai.OpenAI) -> tuple[dict[int, list[int]], dict[int, str], list[str]]:
    """REQUESTS streamed greedy completions, STREAMS at a time: each request's token ids
    (from the stream's chunks), its id, and the errors."""
    name = client.models.list().data[0].id
    tokens: dict[int, list[int]] = {}
    ids: dict[int, str] = {}
    errors: list[str] = []

    def stream(first: int) -> None:
        for i in range(first, REQUESTS, STREAMS):
            got: list[int] = []
            try:
                chunks = client.completions.create(model=name, prompt=PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
                for chunk in chunks:
                    ids[i] = chunk.id
                    if chunk.choices and chunk.choices[0].token_ids:
                        got += chunk.choices[0].token_ids
            except Exception as exc:  # noqa: BLE001  (counted)
                errors.append(f"request {i}: {type(exc).__name__}: {exc}")
            tokens[i] = got

    threads = [threading.Thread(target=stream, args=(s,)) for s in range(STREAMS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    return tokens, ids, errors


def test_experts_move_under_load_and_every_request_keeps_its_tokens(model: str, tmp_path_factory) -> None:  # noqa: ANN001
    expected = _one_process_tokens(model)
    num_layers = moe_layers(model)
    with running_mesh(model, tmp_path_factory.mktemp("eplb-mesh"), extra_env=ENV) as mesh:
        client = openai.OpenAI(base_url=mesh.api_url, api_key="x", max_retries=0, timeout=300)
        tokens, ids, errors = _steady_load(client)
        assert errors == []
        assert [tokens[i] for i in range(REQUESTS)] == expected

        # Experts moved in the background and switched while the requests ran, on both instances.
        for stage in ("prefill", "decode"):
            log = (mesh.state_dir / "logs" / f"{stage}-0.log").read_text()
            started, switched = MOVE_STARTED.findall(log), MOVE_SWITCHED.findall(log)
            assert len(switched) >= 1 and len(started) >= len(switched), stage
            assert {int(layer) for layer in started} <= set(range(num_layers))

        beat = decode_heartbeats(mesh.nats_url, 1.0)[-1].load.expert_load
        assert (beat.num_ranks, len(beat.layers), beat.num_redundant_experts) == (2, num_layers, 2)
        assert beat.num_rebalances >= 1  # every layer of a changed placement switched on both ranks
        assert all(0.5 <= layer.balancedness <= 1.0 and layer.max_tokens_per_rank > 0 for layer in beat.layers)
        for stage in ("prefill", "decode"):
            samples = scrape(f"http://127.0.0.1:{mesh.metrics_ports[f'{stage}-0']}/metrics")
            assert samples[(f"infermesh_{stage}_expert_parallel_ranks", frozenset())] == 2.0
            # A placement counts once a step after its last switch asks for the next move:
            # prefill's last placement may wait for a next request, decode's many steps count.
            assert samples[(f"infermesh_{stage}_eplb_rebalances_total", frozenset())] >= (stage == "decode")
            for index in range(num_layers):
                balance = samples[(f"infermesh_{stage}_eplb_balancedness", frozenset({("layer", str(index))}))]
                assert 0.5 <= balance <= 1.0, (stage, index)  # mean / max over two ranks

        # The EP load balancer chose decode for every request from the heartbeats' expert load.
        routes = [span_attributes(mesh.trace_dir, ids[i], "route") for i in range(REQUESTS)]
        assert {route["decode.reason"] for route in routes} == {"expert_balance"}
        costs = [cost for route in routes for cost in route["decode.scores"]]
        assert any(cost != round(cost) for cost in costs), costs  # (requests + 1) / balancedness < 1


def _step_balancedness(load: mesh_pb2.ExpertLoad) -> float:
    """Sum over layers of the mean tokens per rank over the sum of the busiest rank's (1: no tokens)."""
    busiest = sum(layer.max_tokens_per_rank for layer in load.layers)
    return sum(layer.mean_tokens_per_rank for layer in load.layers) / busiest if busiest else 1.0


def _idle_heartbeats(mesh, instances: Sequence[str], timeout_s: float = 30.0) -> dict[str, mesh_pb2.Heartbeat]:  # noqa: ANN001
    """The last heartbeat of each decode instance, once each says it runs and queues
    nothing: the balancer then charges no request to either (a heartbeat clears what it
    sent since the one before)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        last = {hb.instance_id: hb for hb in decode_heartbeats(mesh.nats_url, 0.6)}
        if set(last) == set(instances) and all(hb.load.num_running == hb.load.num_waiting == 0 for hb in last.values()):
            time.sleep(0.1)  # the balancer heard the same beats
            return last
    raise AssertionError(f"the decode instances {instances} were not idle within {timeout_s} s")


def test_the_ep_balancer_routes_each_request_by_the_heartbeats_balancedness(model: str, tmp_path_factory) -> None:  # noqa: ANN001
    with running_mesh(model, tmp_path_factory.mktemp("eplb-two-decode"), num_decode=2, extra_env=ENV) as mesh:
        client = openai.OpenAI(base_url=mesh.api_url, api_key="x", max_retries=0, timeout=300)
        name = client.models.list().data[0].id
        instances = sorted({hb.instance_id for hb in decode_heartbeats(mesh.nats_url, 1.0)})
        assert len(instances) == 2
        chosen: list[str] = []
        for prompt in PROMPTS[:6]:
            beats = _idle_heartbeats(mesh, instances)
            expected = {iid: 1 / _step_balancedness(beats[iid].load.expert_load) for iid in instances}
            out = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0,
                                            extra_body={"ignore_eos": True})  # fmt: skip
            assert out.usage.completion_tokens == 8
            route = span_attributes(mesh.trace_dir, out.id, "route")
            assert route["decode.reason"] == "expert_balance"
            costs = dict(zip(route["decode.candidates"], route["decode.scores"]))
            assert costs == pytest.approx(expected, rel=1e-12)
            if expected[instances[0]] != expected[instances[1]]:
                assert route["decode.choice"] == min(instances, key=expected.__getitem__)
            chosen.append(route["decode.choice"])
        assert chosen[1] != chosen[0]  # the first made its instance's balancedness < 1; the other's is 1
