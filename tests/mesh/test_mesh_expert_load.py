"""The EP balancer's inputs through a real mesh (issue 28, point 4): make-model's tiny
qwen3_moe served by nats-server, kvcache, prefill, decode and the balancer as
processes. After a few requests the decode instance's heartbeats carry its expert
load per MoE layer (one rank today: the engine is one process, so every layer is
balanced), its /metrics say the same per layer, and the balancer routes decode by the
EP policy (the route span's decode.reason)."""


import openai
import pytest

from tests.helpers.expert_mesh import decode_heartbeats, moe_layers
from tests.helpers.mesh_procs import span_attributes
from tests.helpers.metrics import scrape
from tools.make_model import make_model

ENV = {"INFERMESH_ENGINE__BLOCK_SIZE": "16", "INFERMESH_WORKER__HEARTBEAT_INTERVAL_S": "0.2"}
PROMPTS = ["the quick brown fox jumps over the lazy dog " * 3, "count: one two three four five six"]
MAX_TOKENS = 8


def test_decode_reports_per_layer_expert_load_in_heartbeats_and_metrics(tmp_path_factory: pytest.TempPathFactory) -> None:
    from tests.helpers.mesh import running_mesh

    model = str(tmp_path_factory.mktemp("qwen3_moe"))
    make_model(model, arch="qwen3_moe", seed=0)
    num_layers = moe_layers(model)
    with running_mesh(model, tmp_path_factory.mktemp("mesh"), extra_env=ENV) as mesh:
        client = openai.OpenAI(base_url=mesh.api_url, api_key="x", max_retries=0, timeout=120)
        name = client.models.list().data[0].id
        ids = [client.completions.create(model=name, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                         extra_body={"ignore_eos": True}).id for p in PROMPTS]  # fmt: skip
        # The engine's window spans its last 1000 steps: the requests' steps are in it.
        beats = decode_heartbeats(mesh.nats_url, 1.0)
        assert beats and all(hb.load.HasField("expert_load") for hb in beats)
        load = beats[-1].load.expert_load
        assert (load.num_ranks, len(load.layers)) == (1, num_layers)
        assert load.window_steps > 0
        # Decode computed each request's last prompt token and its new tokens but the last,
        # top_k (2) choices each, in every MoE layer; one rank holds them all.
        for layer in load.layers:
            assert layer.balancedness == 1.0
            assert layer.max_tokens_per_rank == layer.mean_tokens_per_rank > 0
            assert layer.max_tokens_per_rank % 2 == 0
        assert len({layer.max_tokens_per_rank for layer in load.layers}) == 1  # every token, every layer
        samples = scrape(f"http://127.0.0.1:{mesh.metrics_ports['decode-0']}/metrics")
        for index in range(num_layers):
            layer = frozenset({("layer", str(index))})
            assert samples[("infermesh_decode_eplb_balancedness", layer)] == 1.0
            assert samples[("infermesh_decode_expert_tokens_per_rank_max", layer)] == load.layers[index].max_tokens_per_rank
        assert samples[("infermesh_decode_expert_parallel_ranks", frozenset())] == 1.0
        for request_id in ids:
            assert span_attributes(mesh.trace_dir, request_id, "route")["decode.reason"] == "expert_balance"
