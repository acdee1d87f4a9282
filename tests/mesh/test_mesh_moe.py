"""The three MoE families through a real mesh (issue 12, point 6): for make-model's
tiny qwen3_moe, gpt_oss and deepseek_v4 checkpoints, a mesh (nats-server, kvcache,
prefill, decode, balancer as processes) serves a prompt; a second mesh on the same
state folder (fresh prefill and decode, kvcache's LMDB kept) serves the prompt
extended. The second request hits the first one's blocks in kvcache (cached tokens in
usage, blocks loaded by prefill), and both outputs equal offline greedy generation
without prefix caching. GPT-OSS's sliding layers and V4's state caches are rebuilt by
replay (swa_replay=exact: equal to a cold run); V4 loads only its compressed blocks."""

import asyncio
import time
from pathlib import Path

import openai
import pytest

from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from shared.kv.wire.client import KVCacheClient
from tools.make_model import make_model
from tests.helpers.mesh_procs import span_attributes

BLOCK = 16
NUM_NEW = 12
ENV = {"INFERMESH_ENGINE__BLOCK_SIZE": str(BLOCK), "INFERMESH_ENGINE__SWA_REPLAY": "exact"}
PROMPT = "".join(f"step {i}: move the disk from peg A to peg C, then count the moves\n" for i in range(40))
SUFFIX = "How many moves were made in all?"


def kvcache_holds(address: str, hashes: list, timeout_s: float = 30.0) -> int:
    """How many of the chain's leading blocks kvcache holds, once it holds them all
    (prefill writes behind) or the time is up."""

    async def lookup() -> int:
        client = KVCacheClient(address)
        try:
            return await client.lookup(hashes)
        finally:
            await client.close()

    deadline = time.monotonic() + timeout_s
    found = asyncio.run(lookup())
    while found < len(hashes) and time.monotonic() < deadline:
        time.sleep(0.3)
        found = asyncio.run(lookup())
    return found


def complete(api_url: str, prompt: str):  # noqa: ANN201
    client = openai.OpenAI(base_url=api_url, api_key="x", max_retries=0, timeout=300)
    name = client.models.list().data[0].id
    return client.completions.create(model=name, prompt=prompt, max_tokens=NUM_NEW, temperature=0)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "deepseek_v4"])
def test_prefix_hit_through_kvcache_equals_offline_greedy(arch: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    from tests.helpers.mesh import running_mesh as _running_mesh

    model = str(tmp_path_factory.mktemp(f"{arch}-model"))
    make_model(model, arch=arch, seed=0)
    cold = LLM(model, block_size=BLOCK, enable_prefix_caching=False, swa_replay="exact")
    greedy = SamplingParams(max_tokens=NUM_NEW, temperature=0.0)
    first, second = cold.generate([PROMPT, PROMPT + SUFFIX], greedy)
    replay = cold.engine.kv.replay_length  # exact: every sliding (or state) cache x (window - 1)
    shared = next(
        (i for i, (a, b) in enumerate(zip(first.prompt_token_ids, second.prompt_token_ids)) if a != b),
        len(first.prompt_token_ids),
    )
    hit_blocks = shared // BLOCK
    # Long enough that the hit keeps blocks past the replay (V4: 4 state caches x 127 tokens).
    assert hit_blocks * BLOCK > replay + BLOCK, (arch, shared, replay)
    hashes = cold.engine.kv.hash_chain(first.prompt_token_ids)
    state: Path = tmp_path_factory.mktemp(f"{arch}-mesh")

    with _running_mesh(model, state, extra_env=ENV) as mesh:
        out = complete(mesh.api_url, PROMPT)
        assert out.choices[0].text == first.text
        assert out.usage.prompt_tokens_details.cached_tokens == 0
        assert kvcache_holds(mesh.kv_address, hashes) == len(first.prompt_token_ids) // BLOCK

    with _running_mesh(model, state, extra_env=ENV) as mesh:  # fresh prefill and decode, kvcache's blocks kept
        out = complete(mesh.api_url, PROMPT + SUFFIX)
        assert out.choices[0].text == second.text
        assert out.usage.prompt_tokens_details.cached_tokens == hit_blocks * BLOCK
        attrs = span_attributes(mesh.trace_dir, out.id, "prefill")
        assert attrs["kv.load_failed"] is False and attrs["kv.loaded_direct"] is False
        assert attrs["kv.loaded_blocks"] == hit_blocks  # from kvcache: nothing else holds them
        assert attrs["kv.replayed_tokens"] == replay  # GPT-OSS's windows, V4's state caches; 0 for Qwen3-MoE
    if arch == "qwen3_moe":
        assert replay == 0
    else:
        assert replay > 0
