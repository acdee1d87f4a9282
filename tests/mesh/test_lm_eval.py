"""lm-evaluation-harness against the whole mesh (real nats-server, kvcache, prefill,
decode and balancer processes; conftest.py's `mesh`, here on the committed default
model): its `local-completions` model runs the two local tasks of tests/data/lm_eval/
(a multiple-choice cloze on Python code, scored as loglikelihood requests with echo,
logprobs and max_tokens 1; the perplexity of a few lines of Python, scored as
loglikelihood_rolling), once one prompt a request, once with batch_size 4 (list
prompts) and once with the tokenizer lm-eval finds on the server (/tokenizer_info,
/tokenize). Every loglikelihood lm-eval computes is transformers' own for the same
tokens, every request is answered 200, and the three runs give the same numbers.

lm-eval runs in a child process: offline (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE; its
tasks read local JSON files, its tokenizer is the model folder's), and its global
seeding stays out of this process."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import transformers

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "models" / "trained" / "target"
TASKS_DIR = ROOT / "tests" / "data" / "lm_eval"
CLOZE, PERPLEXITY = "infermesh_pycloze", "infermesh_pycode_perplexity"
BOS_ID = 0  # <|begin_of_text|> in the default model's tokenizer (test_perplexity_is_transformers checks it)
MESH = dict(num_prefill=1, num_decode=1, extra_env={"INFERMESH_ENGINE__BLOCK_SIZE": "16"})

# The child: one simple_evaluate per run (the task index built once, from our folder
# only), each run's samples and metrics, and the balancer's request counters after it.
DRIVER = r"""
import json, sys
import httpx
from prometheus_client.parser import text_string_to_metric_families
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager

spec = json.loads(sys.argv[1])
tasks = TaskManager(include_path=spec["tasks_dir"], include_defaults=False)


def requests_total():
    text = httpx.get(spec["metrics_url"], timeout=30).raise_for_status().text
    return {
        s.labels["endpoint"] + " " + s.labels["status"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "infermesh_balancer_requests_total"
    }


def scores(resps):
    return [float(r[0]) if isinstance(r, (list, tuple)) else float(r) for r in resps]


out = {"before": requests_total(), "runs": {}}
for name, run in spec["runs"].items():
    result = simple_evaluate(
        model="local-completions", model_args=run["model_args"], tasks=spec["tasks"], batch_size=run["batch_size"],
        task_manager=tasks, log_samples=True,
    )
    out["runs"][name] = {
        "metrics": {
            t: {k: v for k, v in m.items() if isinstance(v, (int, float))} for t, m in result["results"].items()
        },
        "samples": {
            t: {s["doc_id"]: scores(s["filtered_resps"]) for s in samples} for t, samples in result["samples"].items()
        },
        "requests": requests_total(),
    }
with open(spec["out"], "w") as f:
    json.dump(out, f)
"""


@pytest.fixture(scope="session")
def mesh_model_dir() -> str:
    """conftest's meshes, here on the committed default model: trained on Python, so
    the cloze's accuracy says something (a random model's would be chance)."""
    return str(TARGET)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def runs(mesh: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """lm-eval's three runs against the mesh, in one child process."""
    work = tmp_path_factory.mktemp("lm-eval")
    name = httpx.get(mesh.api_url + "/models").json()["data"][0]["id"]
    base = f"model={name},base_url={mesh.api_url}/completions,max_retries=1"
    hf_tokenizer = f"{base},tokenizer_backend=huggingface,tokenizer={TARGET}"
    spec = {
        "tasks_dir": str(TASKS_DIR),
        "tasks": [CLOZE, PERPLEXITY],
        "metrics_url": mesh.api_url.removesuffix("/v1") + "/metrics",
        "out": str(work / "runs.json"),
        "runs": {
            "batch_1": {"model_args": hf_tokenizer, "batch_size": 1},
            "batch_4": {"model_args": hf_tokenizer, "batch_size": 4},
            # No tokenizer named: lm-eval probes the server and tokenizes through it. Its
            # RemoteTokenizer takes `bos_token_id or eos_token_id` as the prefix of a
            # rolling window, so this model's bos id 0 would give way to eos: named here.
            "remote_tokenizer": {"model_args": f"{base},custom_prefix_token_id={BOS_ID}", "batch_size": 1},
        },
    }
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(work / "hf"),  # datasets' cache of the task files
        "TOKENIZERS_PARALLELISM": "false",
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }
    # cwd: the task files name their data relative to the repository root.
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(spec)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads((work / "runs.json").read_text())


def requests_during(runs: dict[str, Any], name: str) -> dict[str, float]:
    """The balancer's requests by 'endpoint status' that the run `name` made (nonzero
    only; the driver's own scrapes of /metrics left out)."""
    order = list(runs["runs"])
    before = runs["before"] if order.index(name) == 0 else runs["runs"][order[order.index(name) - 1]]["requests"]
    after = runs["runs"][name]["requests"]
    return {
        k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0) and not k.startswith("/metrics ")
    }


