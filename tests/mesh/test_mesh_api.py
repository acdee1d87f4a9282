"""vLLM's OpenAI fields and endpoints through the whole mesh (real nats-server,
kvcache, prefill, decode and balancer processes; conftest.py's `mesh`): lm-eval's
loglikelihood batch gives transformers' prompt logprobs (scored by prefill, carried
in the handoff and decode's first chunk), seeded n samples share the prompt's KV,
constraints reach the sampler, refusals name their field, the openai client's
models.retrieve and /tokenize work."""

import time
from typing import Any

import httpx
import openai
import pytest
import torch
import transformers

from shared.recipe import Recipe
from tools.launch.trace_view import load_spans

MESH = dict(
    num_prefill=1,
    num_decode=1,
    extra_env={"INFERMESH_ENGINE__BLOCK_SIZE": "16", "INFERMESH_WORKER__HEARTBEAT_INTERVAL_S": "0.2"},
)
MESH_SHARED = True  # shares the session's mesh of this MESH (conftest.py's `mesh`): its assertions hold on a used one
PROMPTS = ["The quick brown fox", "def add(a, b):\n    return", "Once upon a time, there", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def recipe(mesh_model_dir: str) -> Recipe:
    return Recipe.from_pretrained(mesh_model_dir)


@pytest.fixture(scope="module")
def model_name(mesh: Any) -> str:
    return httpx.get(mesh.api_url + "/models").json()["data"][0]["id"]


def complete(mesh: Any, model_name: str, **body: Any) -> dict[str, Any]:
    response = httpx.post(mesh.api_url + "/completions", json={"model": model_name, **body}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_lm_eval_loglikelihood_batch_equals_transformers(
    mesh: Any, model_name: str, recipe: Recipe, mesh_model_dir: str, max_tokens: int
) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(mesh_model_dir, dtype=torch.float32)
    prompts = [recipe.encode(text) for text in PROMPTS]
    out = complete(mesh, model_name, prompt=prompts, echo=True, logprobs=1, max_tokens=max_tokens, temperature=0.0)
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert out["usage"]["completion_tokens"] == 4 * max_tokens
    for prompt, choice in zip(prompts, choices):
        with torch.no_grad():
            rows = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
        expected = [rows[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(prompt) + max_tokens and lp["token_logprobs"][0] is None
        assert lp["token_logprobs"][1 : len(prompt)] == pytest.approx(expected, abs=1e-4)
        assert choice["text"].startswith(recipe.decode(prompt, skip_special_tokens=False))


def _prefill_spans(mesh: Any, response_id: str, count: int, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """The prefill spans of a request's trace, once `count` of them reached the trace files."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        spans = load_spans(mesh.trace_dir)
        root = next((s for s in spans if s["attributes"].get("request.id") == response_id and s["parent_id"] is None),
                    None)
        found = [s for s in spans if root is not None and s["trace_id"] == root["trace_id"] and s["name"] == "prefill"]
        if len(found) >= count:
            return found
        time.sleep(0.3)
    raise AssertionError(f"fewer than {count} prefill spans of {response_id}")


def test_seeded_n_samples_are_distinct_and_share_the_prompt_kv(mesh: Any, model_name: str) -> None:
    prompt = "".join(f"item {i}: a line of a list that fills a few KV blocks\n" for i in range(5))
    body = dict(prompt=prompt, n=3, max_tokens=10, temperature=1.0, seed=11)
    out = complete(mesh, model_name, **body)
    texts = [c["text"] for c in sorted(out["choices"], key=lambda c: c["index"])]
    assert len(set(texts)) == 3
    assert texts == [c["text"] for c in sorted(complete(mesh, model_name, **body)["choices"], key=lambda c: c["index"])]
    cached = sorted(s["attributes"]["prompt.cached_tokens"] for s in _prefill_spans(mesh, out["id"], 3))
    num_prompt = out["usage"]["prompt_tokens"]
    # The first sample prefilled alone; its siblings found the prompt's full blocks cached.
    assert cached[1] >= (num_prompt - 1) // 16 * 16 and cached[2] >= (num_prompt - 1) // 16 * 16


def test_constraints_through_the_mesh(mesh: Any, model_name: str) -> None:
    base = dict(prompt=PROMPTS[0], max_tokens=6, temperature=0.0, ignore_eos=True, return_token_ids=True)
    assert complete(mesh, model_name, **base, logit_bias={"42": 100})["choices"][0]["token_ids"] == [42] * 6
    allowed = complete(mesh, model_name, **{**base, "temperature": 1.0}, allowed_token_ids=[50, 60], seed=1)
    assert set(allowed["choices"][0]["token_ids"]) <= {50, 60}
    vocab = httpx.get(mesh.api_url.removesuffix("/v1") + "/tokenizer_info").json()["vocab_size"]
    # Refused by prefill's engine check; the field named by the Ack's param, not read from the text.
    for field, value in (("allowed_token_ids", [vocab + 10**5]), ("logit_bias", {str(vocab + 10**5): 1})):
        body = {"model": model_name, **base, field: value}
        refused = httpx.post(mesh.api_url + "/completions", timeout=60, json=body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text


def test_request_id_continuous_usage_and_endpoints(mesh: Any, model_name: str, recipe: Recipe) -> None:
    client = openai.OpenAI(base_url=mesh.api_url, api_key="x", max_retries=0, timeout=120)
    assert client.models.retrieve(model_name).id == model_name
    stream = client.completions.create(
        model=model_name, prompt=PROMPTS[1], max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        extra_body={"request_id": "mesh-req-1"},
    )
    chunks = list(stream)
    assert {c.id for c in chunks} == {"cmpl-mesh-req-1"}
    assert [c.usage.completion_tokens for c in chunks if c.choices] == sorted(
        c.usage.completion_tokens for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 5
    base = mesh.api_url.removesuffix("/v1")
    tokens = httpx.post(base + "/tokenize", json={"model": model_name, "prompt": PROMPTS[1]}).json()["tokens"]
    assert tokens == recipe.encode(PROMPTS[1])
    assert httpx.post(base + "/detokenize", json={"tokens": tokens}).json()["prompt"] == recipe.decode(
        tokens, skip_special_tokens=False)
    # The prefix-cache reset is an operator's switch, off by default: a 403 naming it.
    refused = httpx.post(base + "/reset_prefix_cache")
    assert refused.status_code == 403 and refused.json()["error"]["param"] == "balancer.prefix_cache_reset"
