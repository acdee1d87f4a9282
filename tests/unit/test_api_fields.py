"""vLLM's OpenAI fields and endpoints on the balancer's HTTP layer over a real
in-process engine (LocalGenerator, uvicorn on a free port): each field has the
effect vLLM gives it, checked against the engine or transformers, or is refused
with a 400 naming it. tests/mesh/test_mesh_api.py runs the same requests through the mesh."""

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import torch
import transformers

from services.balancer.frontend.api import create_app
from services.balancer.generation import GenerationRequest, Generator, TokenEvent
from services.balancer.local import LocalGenerator
from shared.engine.config import EngineConfig
from tools.make_model import make_model
from shared.recipe import Recipe
from shared.runtime.metrics import Metrics
from shared.runtime.settings import BalancerSettings
from tests.helpers.uvicorn_app import serve

MODEL = "tiny"
MAX_MODEL_LEN = 256


class StartOrder:
    """The real generator, noting the order in which requests start generating."""

    def __init__(self, inner: Generator) -> None:
        self.inner = inner
        self.started: list[int] = []

    def num_in_flight(self) -> int:
        return self.inner.num_in_flight()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        self.started.append(request.priority)
        async for event in self.inner.generate(request):
            yield event


@dataclass
class Server:
    url: str
    model_dir: str
    recipe: Recipe
    order: StartOrder
    queued_url: str
    """max_dispatched_requests = 1: requests wait in priority order."""

    def post(self, path: str, body: dict[str, Any], url: str | None = None, **kw: Any) -> httpx.Response:
        return httpx.post((url or self.url) + path, json=body, timeout=60, **kw)

    def complete(self, **body: Any) -> dict[str, Any]:
        response = self.post("/v1/completions", {"model": MODEL, **body})
        assert response.status_code == 200, response.text
        return response.json()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model_dir = str(tmp_path_factory.mktemp("api-fields-model"))
    make_model(model_dir)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    config = EngineConfig(model=model_dir, block_size=16, num_kv_blocks=128, max_model_len=MAX_MODEL_LEN)
    generator = LocalGenerator.start(config, loop)
    recipe = Recipe.from_pretrained(model_dir)
    order = StartOrder(generator)

    def app(settings: BalancerSettings) -> Any:
        return create_app(generator=order, recipe=recipe, model_name=MODEL, max_model_len=MAX_MODEL_LEN,
                          settings=settings, metrics=Metrics("balancer"))

    served = [serve(loop, app(BalancerSettings())), serve(loop, app(BalancerSettings(max_dispatched_requests=1)))]
    yield Server(served[0].url, model_dir, recipe, order, served[1].url)
    for one in served:
        one.stop()
    asyncio.run_coroutine_threadsafe(generator.shutdown(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


@pytest.fixture(scope="module")
def hf_logprobs(server: Server) -> Any:
    model = transformers.AutoModelForCausalLM.from_pretrained(server.model_dir, dtype=torch.float32)

    def logprobs(prompt: list[int]) -> list[float]:
        """transformers' logprob of each prompt token after the first."""
        with torch.no_grad():
            rows = model(torch.tensor([prompt])).logits[0].log_softmax(-1)
        return [rows[i - 1, prompt[i]].item() for i in range(1, len(prompt))]

    return logprobs


PROMPTS = ["The quick brown fox", "def add(a, b):\n    return", "Once upon a time, there", "1, 2, 3, 4,"]


# -- lm-eval's loglikelihood requests ---------------------------------------------------


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_lm_eval_loglikelihood_batch(server: Server, hf_logprobs: Any, max_tokens: int) -> None:
    prompts = [server.recipe.encode(text) for text in PROMPTS]
    body = dict(prompt=prompts, echo=True, logprobs=1, max_tokens=max_tokens, temperature=0.0, seed=1234)
    out = server.complete(**body)
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert out["usage"]["prompt_tokens"] == sum(map(len, prompts))
    assert out["usage"]["completion_tokens"] == 4 * max_tokens
    for prompt, choice in zip(prompts, choices):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(prompt) + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][1 : len(prompt)] == pytest.approx(hf_logprobs(prompt), abs=1e-4)
        # lm-eval's greedy check: the token's logprob against the best of top_logprobs.
        for token_lp, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
            assert len(top) in (1, 2) and max(top.values()) >= token_lp
        text = server.recipe.decode(prompt, skip_special_tokens=False)
        assert choice["text"].startswith(text) and (max_tokens or choice["text"] == text)
        assert lp["text_offset"][0] == 0
    if max_tokens == 0:
        assert all(c["finish_reason"] == "length" for c in choices)


def test_prompt_logprobs_field(server: Server, hf_logprobs: Any) -> None:
    out = server.complete(prompt=PROMPTS[1], prompt_logprobs=2, max_tokens=1, temperature=0.0, return_token_ids=True)
    choice = out["choices"][0]
    prompt = choice["prompt_token_ids"]
    assert prompt == server.recipe.encode(PROMPTS[1])
    scored = choice["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(prompt)
    for pos, (entry, expected) in enumerate(zip(scored[1:], hf_logprobs(prompt)), start=1):
        own = entry[str(prompt[pos])]
        assert own["logprob"] == pytest.approx(expected, abs=1e-4)
        assert len(entry) in (2, 3) and sorted(e["rank"] for e in entry.values())[:2] == [1, 2]
    assert choice["logprobs"] is None  # not asked


# -- n, best_of, seeds ------------------------------------------------------------------


def test_n_gives_distinct_seeded_samples_and_best_of_picks_the_likeliest(server: Server) -> None:
    body = dict(prompt=PROMPTS[2], max_tokens=12, temperature=1.0, seed=7, logprobs=0)
    out = server.complete(**body, n=4)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in out["choices"]]
    assert len(set(texts)) == 4  # four seeds, four samples
    assert texts == [c["text"] for c in server.complete(**body, n=4)["choices"]]  # seeded: repeatable
    assert out["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in out["choices"])
    # Sample i is drawn with seed + i: best_of draws the same four and keeps the likeliest two.
    score = {c["text"]: sum(c["logprobs"]["token_logprobs"]) for c in out["choices"]}
    best = server.complete(**{**body, "logprobs": None}, n=2, best_of=4)
    assert [c["text"] for c in best["choices"]] == sorted(score, key=lambda t: -score[t])[:2]
    assert best["choices"][0]["logprobs"] is None  # ranked with logprobs the client did not ask for


def test_list_prompts_stream_every_choice_with_its_index(server: Server) -> None:
    body = dict(prompt=PROMPTS[:2], n=2, max_tokens=6, temperature=0.0, stream=True,
                stream_options={"include_usage": True, "continuous_usage_stats": True})
    texts: dict[int, str] = {}
    usages = []
    with httpx.stream("POST", server.url + "/v1/completions", json={"model": MODEL, **body}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                usages.append(chunk["usage"])
                for c in chunk["choices"]:
                    texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    whole = server.complete(**{k: v for k, v in body.items() if k not in ("stream", "stream_options")})
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert all(u is not None for u in usages)  # continuous usage: on every chunk
    assert usages[-1] == whole["usage"]


def test_streamed_token_ids_include_tokens_whose_text_is_held_back(server: Server) -> None:
    """A token whose text is held back (it could begin a stop string) makes an empty
    text delta; with return_token_ids its id must still reach the client."""
    base = dict(prompt=PROMPTS[0], max_tokens=12, temperature=0.0, ignore_eos=True, return_token_ids=True)
    whole = server.complete(**base)["choices"][0]["token_ids"]
    held = next(t for t in whole[3:] if server.recipe.decode([t]).strip())
    stop = server.recipe.decode([held]) + "\u2603"  # its text, then a character the output never has
    streamed: list[int] = []
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"model": MODEL, **base, "stop": [stop], "stream": True}) as r:  # fmt: skip
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed += c["token_ids"] or []
    assert streamed == whole


# -- constraints --------------------------------------------------------------------------


def test_logit_bias_allowed_token_ids_and_bad_words(server: Server) -> None:
    base = dict(prompt=PROMPTS[0], max_tokens=8, temperature=0.0, ignore_eos=True, return_token_ids=True)
    plain = server.complete(**base)["choices"][0]["token_ids"]
    biased = server.complete(**base, logit_bias={"42": 100})["choices"][0]["token_ids"]
    assert biased == [42] * 8 and plain != biased
    allowed = server.complete(**{**base, "temperature": 1.0}, allowed_token_ids=[50, 60], seed=3)["choices"][0]
    assert set(allowed["token_ids"]) <= {50, 60}
    # Ban the greedy continuation's second token as a word: the output changes and never contains it.
    word = server.recipe.decode(plain[1:2])
    banned = server.complete(**base, bad_words=[word])["choices"][0]
    tokenized = [server.recipe.encode(word.lstrip(), add_special_tokens=False),
                 server.recipe.encode(" " + word.lstrip(), add_special_tokens=False)]
    assert banned["token_ids"] != plain
    for bad in tokenized:
        ids = banned["token_ids"]
        assert not any(ids[i : i + len(bad)] == bad for i in range(len(ids)))


# -- prompt handling --------------------------------------------------------------------


def test_truncate_add_special_tokens_and_continue_final_message(server: Server) -> None:
    full = server.recipe.encode(PROMPTS[1])
    cut = server.complete(prompt=PROMPTS[1], truncate_prompt_tokens=5, max_tokens=4, temperature=0.0)
    same = server.complete(prompt=full[-5:], max_tokens=4, temperature=0.0)
    assert cut["usage"]["prompt_tokens"] == 5 and cut["choices"][0]["text"] == same["choices"][0]["text"]
    bare = server.complete(prompt=PROMPTS[1], add_special_tokens=False, max_tokens=1, return_token_ids=True)
    assert bare["choices"][0]["prompt_token_ids"] == server.recipe.encode(PROMPTS[1], add_special_tokens=False)
    assert len(bare["choices"][0]["prompt_token_ids"]) < len(full)  # no BOS

    messages = [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "One, two,"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0.0, "return_token_ids": True}
    open_ = server.post("/v1/chat/completions", {**body, "add_generation_prompt": False,
                                                  "continue_final_message": True}).json()
    closed = server.post("/v1/chat/completions", {**body, "add_generation_prompt": False}).json()
    rendered = server.recipe.apply_chat_template(messages, add_generation_prompt=False)
    expected = server.recipe.encode(rendered[: rendered.rindex("One, two,") + len("One, two,")], add_special_tokens=False)
    assert open_["prompt_token_ids"] == expected != closed["prompt_token_ids"]
    refused = server.post("/v1/chat/completions", {**body, "continue_final_message": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "continue_final_message"


def test_return_tokens_as_token_ids_request_id_and_header(server: Server) -> None:
    out = server.post("/v1/completions", {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 3, "logprobs": 1,
                                          "return_tokens_as_token_ids": True, "return_token_ids": True,
                                          "request_id": "my-request-1"})
    body = out.json()
    assert body["id"] == "cmpl-my-request-1" and out.headers["x-request-id"] == "my-request-1"
    assert body["choices"][0]["logprobs"]["tokens"] == [f"token_id:{t}" for t in body["choices"][0]["token_ids"]]
    by_header = server.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 2}, headers={"X-Request-Id": "from-header"})
    assert by_header.json()["id"] == "chatcmpl-from-header" and by_header.headers["x-request-id"] == "from-header"


def test_priority_orders_the_balancer_queue(server: Server) -> None:
    refused = server.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1, "priority": 1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"
    server.order.started.clear()
    body = {"model": MODEL, "prompt": PROMPTS[0], "ignore_eos": True, "temperature": 0.0}

    def send(priority: int, max_tokens: int = 4) -> httpx.Response:
        return server.post("/v1/completions", {**body, "priority": priority, "max_tokens": max_tokens},
                           url=server.queued_url)

    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(send, 0, 240)  # holds the one place for a while
        deadline = time.monotonic() + 10
        while not server.order.started and time.monotonic() < deadline:
            time.sleep(0.01)
        later = [pool.submit(send, 5), pool.submit(send, 3)]
        time.sleep(0.1)  # both wait behind the first
        urgent = pool.submit(send, -2)
        assert all(f.result().status_code == 200 for f in [first, *later, urgent])
    assert server.order.started == [0, -2, 3, 5]


# -- refused fields -------------------------------------------------------------------------


@pytest.mark.parametrize(("change", "param"), [
    ({"suffix": "}"}, "suffix"),
    ({"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
    ({"best_of": 1, "n": 2}, "best_of"),
    ({"best_of": 3, "n": 1, "stream": True}, "best_of"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 17}, "n"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [99999]}, "allowed_token_ids"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"request_id": "has space"}, "request_id"),
    ({"prompt": ["a"] * 65}, "prompt"),
    ({"use_beam_search": True}, "use_beam_search"),
])
def test_fields_we_cannot_honour_are_400s_naming_them(server: Server, change: dict[str, Any], param: str) -> None:
    response = server.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, **change})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