@pytest.fixture(scope="module")
def hf() -> tuple[Any, Any]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(TARGET)
    model = transformers.AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    return tokenizer, model


def loglikelihood(model: Any, tokens: list[int], start: int) -> float:
    """transformers' log p(tokens[start:] | tokens[:start])."""
    with torch.no_grad():
        rows = model(torch.tensor([tokens])).logits[0].log_softmax(-1)
    return sum(rows[i - 1, tokens[i]].item() for i in range(start, len(tokens)))


def test_multiple_choice_loglikelihoods_are_transformers(runs: dict[str, Any], hf: tuple[Any, Any]) -> None:
    tokenizer, model = hf
    docs = read_jsonl(TASKS_DIR / "pycloze.jsonl")
    got = runs["runs"]["batch_1"]["samples"][CLOZE]
    assert sorted(map(int, got)) == list(range(len(docs)))
    correct = correct_norm = 0
    for i, doc in enumerate(docs):
        context = tokenizer(doc["context"], add_special_tokens=False).input_ids
        expected = []
        for choice in doc["choices"]:
            whole = tokenizer(doc["context"] + choice, add_special_tokens=False).input_ids
            # The data keeps each choice's tokens apart from its context's (lm-eval
            # scores context tokens + whole[len(context):], the real text only then).
            assert whole[: len(context)] == context, (i, choice)
            expected.append(loglikelihood(model, whole, len(context)))
        assert got[str(i)] == pytest.approx(expected, abs=1e-3), i
        correct += max(range(len(expected)), key=expected.__getitem__) == doc["label"]
        normed = [ll / len(choice) for ll, choice in zip(expected, doc["choices"])]
        correct_norm += max(range(len(normed)), key=normed.__getitem__) == doc["label"]
    metrics = runs["runs"]["batch_1"]["metrics"][CLOZE]
    assert metrics["acc,none"] == pytest.approx(correct / len(docs))
    assert metrics["acc_norm,none"] == pytest.approx(correct_norm / len(docs))
    assert metrics["acc,none"] >= 0.75  # chance is 0.25: the model knows its Python
    # One request a choice (12 x 4) and one a perplexity document, all answered.
    assert requests_during(runs, "batch_1") == {"/v1/completions 200": 48 + 4}


def test_perplexity_is_transformers(runs: dict[str, Any], hf: tuple[Any, Any]) -> None:
    tokenizer, model = hf
    docs = [d["text"] for d in read_jsonl(TASKS_DIR / "pycode_text.jsonl")]
    got = runs["runs"]["batch_1"]["samples"][PERPLEXITY]
    assert tokenizer.bos_token_id == BOS_ID
    # Each document is one window: lm-eval's prefix token (bos) and then all of it.
    expected = [
        loglikelihood(model, [tokenizer.bos_token_id] + tokenizer(text, add_special_tokens=False).input_ids, 1)
        for text in docs
    ]
    assert [got[str(i)][0] for i in range(len(docs))] == pytest.approx(expected, abs=1e-3)
    total = sum(expected)
    num_bytes = sum(len(text.encode()) for text in docs)
    num_words = sum(len(re.split(r"\s+", text)) for text in docs)
    metrics = runs["runs"]["batch_1"]["metrics"][PERPLEXITY]
    assert metrics["bits_per_byte,none"] == pytest.approx(-total / num_bytes / math.log(2), rel=1e-4)
    assert metrics["byte_perplexity,none"] == pytest.approx(math.exp(-total / num_bytes), rel=1e-4)
    assert metrics["word_perplexity,none"] == pytest.approx(math.exp(-total / num_words), rel=1e-4)


def test_batch_size_4_sends_lists_and_scores_the_same(runs: dict[str, Any]) -> None:
    one, four = runs["runs"]["batch_1"], runs["runs"]["batch_4"]
    for task in (CLOZE, PERPLEXITY):
        assert four["samples"][task].keys() == one["samples"][task].keys()
        for doc_id, scores in one["samples"][task].items():
            assert four["samples"][task][doc_id] == pytest.approx(scores, abs=1e-4), (task, doc_id)
        assert four["metrics"][task] == pytest.approx(one["metrics"][task], rel=1e-5)
    # The 48 choices went as 12 requests of 4 prompts each (a rolling document alone).
    assert requests_during(runs, "batch_4") == {"/v1/completions 200": 12 + 4}


def test_remote_tokenizer_scores_the_same(runs: dict[str, Any]) -> None:
    one, remote = runs["runs"]["batch_1"], runs["runs"]["remote_tokenizer"]
    for task in (CLOZE, PERPLEXITY):
        for doc_id, scores in one["samples"][task].items():
            assert remote["samples"][task][doc_id] == pytest.approx(scores, abs=1e-4), (task, doc_id)
        assert remote["metrics"][task] == pytest.approx(one["metrics"][task], rel=1e-5)
    made = requests_during(runs, "remote_tokenizer")
    assert made["/v1/completions 200"] == 48 + 4
    assert made["/tokenizer_info 200"] >= 1 and made["/tokenize 200"] >= 1
    assert all(key.endswith(" 200") for key in made), made
