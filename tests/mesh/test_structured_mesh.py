"""Structured outputs through a real mesh (nats-server, kvcache, prefill, decode with
ngram speculation, the balancer), asked for as a user would with the openai client:
the first token sampled by prefill, the rest by decode after the handoff (its
matcher rebuilt from the tokens it receives), drafts verified under the grammar.
Every output of the seeded random model parses and validates, whole and streamed;
bad constraints get 400s naming the field."""

import asyncio
import json
import re
from typing import Any

import jsonschema
import openai
import pytest

from tests.helpers.structured_schemas import MAX_TOKENS, NUM_SCHEMAS, random_prompt, random_schema

MESH = dict(num_prefill=1, num_decode=1, extra_env={"INFERMESH_ENGINE__SPECULATIVE": "ngram"})


def _accepted(usage: Any) -> int:
    details = getattr(usage, "completion_tokens_details", None)
    return (getattr(details, "accepted_prediction_tokens", None) or 0) if details is not None else 0


async def test_random_schemas_whole_and_streamed(mesh) -> None:
    client = openai.AsyncOpenAI(base_url=mesh.api_url, api_key="x", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id

    async def whole(i: int) -> tuple[str, str | None, int]:
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": random_schema(i), "strict": True}}
        r = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": random_prompt(i)}], response_format=fmt,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS, temperature=1.0, seed=i,
        )
        return r.choices[0].message.content or "", r.choices[0].finish_reason, _accepted(r.usage)

    async def streamed(i: int) -> tuple[str, str | None, int]:
        stream = await client.completions.create(
            model=model, prompt=random_prompt(i), max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"structured_outputs": {"json": random_schema(i)}},
        )
        text, finish, accepted = "", None, 0
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.text
                finish = choice.finish_reason or finish
            if chunk.usage is not None:
                accepted = _accepted(chunk.usage)
        return text, finish, accepted

    for ask in (whole, streamed):
        results = await asyncio.gather(*(ask(i) for i in range(NUM_SCHEMAS)))
        for i, (text, finish, _) in enumerate(results):
            assert finish == "stop", (ask.__name__, i, text)
            jsonschema.validate(json.loads(text), random_schema(i))
        # Decode speculated on these requests (usage reports accepted drafts only when it ran).
        assert sum(accepted for _, _, accepted in results) > 0, ask.__name__


async def test_completions_take_response_format_too(mesh) -> None:
    """vLLM's completions accept response_format as chat does: the same constraint."""
    client = openai.AsyncOpenAI(base_url=mesh.api_url, api_key="x", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id

    async def one(i: int) -> tuple[str, str | None]:
        fmt = {"type": "json_schema", "json_schema": {"name": f"c{i}", "schema": random_schema(i), "strict": True}}
        r = await client.completions.create(model=model, prompt=random_prompt(i), max_tokens=MAX_TOKENS,
                                            temperature=1.0, seed=i, extra_body={"response_format": fmt})  # fmt: skip
        return r.choices[0].text, r.choices[0].finish_reason

    for i, (text, finish) in enumerate(await asyncio.gather(*(one(i) for i in range(4)))):
        assert finish == "stop", (i, text)
        jsonschema.validate(json.loads(text), random_schema(i))


async def test_regex_choice_and_grammar(mesh) -> None:
    client = openai.AsyncOpenAI(base_url=mesh.api_url, api_key="x", max_retries=0)
    model = (await client.models.list()).data[0].id
    regex = r"[a-z]{2,6}@[0-9]{1,3}\.(com|org)"
    choices = ["yes", "no", "maybe so"]
    ebnf = 'root ::= "(" [1-9] [0-9]{0,2} (" + " [1-9] [0-9]{0,2}){0,3} ")"'

    async def one(i: int, extra: dict[str, Any], stream: bool) -> str:
        kwargs = dict(model=model, prompt=random_prompt(i), max_tokens=60, temperature=1.0, seed=i, extra_body=extra)
        if not stream:
            return (await client.completions.create(**kwargs)).choices[0].text  # type: ignore[call-overload]
        return "".join([c.choices[0].text async for c in await client.completions.create(stream=True, **kwargs)])  # type: ignore[call-overload]

    asks = [(i, {"guided_regex": regex}, i % 2 == 0) for i in range(8)]
    asks += [(i, {"structured_outputs": {"choice": choices}}, i % 2 == 1) for i in range(8)]
    asks += [(i, {"guided_grammar": ebnf}, i % 2 == 0) for i in range(4)]
    texts = await asyncio.gather(*(one(*ask) for ask in asks))
    for text in texts[:8]:
        assert re.fullmatch(regex, text), text
    assert set(texts[8:16]) <= set(choices)
    for text in texts[16:]:
        assert re.fullmatch(r"\([1-9][0-9]{0,2}( \+ [1-9][0-9]{0,2}){0,3}\)", text), text


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}},
         "response_format.json_schema.schema", 'Unsupported type "strng"'),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema", "is required"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
         "response_format.json_schema.schema", "keyword 'not' at # is not supported"),
        ({"structured_outputs": {"regex": "ab(c"}}, "structured_outputs.regex", "parenthesis is not closed"),
        ({"structured_outputs": {"grammar": "root ::= nothing"}}, "structured_outputs.grammar", 'Rule "nothing"'),
        ({"structured_outputs": {"jsn": {"type": "object"}}}, "structured_outputs.jsn", "not supported"),
        ({"structured_outputs": {}}, "structured_outputs", "name one of"),
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "only one structured output constraint"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_choice": []}, "guided_choice", "at least 1"),
        ({"guided_regex": "a+", "min_tokens": 2}, "min_tokens", "cannot be used with structured outputs"),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(mesh, body: dict[str, Any], param: str, message: str) -> None:
    import httpx

    request = {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **body}
    models = httpx.get(f"{mesh.api_url}/models").json()
    request["model"] = models["data"][0]["id"]
    r = httpx.post(f"{mesh.api_url}/chat/completions", json=request, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert message in error["message"], error
