"""A graceful stop keeps the KV a worker was writing behind (issue 32): a prompt
answered and the mesh stopped at once (what SIGTERM to `infermesh up` does:
Mesh.stop) is a prefix hit after a restart on the same kvcache LMDB folder. The
workers drain and flush their saves to kvcache before kvcache stops and commits."""

import openai

from tests.helpers.mesh import kv_stats, running_mesh

BLOCK = 16
EXTRA_ENV = {
    "INFERMESH_ENGINE__BLOCK_SIZE": str(BLOCK),
    "INFERMESH_KVCACHE__LOAD_WHEN_FASTER": "false",  # a hit is loaded, however cheap recomputing it is here
}
PROMPT = [(29 * i + 7) % 450 + 5 for i in range(426)]
"""426 token ids: 26 full blocks and 10 tokens (the issue's prompt)."""


def _complete(mesh) -> openai.types.Completion:  # noqa: ANN001
    client = openai.OpenAI(base_url=mesh.api_url, api_key="x", max_retries=0, timeout=120)
    name = client.models.list().data[0].id
    return client.completions.create(model=name, prompt=PROMPT, max_tokens=2, temperature=0,
                                      extra_body={"ignore_eos": True})  # fmt: skip


def test_a_prompt_answered_right_before_a_stop_is_a_prefix_hit_after_the_restart(mesh_model_dir, tmp_path):
    state_dir = tmp_path / "mesh"
    full_blocks = len(PROMPT) // BLOCK
    with running_mesh(mesh_model_dir, state_dir, extra_env=EXTRA_ENV) as mesh:
        first = _complete(mesh)
        assert first.usage.prompt_tokens == len(PROMPT)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
    # running_mesh's exit stopped the mesh the moment the answer came: no wait for the store.
    with running_mesh(mesh_model_dir, state_dir, extra_env=EXTRA_ENV) as mesh:
        assert kv_stats(mesh).num_blocks >= full_blocks  # kvcache reopened its LMDB with the blocks in it
        again = _complete(mesh)
    assert again.usage.prompt_tokens_details.cached_tokens == full_blocks * BLOCK
    assert again.choices[0].text == first.choices[0].text
