"""SWA replay through the mesh, on a model whose layers alternate full attention
and a sliding window. Prefill stores only the full-attention blocks in kvcache;
decode loads them and, having no sliding-window KV, replays the last
L_swa * (W - 1) tokens (swa_replay=exact): its output must be the offline cold
run's, token for token."""

import openai
import pytest

from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from tools.make_model import make_model
from tests.helpers.mesh_procs import span_attributes

WINDOW = 12
BLOCK = 16


@pytest.fixture(scope="module")
def hybrid_model_dir(tmp_path_factory) -> str:
    """The default preset as Qwen2 with every other layer sliding (a tokenizer included)."""
    path = tmp_path_factory.mktemp("hybrid-model")
    make_model(path, arch="qwen2", sliding_window=WINDOW)
    return str(path)


@pytest.fixture(scope="module")
def hybrid_mesh(hybrid_model_dir, tmp_path_factory):
    from tests.helpers.mesh import running_mesh as _running_mesh

    env = {"INFERMESH_ENGINE__BLOCK_SIZE": str(BLOCK), "INFERMESH_ENGINE__SWA_REPLAY": "exact"}
    with _running_mesh(hybrid_model_dir, tmp_path_factory.mktemp("hybrid-mesh"), extra_env=env) as mesh:
        yield mesh


def test_exact_replay_through_the_mesh_equals_a_cold_run(hybrid_mesh, hybrid_model_dir):
    client = openai.OpenAI(base_url=hybrid_mesh.api_url, api_key="x", max_retries=0, timeout=120)
    name = client.models.list().data[0].id
    prompt = "".join(f"step {i}: move the block from tower A to tower C\n" for i in range(8))
    cold = LLM(hybrid_model_dir, block_size=BLOCK, enable_prefix_caching=False)
    expected = cold.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))[0]
    assert len(expected.prompt_token_ids) > 2 * (WINDOW - 1) + BLOCK  # long enough to replay
    out = client.completions.create(model=name, prompt=prompt, max_tokens=24, temperature=0)
    assert out.choices[0].text == expected.text
    # Decode loaded the full-attention blocks and rebuilt the sliding window by replay.
    attrs = span_attributes(hybrid_mesh.trace_dir, out.id, "decode")
    assert attrs["kv.loaded_blocks"] == len(expected.prompt_token_ids) // BLOCK
    assert attrs["kv.replayed_tokens"] == 2 * (WINDOW - 1)
    assert attrs["kv.load_failed"] is False
