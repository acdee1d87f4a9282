"""Sliding-window KV through the mesh, on a model whose layers alternate full
attention and a sliding window (swa_replay left to its default: exact, the model
was not trained for bounded replay).

- Direct handoff (prefill and decode on one host): prefill holds the sliding-window
  blocks a query at the handoff sees beside the full-attention ones, decode copies
  both out of its cache and replays nothing; tokens and logprobs are the offline
  engine's.
- Through kvcache (direct transfer off): kvcache holds only the full-attention
  blocks; decode loads them and, having no sliding-window KV, replays the last
  L_swa * (W - 1) tokens: its output must be the offline cold run's, token for token
  and (within rounding) logprob for logprob, on a prompt of whole blocks where a replay
  one token short would show."""

import openai
import pytest

from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from tools.make_model import make_model
from tests.helpers.mesh_procs import span_attributes

WINDOW = 12
BLOCK = 16
ENV = {"INFERMESH_ENGINE__BLOCK_SIZE": str(BLOCK)}


@pytest.fixture(scope="module")
def hybrid_model_dir(tmp_path_factory) -> str:
    """The default preset as Qwen2 with every other layer sliding (a tokenizer included)."""
    path = tmp_path_factory.mktemp("hybrid-model")
    make_model(path, arch="qwen2", sliding_window=WINDOW)
    return str(path)


@pytest.fixture(scope="module")
def offline(hybrid_model_dir) -> LLM:
    return LLM(hybrid_model_dir, block_size=BLOCK, enable_prefix_caching=False)


def hybrid_mesh(model_dir: str, state_dir, **env: str):  # noqa: ANN001, ANN201
    from tests.helpers.mesh import running_mesh

    return running_mesh(model_dir, state_dir, extra_env={**ENV, **env})


def test_a_direct_handoff_carries_the_window_and_equals_the_offline_engine(
    hybrid_model_dir, offline, tmp_path_factory
):
    prompt = "".join(f"line {i}: carry the window across with the blocks\n" for i in range(8))
    greedy = SamplingParams(max_tokens=24, temperature=0.0, logprobs=1, ignore_eos=True)
    expected = offline.generate([prompt], greedy)[0]
    assert len(expected.prompt_token_ids) > 2 * (WINDOW - 1) + BLOCK  # long enough that a replay would show
    with hybrid_mesh(hybrid_model_dir, tmp_path_factory.mktemp("hybrid-mesh")) as mesh:
        client = openai.OpenAI(base_url=mesh.api_url, api_key="x", max_retries=0, timeout=120)
        out = client.completions.create(
            model=client.models.list().data[0].id, prompt=prompt, max_tokens=24, temperature=0, logprobs=1,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )  # fmt: skip
        attrs = span_attributes(mesh.trace_dir, out.id, "decode")
    choice = out.choices[0]
    assert choice.token_ids == expected.token_ids and choice.text == expected.text
    # Decode's first step computes the prompt's partial last block with the first token
    # (other matmul shapes than offline's): rounding apart, the logprobs are the same
    # (bounded replay would be ~1e-3 off).
    assert choice.logprobs.token_logprobs == pytest.approx([lp.logprob for lp in expected.logprobs], abs=1e-5)
    assert attrs["kv.loaded_direct"] is True and attrs["kv.load_failed"] is False
    assert attrs["kv.loaded_blocks"] == len(expected.prompt_token_ids) // BLOCK
    assert attrs["kv.replayed_tokens"] == 0  # the window came with the blocks


def test_exact_replay_through_kvcache_equals_a_cold_run(hybrid_model_dir, offline, tmp_path_factory):
    text = "".join(f"step {i}: move the block from tower A to tower C\n" for i in range(8))
    ids = offline.generate([text], SamplingParams(max_tokens=1))[0].prompt_token_ids
    # Whole blocks only: decode's first query (the token prefill sampled) sits at the hit,
    # and its window reaches back through both sliding layers to the replay's first token,
    # so a replay one token short would show in the second token's logprob (~1e-3 off;
    # greedy tokens do not see it).
    prompt = ids[: len(ids) // BLOCK * BLOCK]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, logprobs=1, ignore_eos=True)
    expected = offline.generate([prompt], greedy)[0]
    assert len(prompt) > 2 * (WINDOW - 1) + BLOCK  # long enough to replay
    state = tmp_path_factory.mktemp("hybrid-mesh-kvcache")
    with hybrid_mesh(hybrid_model_dir, state, INFERMESH_ENGINE__KV_DIRECT_TRANSFER="false") as mesh:
        client = openai.OpenAI(base_url=mesh.api_url, api_key="x", max_retries=0, timeout=120)
        out = client.completions.create(
            model=client.models.list().data[0].id, prompt=prompt, max_tokens=24, temperature=0, logprobs=1,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )  # fmt: skip
        attrs = span_attributes(mesh.trace_dir, out.id, "decode")
    choice = out.choices[0]
    assert choice.token_ids == expected.token_ids
    # The replay's matmuls have other shapes than the offline prefill's: rounding apart
    # (~1e-6), the logprobs are the cold run's.
    assert choice.logprobs.token_logprobs == pytest.approx([lp.logprob for lp in expected.logprobs], abs=1e-5)
    # Decode loaded the full-attention blocks from kvcache and rebuilt the sliding window by replay.
    assert attrs["kv.loaded_direct"] is False
    assert attrs["kv.loaded_blocks"] == len(prompt) // BLOCK
    assert attrs["kv.replayed_tokens"] == 2 * (WINDOW - 1)
    assert attrs["kv.load_failed"] is False
