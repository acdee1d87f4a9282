"""`infermesh make-model --arch qwen3_moe|gpt_oss` then `infermesh generate --json`, as a
user runs them: the output equals transformers' greedy generation on the same folder."""

import json
import subprocess
import sys

import pytest

from tests.hf_models import hf_greedy, random_prompts

pytest.importorskip("transformers")


def infermesh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.cli", *args], capture_output=True, text=True)


@pytest.mark.parametrize("arch,extra", [("qwen3_moe", []), ("gpt_oss", ["--sliding-window", "8"])])
def test_make_model_then_generate_json_equals_transformers(arch: str, extra: list[str], tmp_path) -> None:
    made = infermesh("make-model", str(tmp_path), "--arch", arch, "--seed", "2", *extra)
    assert made.returncode == 0, made.stderr
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == [{"qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}[arch]]
    prompts = random_prompts([7, 19, 30], vocab=4000, seed=5)  # 19 and 30 are longer than the window 8
    expected = hf_greedy(tmp_path, prompts, 32)
    args = ["generate", "--model", str(tmp_path), "--max-tokens", "32", "--json", "--block-size", "4",
            "--prefill-chunk-size", "8"]  # fmt: skip
    for p in prompts:
        args += ["--prompt-ids", " ".join(map(str, p))]
    out = infermesh(*args)
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["prompt_token_ids"] for r in records] == prompts
    assert [r["token_ids"] for r in records] == expected
