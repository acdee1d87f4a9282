"""Bad input through the whole mesh (real processes, conftest.py's `mesh`): values
that would not fit their protobuf field, or a NATS message, are a 400 naming the
field at the balancer's edge, never a 5xx from deep in the mesh; the largest
values that fit cross every hop. tests/unit/test_openai_api.py has the full table of
bad inputs against the HTTP layer over a local engine."""

import json
from pathlib import Path
from typing import Any

import httpx

from services.balancer.frontend.protocol import MAX_CACHE_SALT_CHARS, MAX_STOP_TOKEN_IDS


def test_protobuf_ranges_and_nats_sizes_are_400s_through_the_mesh(mesh: Any, mesh_model_dir: str) -> None:
    url = mesh.api_url + "/completions"
    model = httpx.get(mesh.api_url + "/models").json()["data"][0]["id"]
    base = {"model": model, "prompt": "def f(x):", "max_tokens": 3, "temperature": 0}
    vocab = json.loads((Path(mesh_model_dir) / "config.json").read_text())["vocab_size"]

    def post(body: dict[str, Any]) -> httpx.Response:
        # json.dumps writes NaN as clients can (httpx's own encoder refuses it).
        content = json.dumps(body).encode()
        return httpx.post(url, content=content, headers={"Content-Type": "application/json"}, timeout=60)

    bad = [
        ({"prompt": [-1]}, "prompt.0"),
        ({"prompt": [2**32]}, "prompt.0"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**80}, "seed"),
        ({"top_k": 2**40}, "top_k"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"temperature": float("nan")}, "temperature"),
        ({"cache_salt": "s" * (1 << 20)}, "cache_salt"),  # a NATS message holds 1 MiB
        ({"prompt": "a\ud800b"}, "prompt"),
        ({"temperature": float("inf")}, "temperature"),
        ({"not_a_field": 1}, "not_a_field"),  # a field the mesh does not implement: refused by name
    ]
    table: list[tuple[str, str, str]] = []  # input, status without / with stream, param: the figures

    def shown(change: dict[str, Any]) -> str:
        text = json.dumps(change)
        return text if len(text) < 60 else text[:40] + f"... ({len(text)} chars)"

    for change, param in bad:
        codes = []
        for stream in (False, True):
            response = post({**base, **change, "stream": stream})
            codes.append(str(response.status_code))
            assert response.status_code == 400, (change, response.text)
            error = response.json()["error"]
            assert error["param"] == param and error["type"] == "invalid_request_error", error
        table.append((shown(change), " / ".join(codes), param))
    # stream_options without stream; chat's add_generation_prompt given as 0 (types are strict).
    response = post({**base, "stream_options": {"include_usage": True}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "stream_options", response.text
    table.append(('{"stream_options": {...}} without stream', f"{response.status_code} / -", "stream_options"))
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    response = httpx.post(mesh.api_url + "/chat/completions", json={**chat, "add_generation_prompt": 0}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "add_generation_prompt", response.text
    table.append(('chat {"add_generation_prompt": 0}', f"{response.status_code} / -", "add_generation_prompt"))
    limit = post({**base, "cache_salt": "s" * (1 << 20)}).json()["error"]["message"]
    assert f"at most {MAX_CACHE_SALT_CHARS}" in limit
    # Past the vocabulary: prefill refuses it in its Ack, a 400 too.
    past_vocab = post({**base, "prompt": [5, vocab]})
    assert past_vocab.status_code == 400 and f"[0, {vocab})" in past_vocab.json()["error"]["message"]
    table.append((f'{{"prompt": [5, {vocab}]}} (past the vocabulary)', f"{past_vocab.status_code} / -",
                  str(past_vocab.json()["error"].get("param"))))
    print("\nbad input through the mesh | status (stream false / true) | param")
    for row in table:
        print(" | ".join(row))

    greedy = post(base).json()
    assert greedy["usage"]["completion_tokens"] == 3
    # The largest values that fit cross every hop; top_k past the vocabulary keeps every token.
    edge = post({**base, "seed": 2**63 - 1, "top_k": 2**32 - 1, "stop_token_ids": [2**32 - 1], "temperature": 1.0,
                 "cache_salt": "s" * MAX_CACHE_SALT_CHARS})
    assert edge.status_code == 200 and edge.json()["usage"]["completion_tokens"] == 3, edge.text
    assert post(base).json()["choices"][0]["text"] == greedy["choices"][0]["text"]
