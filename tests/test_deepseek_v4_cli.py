"""`infermesh make-model --arch deepseek_v4` then `infermesh generate --json`, as a user
runs them: a tiny seeded V4 in transformers' format (window 128, CSA every 4 tokens,
HCA every 128, hash-routed first layer, 4 mHC streams), and the engine's greedy output
on prompts longer than the window equal to transformers' on the same folder."""

import json
import subprocess
import sys

import pytest

from tests.hf_models import hf_greedy, random_prompts

pytest.importorskip("transformers")


def infermesh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.cli", *args], capture_output=True, text=True)


def test_make_model_then_generate_json_equals_transformers(tmp_path) -> None:
    made = infermesh("make-model", str(tmp_path), "--arch", "deepseek_v4", "--seed", "2")
    assert made.returncode == 0, made.stderr
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV4ForCausalLM"]
    assert config["layer_types"] == ["sliding_attention", "compressed_sparse_attention",
                                     "heavily_compressed_attention", "compressed_sparse_attention"]  # fmt: skip
    prompts = random_prompts([140, 300], vocab=4000, seed=5)  # past the window (128) and one HCA window
    expected = hf_greedy(tmp_path, prompts, 32)
    args = ["generate", "--model", str(tmp_path), "--max-tokens", "32", "--json", "--block-size", "16",
            "--prefill-chunk-size", "37"]  # fmt: skip
    for p in prompts:
        args += ["--prompt-ids", " ".join(map(str, p))]
    out = infermesh(*args)
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["prompt_token_ids"] for r in records] == prompts
    assert [r["token_ids"] for r in records] == expected