# -- endpoints ----------------------------------------------------------------------------


def test_endpoints(server: Server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.max_model_len == MAX_MODEL_LEN  # type: ignore[attr-defined]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    tokens = server.post("/tokenize", {"model": MODEL, "prompt": PROMPTS[0], "return_token_strs": True}).json()
    assert tokens["tokens"] == server.recipe.encode(PROMPTS[0]) and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == MAX_MODEL_LEN and len(tokens["token_strs"]) == tokens["count"]
    messages = [{"role": "user", "content": "hi"}]
    chat = server.post("/tokenize", {"model": MODEL, "messages": messages}).json()
    assert chat["tokens"] == server.recipe.encode_chat(messages)
    # With tools: the prompt a chat request with them makes (its usage counts the same tokens).
    tools = [{"type": "function", "function": {"name": "get_time", "description": "The time in a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
    with_tools = server.post("/tokenize", {"model": MODEL, "messages": messages, "tools": tools}).json()
    assert with_tools["count"] > chat["count"]
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=1)  # type: ignore[arg-type]
    assert reply.usage is not None and reply.usage.prompt_tokens == with_tools["count"]
    text = server.post("/detokenize", {"model": MODEL, "tokens": tokens["tokens"]}).json()["prompt"]
    assert text == server.recipe.decode(tokens["tokens"], skip_special_tokens=False)
    assert server.post("/detokenize", {"tokens": [10**6]}).json()["error"]["param"] == "tokens"
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["vocab_size"] == server.recipe.vocab_size and info["eos_token_ids"]
    assert httpx.get(server.url + "/version").json()["version"]
    assert httpx.get(server.url + "/ping").status_code == 200 and httpx.post(server.url + "/ping").status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200
    schema = httpx.get(server.url + "/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models/{model_id}", "/tokenize", "/detokenize"):
        assert path in schema["paths"], path
    streamed = schema["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert set(streamed) == {"application/json", "text/event-stream"}
    assert "CompletionRequest" in schema["components"]["schemas"]
    docs = httpx.get(server.url + "/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
