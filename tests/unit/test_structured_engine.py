"""Structured outputs in the offline engine, on the seeded random default model: the
grammar alone must make every output valid (the model knows nothing of JSON).

50 random JSON schemas (tests/helpers/structured_schemas.py) greedy and sampled, with and
without speculation; regex, choice and EBNF; the first token; the compiled-grammar
cache; invalid grammars refused with a message; the matcher's per-draft masks."""

import json
import re

import jsonschema
import pytest
import torch

from shared.engine.engine_request import EngineRequest
from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from shared.engine.structured.grammar import build_grammar
from shared.engine.structured.matcher import GrammarState, bitmask_words
from shared.engine.structured.spec import StructuredSpec

from tests.helpers.structured_schemas import MAX_TOKENS, NUM_SCHEMAS, random_prompt, random_schema


@pytest.fixture(scope="module")
def llm(mesh_model_dir: str) -> LLM:
    return LLM(mesh_model_dir)


@pytest.fixture(scope="module")
def llm_spec(mesh_model_dir: str) -> LLM:
    return LLM(mesh_model_dir, speculative="ngram")


def _json_params(temperature: float) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=i,
                       structured=StructuredSpec("json", json.dumps(random_schema(i))))  # fmt: skip
        for i in range(NUM_SCHEMAS)
    ]


_RUNS: dict[tuple[bool, float], list[list[int]]] = {}


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_random_schemas_validate(llm: LLM, llm_spec: LLM, speculative: bool, temperature: float) -> None:
    engine = llm_spec if speculative else llm
    before = engine.engine.load()
    outs = engine.generate([random_prompt(i) for i in range(NUM_SCHEMAS)], _json_params(temperature))
    for i, out in enumerate(outs):
        assert out.finish_reason == "stop", (i, out.text)  # the grammar completed and forced EOS
        jsonschema.validate(json.loads(out.text), random_schema(i))
    _RUNS[(speculative, temperature)] = [o.token_ids for o in outs]
    if speculative:
        after = engine.engine.load()
        # Speculation really ran on these requests (no silent fallback), and drafts passed.
        assert after.num_spec_drafted_tokens > before.num_spec_drafted_tokens
        assert after.num_spec_accepted_tokens > before.num_spec_accepted_tokens
        assert not (after.spec_fallbacks or {}).get("structured")
        plain = _RUNS.get((False, temperature))
        if plain is not None:  # verification is lossless: the same tokens as without drafts
            assert _RUNS[(True, temperature)] == plain


def test_regex_and_choice(llm_spec: LLM) -> None:
    regex = r"[a-z]{2,6}@[0-9]{1,3}\.(com|org)"
    choices = ["yes", "no", "maybe so", 'say "hi"']
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=i, structured=StructuredSpec("regex", regex))
              for i in range(20)]  # fmt: skip
    params += [SamplingParams(max_tokens=40, temperature=1.0, seed=i, structured=StructuredSpec.choice(choices))
               for i in range(20)]  # fmt: skip
    params.append(SamplingParams(max_tokens=40, temperature=0.0, structured=StructuredSpec("regex", regex)))
    outs = llm_spec.generate([random_prompt(i) for i in range(len(params))], params)
    for out in outs[:20] + outs[40:]:
        assert re.fullmatch(regex, out.text), out.text
        assert out.finish_reason == "stop"
    assert {o.text for o in outs[20:40]} <= set(choices)
    assert len({o.text for o in outs[20:40]}) > 1  # sampled: the choice is the model's, not a constant


def test_ebnf_grammar(llm: LLM) -> None:
    ebnf = 'root ::= "(" num (op num){0,3} ")"\nnum ::= [1-9] [0-9]{0,2}\nop ::= " + " | " * "'
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=i, structured=StructuredSpec("grammar", ebnf))
              for i in range(20)]  # fmt: skip
    for out in llm.generate([random_prompt(i) for i in range(20)], params):
        assert re.fullmatch(r"\([1-9][0-9]{0,2}(( \+ | \* )[1-9][0-9]{0,2}){0,3}\)", out.text), out.text


