"""`infermesh make-model --arch deepseek_v4` then `infermesh generate --json`, as a user
runs them: a tiny seeded V4 in transformers' format (window 128, CSA every 4 tokens,
HCA every 128, hash-routed first layer, 4 mHC streams), and the engine's greedy output
on prompts longer than the window equal to transformers' on the same folder."""

import pytest

from tests.helpers.hf_models import check_cli_generate_equals_hf, make_model_cli, random_prompts

pytest.importorskip("transformers")


def test_make_model_then_generate_json_equals_transformers(tmp_path) -> None:
    config = make_model_cli(tmp_path, "deepseek_v4")
    assert config["architectures"] == ["DeepseekV4ForCausalLM"]
    assert config["layer_types"] == ["sliding_attention", "compressed_sparse_attention",
                                     "heavily_compressed_attention", "compressed_sparse_attention"]  # fmt: skip
    prompts = random_prompts([140, 300], vocab=4000, seed=5)  # past the window (128) and one HCA window
    check_cli_generate_equals_hf(tmp_path, prompts, 32, "--block-size", "16", "--prefill-chunk-size", "37")
