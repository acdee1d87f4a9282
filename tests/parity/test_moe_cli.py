"""`infermesh make-model --arch qwen3_moe|gpt_oss` then `infermesh generate --json`, as a
user runs them: the output equals transformers' greedy generation on the same folder."""

import pytest

from tests.helpers.hf_models import check_cli_generate_equals_hf, make_model_cli, random_prompts

pytest.importorskip("transformers")


@pytest.mark.parametrize("arch,extra", [("qwen3_moe", []), ("gpt_oss", ["--sliding-window", "8"])])
def test_make_model_then_generate_json_equals_transformers(arch: str, extra: list[str], tmp_path) -> None:
    config = make_model_cli(tmp_path, arch, *extra)
    assert config["architectures"] == [{"qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}[arch]]
    prompts = random_prompts([7, 19, 30], vocab=4000, seed=5)  # 19 and 30 are longer than the window 8
    check_cli_generate_equals_hf(tmp_path, prompts, 32, "--block-size", "4", "--prefill-chunk-size", "8")