def test_first_token_respects_the_grammar(llm: LLM) -> None:
    """max_tokens=1: the one token (what a prefill instance samples) is a valid start."""
    specs = [StructuredSpec("json", json.dumps(random_schema(i))) for i in range(10)]
    specs += [StructuredSpec("regex", r"zq[0-9]+"), StructuredSpec.choice(["banana", "cherry"])]
    params = [SamplingParams(max_tokens=1, temperature=1.0, seed=i, structured=s) for i, s in enumerate(specs)]
    outs = llm.generate([random_prompt(i) for i in range(len(specs))], params)
    compiler = llm.engine.runner.structured.compiler
    assert compiler is not None
    for spec, out in zip(specs, outs):
        state = GrammarState.create(compiler.compile(spec), compiler.stop_token_ids)
        assert state.matcher.accept_token(out.token_ids[0]), (spec.kind, out.token_ids)
    assert outs[-2].text.startswith(("z", "zq"))
    assert "banana".startswith(outs[-1].text) or "cherry".startswith(outs[-1].text)


def test_compiled_grammar_cache_hit(llm: LLM) -> None:
    compiler = llm.engine.runner.structured.compiler
    assert compiler is not None
    spec = StructuredSpec("json", json.dumps({"type": "object", "properties": {"cached": {"type": "boolean"}}}))
    llm.generate(["a"], SamplingParams(max_tokens=30, structured=spec))
    misses, hits = compiler.stats.num_misses, compiler.stats.num_hits
    same = StructuredSpec("json", spec.source)  # another request, the same content
    llm.generate(["b"], SamplingParams(max_tokens=30, structured=same))
    assert compiler.stats.num_misses == misses
    assert compiler.stats.num_hits >= hits + 2  # admission and the runner's matcher


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredSpec("json", '{"type": "strng"}'), 'Unsupported type "strng"'),
        (StructuredSpec("json", '{"type": "object",'), "not valid JSON"),
        (StructuredSpec("json", '{"type": "array", "minItems": 3, "maxItems": 1}'), "minItems is greater than maxItems"),
        (StructuredSpec("json", '{"not": {"type": "string"}}'), "keyword 'not' at # is not supported"),
        (StructuredSpec("json", '{"type": "object", "properties": {"a": {"if": {}}}}'), "at #/properties/a"),
        (StructuredSpec("regex", "ab(c"), "parenthesis is not closed"),
        (StructuredSpec("grammar", "root ::= missing"), 'Rule "missing" is not defined'),
        (StructuredSpec("structural_tag", '{"x": 1}'), "format"),
    ],
)
def test_invalid_grammars_are_refused(llm: LLM, spec: StructuredSpec, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        build_grammar(spec)
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.engine.add_request(EngineRequest("bad", "hi", SamplingParams(structured=spec)))
    assert not llm.engine.has_unfinished_requests()


def test_spec_checks() -> None:
    with pytest.raises(ValueError, match="kind must be one of"):
        StructuredSpec("yaml", "x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_tokens cannot be used with structured outputs"):
        SamplingParams(min_tokens=2, structured=StructuredSpec("regex", "a+"))
    assert StructuredSpec("regex", "a").key == StructuredSpec("regex", "a").key != StructuredSpec("regex", "b").key


def test_draft_masks_walk_and_roll_back(llm: LLM) -> None:
    """Row i of a draft's masks is the mask after the first i drafted tokens; the matcher
    ends where it began; past a token the grammar refuses, rows repeat its mask."""
    compiler = llm.engine.runner.structured.compiler
    assert compiler is not None
    recipe = llm.recipe
    spec = StructuredSpec("regex", "abc(de|xy)z")
    state = GrammarState.create(compiler.compile(spec), compiler.stop_token_ids)
    vocab = compiler.vocab_size
    draft = [recipe.encode(c, add_special_tokens=False)[0] for c in "abcd"]
    masks = torch.zeros(len(draft) + 1, bitmask_words(vocab), dtype=torch.int32)
    state.fill_draft(draft, masks)
    expected = torch.zeros_like(masks)
    walker = GrammarState.create(compiler.compile(spec), compiler.stop_token_ids)
    for i in range(len(draft) + 1):
        walker.fill(expected, i)
        if i < len(draft):
            assert walker.matcher.accept_token(draft[i])
    assert torch.equal(masks, expected)
    again = torch.zeros(1, bitmask_words(vocab), dtype=torch.int32)
    state.fill(again, 0)
    assert torch.equal(again[0], expected[0])  # rolled back to the start
    refused = [draft[0], recipe.encode("q", add_special_tokens=False)[0], draft[2]]
    masks = torch.zeros(len(refused) + 1, bitmask_words(vocab), dtype=torch.int32)
    state.fill_draft(refused, masks)
    assert torch.equal(masks[1], expected[1]) and torch.equal(masks[2], masks[1]) and torch.equal(masks[3], masks[1])
    state.sync(draft[:2])  # the output the step emitted: accepted lazily, as a handoff's is replayed
    state.fill(again, 0)
    assert torch.equal(again[0], expected[2])
