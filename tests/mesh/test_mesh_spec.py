"""Speculative decoding through the mesh (issue 13, point 4): decode instances
speculate (prompt lookup, set for the deployment by INFERMESH_ENGINE__SPECULATIVE),
greedy output equals offline decoding without speculation, and what speculation
did is reported three ways that must agree: each response's usage (OpenAI's
accepted/rejected prediction tokens), decode's vllm:spec_decode_* series, and the
decode span of each request's trace."""

import time

import openai

from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from tests.helpers.mesh_procs import span_attributes
from tests.helpers.metrics import sample, scrape

SPEC_TOKENS = 3
MESH = dict(
    num_prefill=1,
    num_decode=1,
    extra_env={
        "INFERMESH_ENGINE__SPECULATIVE": "ngram",
        "INFERMESH_ENGINE__SPEC_TOKENS": str(SPEC_TOKENS),
        "INFERMESH_WORKER__HEARTBEAT_INTERVAL_S": "0.2",
    },
)
# Repetitive prompts: prompt lookup finds what followed, and a seeded random model
# given a loop tends to continue it, so drafts are made, and some pass.
PROMPTS = [
    "one two three four one two three four one two three four one two",
    "a b c d e f a b c d e f a b c d e f a b c",
    "x = x + 1\nx = x + 1\nx = x + 1\nx = x + 1\n",
]
MAX_TOKENS = 40


def test_decode_speculates_losslessly_and_reports_it_in_usage_metrics_and_traces(mesh, mesh_model_dir):
    client = openai.OpenAI(base_url=mesh.api_url, api_key="x")
    name = client.models.list().data[0].id
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    expected = LLM(mesh_model_dir).generate(PROMPTS, params)
    decode_metrics = f"http://127.0.0.1:{mesh.metrics_ports['decode-0']}/metrics"
    model = {"model_name": name}
    before = scrape(decode_metrics)
    drafted = accepted = 0
    for prompt, want in zip(PROMPTS, expected):
        out = client.completions.create(
            model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
        )
        assert out.choices[0].text == want.text  # lossless: as decoding without speculation
        details = out.usage.completion_tokens_details
        assert details is not None, "speculation ran, so usage says what it did"
        n_accepted, n_rejected = details.accepted_prediction_tokens, details.rejected_prediction_tokens
        assert n_accepted + n_rejected > 0
        span = span_attributes(mesh.trace_dir, out.id, "decode")
        assert (span["spec.drafted_tokens"], span["spec.accepted_tokens"]) == (n_accepted + n_rejected, n_accepted)
        drafted += n_accepted + n_rejected
        accepted += n_accepted
    assert accepted > 0, "the seeded model continues its loops: some drafts must pass"

    def grew(samples, name: str, **labels: str) -> float:
        return sample(samples, name, **labels) - sample(before, name, **labels)

    def settled() -> bool:  # the series move at each heartbeat
        return grew(scrape(decode_metrics), "vllm:spec_decode_num_draft_tokens_total", **model) == drafted

    deadline = time.monotonic() + 10
    while not settled():
        assert time.monotonic() < deadline, "decode's spec_decode series did not reach the requests' drafts"
        time.sleep(0.2)
    after = scrape(decode_metrics)
    assert grew(after, "vllm:spec_decode_num_accepted_tokens_total", **model) == accepted
    per_position = [grew(after, "vllm:spec_decode_num_accepted_tokens_per_pos_total", **model, position=str(k))
                    for k in range(SPEC_TOKENS)]  # fmt: skip
    assert sum(per_position) == accepted
    assert per_position == sorted(per_position, reverse=True)  # position k passes only after k-1 did
    assert grew(after, "vllm:spec_decode_num_drafts_total", **model) > 0
    assert sample(after, "infermesh_decode_spec_mean_accepted_length") > 1.0
