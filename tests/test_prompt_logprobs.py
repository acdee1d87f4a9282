"""Prompt logprobs in the engine: each prompt token's logprob, rank and top
alternatives equal transformers' own log-softmax over the same checkpoint, with the
prompt cut into chunks, and also when the prompt is already in the prefix cache
(a scored prompt is computed in full)."""

import pytest
import torch
import transformers

from shared.engine.engine_request import EngineRequest
from shared.engine.llm_engine import LLMEngine
from shared.engine.config import EngineConfig
from shared.engine.outputs import RequestOutput
from shared.engine.sampling_params import SamplingParams
from tools.make_model import make_model

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\nprint([fibonacci(i) for i in range(10)])\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("prompt-logprobs-model")
    make_model(path)
    return str(path)


def run(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    engine.add_request(EngineRequest(rid, prompt, params))
    outputs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == rid]
    return outputs


def test_prompt_logprobs_equal_transformers(model_dir: str) -> None:
    engine = LLMEngine(EngineConfig(model=model_dir, block_size=16, prefill_chunk_size=24, max_num_batched_tokens=24))
    assert engine.recipe is not None
    prompt = engine.recipe.encode(PROMPT)
    assert len(prompt) > 48  # three chunks at least
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)

    for attempt in ("cold", "cached"):  # the second run's prompt is in the prefix cache
        outputs = run(engine, attempt, prompt, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3))
        scored = outputs[0].prompt_logprobs
        assert scored is not None and len(scored) == len(prompt) and scored[0] is None, attempt
        assert all(o.prompt_logprobs is None for o in outputs[1:])  # given once
        for pos in range(1, len(prompt)):
            entry, row = scored[pos], expected[pos - 1]
            assert entry is not None and entry.token_id == prompt[pos]
            assert entry.logprob == pytest.approx(row[prompt[pos]].item(), abs=1e-4)
            assert entry.rank == int((row >= row[prompt[pos]]).sum())
            top_values, top_ids = row.topk(3)
            assert [t for t, _ in entry.top] == top_ids.tolist()
            assert [v for _, v in entry.top] == pytest.approx(top_values.tolist(), abs=1e-4)
        assert outputs[-1].num_cached_tokens == 0, attempt  # never served from the cache

    # The same prompt without prompt_logprobs does hit the cache the scored runs left.
    plain = run(engine, "plain", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    assert plain[-1].num_cached_tokens >= 32 and plain[-1].prompt_logprobs is None


def test_constraints_out_of_the_vocabulary_are_refused(model_dir: str) -> None:
    engine = LLMEngine(EngineConfig(model=model_dir, block_size=16, num_kv_blocks=32, max_model_len=256))
    vocab = engine.model.config.vocab_size
    with pytest.raises(ValueError, match="^logit_bias names token ids past the vocabulary"):
        engine.add_request(EngineRequest("x", [1, 2, 3], SamplingParams(logit_bias={vocab: 1.0})))
