"""KV through NIXL in a running mesh whose kvcache, prefill and decode each run in a
PID namespace of their own, as containers run them (Mesh.pid_namespaces): decode
cannot map prefill's cache through /proc, so the same-namespace copy (left on)
refuses the peer and the next link reads the held blocks through NIXL; the tokens
and logprobs are the offline engine's and each request's decode span says
kv.path=nixl. tests/mesh/test_namespaces.py gives each its own network too."""

import openai
import pytest

from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from tests.helpers.mesh_procs import span_attributes
from tests.helpers.nixl_wheel import skip_without_nixl

skip_without_nixl()

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"

MESH = dict(
    num_prefill=1,
    num_decode=1,
    pid_namespaces=True,
    extra_env={"INFERMESH_ENGINE__BLOCK_SIZE": "16"},
)


@pytest.fixture(scope="module")
def offline(mesh_model_dir):
    return LLM(mesh_model_dir, block_size=16)


def test_decode_reads_prefills_kv_through_nixl_with_the_offline_logprobs(mesh, offline):
    client = openai.OpenAI(base_url=mesh.api_url, api_key="x", max_retries=0, timeout=120)
    name = client.models.list().data[0].id
    for k, prompt in enumerate([PROMPT * 6, "# nixl\n" + PROMPT * 11]):
        params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=1)
        expected = offline.generate([prompt], params)[0]
        out = client.completions.create(model=name, prompt=prompt, max_tokens=10, temperature=0, logprobs=1)
        choice = out.choices[0]
        assert choice.text == expected.text
        ours = choice.logprobs.token_logprobs
        theirs = [lp.logprob for lp in expected.logprobs]
        assert ours == pytest.approx(theirs, abs=1e-4)
        attrs = span_attributes(mesh.trace_dir, out.id, "decode")
        assert attrs["kv.path"] == "nixl", attrs
        assert attrs["kv.loaded_direct"] is True and attrs["kv.load_failed"] is False and attrs["kv.loaded_blocks"] >= 3 + k
        assert attrs["kv.loaded_bytes"] > 0 and 0 < attrs["kv.copy_ms"] <= attrs["kv.load_ms"]
        held = span_attributes(mesh.trace_dir, out.id, "prefill")
        assert held["kv.held_blocks"] >= attrs["kv.loaded_blocks"]
