"""Config parsing, checkpoint loading errors, dtype casting and make_model."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.model.config import ModelConfig
from shared.model.loader import CheckpointError, load_model
from shared.model.models import arch_traits
from tools.make_model import ARCHITECTURES, make_model
from tests.helpers.paged_driver import PagedDriver
from tests.helpers.numerics import rel_err


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A make_model checkpoint without tokenizer; tests copy it before breaking it."""
    path = tmp_path_factory.mktemp("tiny")
    make_model(path, tokenizer=False)
    return path


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, **changes: object) -> None:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))


# -- config -----------------------------------------------------------------------------------


def test_old_and_new_rope_spellings_parse_alike() -> None:
    base = dict(
        architectures=["LlamaForCausalLM"], vocab_size=32, hidden_size=16, intermediate_size=32,
        num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    v4 = ModelConfig.from_dict(
        {**base, "rope_theta": 5e5, "torch_dtype": "bfloat16",
         "rope_scaling": {"type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4,
                          "original_max_position_embeddings": 64}}
    )  # fmt: skip
    v5 = ModelConfig.from_dict(
        {**base, "dtype": "bfloat16",
         "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}
    )  # fmt: skip
    assert v4 == v5 and v4.fingerprint() == v5.fingerprint()
    assert v4.rope.rope_type == "llama3" and v4.rope.rope_theta == 5e5 and v4.torch_dtype == torch.bfloat16
    assert v4.num_key_value_heads == 2 and v4.head_dim == 8
    plain = ModelConfig.from_dict({**base, "rope_scaling": None})
    assert plain.rope.rope_type == "default" and plain.rope.rope_theta == 10000.0
    assert plain.fingerprint() != v5.fingerprint() and len(plain.fingerprint()) == 64


def test_sliding_window_rules() -> None:
    base = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2)
    qwen2 = {**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 8, "max_window_layers": 2}
    # v4 Qwen2 configs have no layer_types: layers i >= max_window_layers slide, if use_sliding_window.
    assert ModelConfig.from_dict(qwen2).sliding_windows == (None,) * 4
    assert ModelConfig.from_dict({**qwen2, "use_sliding_window": True}).sliding_windows == (None, None, 8, 8)
    layer_types = ["sliding_attention", "full_attention"] * 2
    assert ModelConfig.from_dict({**qwen2, "use_sliding_window": True, "layer_types": layer_types}).sliding_windows == (
        8, None, 8, None,
    )  # fmt: skip
    mistral = {**base, "architectures": ["MistralForCausalLM"]}
    assert ModelConfig.from_dict({**mistral, "sliding_window": 5}).sliding_windows == (5,) * 4
    assert ModelConfig.from_dict({**mistral, "sliding_window": None}).sliding_windows == (None,) * 4
    qwen3 = ModelConfig.from_dict({**base, "architectures": ["Qwen3ForCausalLM"]})
    assert qwen3.head_dim == 128 and qwen3.qk_norm and not qwen3.qkv_bias  # Qwen3Config's default head_dim


def test_unknown_architecture_names_it_and_the_supported_ones(tiny: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen2ForCausalLM"):
        ModelConfig.from_dict({"architectures": ["GPT2LMHeadModel"]})
    path = _copy(tiny, tmp_path / "m")
    _edit_config(path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel"):
        load_model(path)


# -- loader errors ----------------------------------------------------------------------------


def test_missing_folder_config_and_weights(tiny: Path, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    path = _copy(tiny, tmp_path / "m")
    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_model(path)
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors nor model.safetensors.index.json"):
        load_model(path)
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(path)


def test_missing_shard(tiny: Path, tmp_path: Path) -> None:
    path = _copy(tiny, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:5], "model-00002-of-00002.safetensors": names[5:]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, path / file)
    index = {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert load_model(path).config.num_hidden_layers == 4  # sharded loads
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard model-00002-of-00002.safetensors"):
        load_model(path)


def test_wrong_shape_names_tensor_and_shapes(tiny: Path, tmp_path: Path) -> None:
    path = _copy(tiny, tmp_path / "m")
    _edit_config(path, intermediate_size=512)
    with pytest.raises(CheckpointError, match=r"mlp.down_proj.weight has shape \(256, 688\), expected \(256, 512\)"):
        load_model(path)


def test_missing_unexpected_and_harmless_tensors(tiny: Path, tmp_path: Path) -> None:
    path = _copy(tiny, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(16)  # old exporters: ignored
    save_file(tensors, path / "model.safetensors")
    load_model(path)
    save_file({**tensors, "model.layers.0.self_attn.q_norm.weight": torch.ones(32)}, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="1 tensors the config does not use.*q_norm"):
        load_model(path)
    del tensors["model.norm.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="1 tensors missing.*model.norm.weight"):
        load_model(path)


def test_absent_lm_head_ties_to_embeddings(tiny: Path, tmp_path: Path) -> None:
    path = _copy(tiny, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, path / "model.safetensors")
    model = load_model(path)
    hidden = torch.randn(3, model.config.hidden_size)
    assert torch.equal(model.compute_logits(hidden), hidden @ tensors["model.embed_tokens.weight"].T)


# -- dtype, progress, KV cache ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtype_casting(tiny: Path, dtype: torch.dtype) -> None:
    model = load_model(tiny, dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert model.rotary_emb.inv_freq.dtype == torch.float32  # rope frequencies stay float32, as in HF
    ref = load_file(tiny / "model.safetensors")["model.layers.1.mlp.up_proj.weight"].to(dtype)
    assert torch.equal(model.checkpoint_tensors()["model.layers.1.mlp.up_proj.weight"], ref)
    driver = PagedDriver(model, num_seqs=1, kv_dtype=dtype)
    logits = driver.step({0: [1, 2, 3, 4, 5]})[0]
    assert logits.dtype == torch.float32 and logits.shape == (5, 4096) and torch.isfinite(logits).all()


def test_progress_bar_only_when_asked(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    load_model(tiny)
    assert capsys.readouterr().err == ""
    load_model(tiny, progress=True)
    assert "Loading weights" in capsys.readouterr().err


def test_kv_cache_layout(tiny: Path) -> None:
    model = load_model(tiny)
    caches = model.allocate_kv_cache(10, 16, torch.bfloat16, "cpu")
    assert len(caches) == 4 and caches[0].shape == (2, 10, 16, 4, 32) and caches[0].dtype == torch.bfloat16
    assert model.kv_bytes_per_block(16, torch.bfloat16) == caches[0][:, 0].nbytes * 4


# -- make_model -------------------------------------------------------------------------------


def _file_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_make_model_is_deterministic_and_transformers_agrees(arch: str, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    make_model(tmp_path / "a", arch=arch, seed=3, tokenizer=False)
    make_model(tmp_path / "b", arch=arch, seed=3, tokenizer=False)
    assert _file_bytes(tmp_path / "a") == _file_bytes(tmp_path / "b")
    make_model(tmp_path / "c", arch=arch, seed=4, tokenizer=False)
    assert (tmp_path / "a/model.safetensors").read_bytes() != (tmp_path / "c/model.safetensors").read_bytes()

    # A vision-language model is transformers' image-text-to-text class (text only here).
    vision = arch_traits(ARCHITECTURES[arch]).accepts_images
    auto = transformers.AutoModelForImageTextToText if vision else transformers.AutoModelForCausalLM
    hf = auto.from_pretrained(tmp_path / "a", dtype=torch.float32)
    # config.json is exactly what transformers itself writes for this model.
    hf.save_pretrained(tmp_path / "resaved")
    written = json.loads((tmp_path / "a/config.json").read_text())
    assert json.loads((tmp_path / "resaved/config.json").read_text()) == written

    ids = [5, 17, 300, 4095, 0, 9, 9, 1000, 77]
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    ours = PagedDriver(load_model(tmp_path / "a"), num_seqs=1).step({0: ids})[0]
    assert rel_err(ours, expected) < 1e-4


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_make_model_with_a_sliding_window_matches_transformers(arch: str, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    make_model(tmp_path / "full", arch=arch, seed=3, tokenizer=False)
    make_model(tmp_path / "swa", arch=arch, seed=3, tokenizer=False, sliding_window=4)
    # The same weights, only the attention pattern differs.
    assert (tmp_path / "full/model.safetensors").read_bytes() == (tmp_path / "swa/model.safetensors").read_bytes()
    config = ModelConfig.from_pretrained(tmp_path / "swa")
    expected = (None, 4, None, 4) if arch == "qwen2" else (4, 4, 4, 4)
    assert config.sliding_windows == expected
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "swa", dtype=torch.float32)
    ids = [5, 17, 300, 4095, 0, 9, 9, 1000, 77]
    with torch.no_grad():
        reference = hf(torch.tensor([ids])).logits[0]
    assert rel_err(PagedDriver(load_model(tmp_path / "swa"), num_seqs=1).step({0: ids})[0], reference) < 1e-4
    with pytest.raises(ValueError, match="Llama has no sliding-window layers"):
        make_model(tmp_path / "llama", arch="llama", sliding_window=4)


def test_make_model_with_tokenizer(tmp_path: Path) -> None:
    pytest.importorskip("shared.recipe.train_tokenizer")
    from tokenizers import Tokenizer

    make_model(tmp_path / "a")
    make_model(tmp_path / "b")
    assert _file_bytes(tmp_path / "a") == _file_bytes(tmp_path / "b")
    tok = Tokenizer.from_file(str(tmp_path / "a/tokenizer.json"))
    config = ModelConfig.from_pretrained(tmp_path / "a")
    assert config.bos_token_id == tok.token_to_id("<|begin_of_text|>")
    assert config.eos_token_ids == (tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|im_end|>"))
    generation = json.loads((tmp_path / "a/generation_config.json").read_text())
    assert generation["eos_token_id"] == list(config.eos_token_ids)


def test_make_model_with_a_padded_vocab_in_shards_matches_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tokenizer smaller than the embedding (as the llama3-8b preset has), bfloat16
    weights cast per tensor and written as shards: our engine and transformers load it
    alike, ids past the tokenizer's are valid and decode to nothing."""
    transformers = pytest.importorskip("transformers")
    from safetensors import safe_open

    from shared.engine.llm import LLM
    from shared.engine.sampling_params import SamplingParams
    from tools import make_model as make_model_module
    from shared.recipe.tokenizer import Recipe
    from tests.helpers.hf_models import hf_greedy

    single = tmp_path / "single"
    make_model(single, seed=3, dtype=torch.bfloat16, tokenizer=False)
    monkeypatch.setattr(make_model_module, "MAX_SHARD_BYTES", 3_000_000)  # tiny in bfloat16 is 10 MB
    padded = tmp_path / "padded"
    num_params = make_model(padded, seed=3, dtype=torch.bfloat16, device="cpu", tokenizer_vocab_size=1024)

    index = json.loads((padded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not (padded / "model.safetensors").exists()
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(padded / file), framework="pt") as f:
            assert all(index["weight_map"][name] == file for name in f.keys())
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    # Sharding does not change the draws, and the index counts every byte.
    expected = load_file(single / "model.safetensors")
    assert tensors.keys() == expected.keys() and all(torch.equal(tensors[n], expected[n]) for n in expected)
    assert index["metadata"]["total_size"] == 2 * num_params == sum(t.numel() * 2 for t in expected.values())

    config = ModelConfig.from_pretrained(padded)
    recipe = Recipe.from_pretrained(padded)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(padded)
    assert config.vocab_size == 4096 and recipe.vocab_size == len(hf_tokenizer) == 1024
    assert max(config.eos_token_ids) < 1024 and config.bos_token_id < 1024
    text = "def f(x):\n    return x + 1  # 🦙"
    assert recipe.encode(text) == hf_tokenizer(text)["input_ids"]
    assert recipe.decode([1024, 4095]) == "" and recipe.decode(recipe.encode(text) + [2000]) == text

    ids = recipe.encode(text) + [1024, 4095, 2000, 7]  # the last few past the tokenizer's vocab
    hf = transformers.AutoModelForCausalLM.from_pretrained(padded, dtype=torch.float32)
    with torch.no_grad():
        reference = hf(torch.tensor([ids])).logits[0]
    assert rel_err(PagedDriver(load_model(padded), num_seqs=1).step({0: ids})[0], reference) < 1e-4

    # End to end: greedy as transformers generates, and sampled ids past the tokenizer's
    # stream as the text they decode to.
    llm = LLM(str(padded))
    greedy = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert [greedy.token_ids] == hf_greedy(padded, [ids], 8)
    sampled = llm.generate([text], SamplingParams(max_tokens=16, temperature=1.0, seed=5, ignore_eos=True))[0]
    assert any(t >= 1024 for t in sampled.token_ids) and sampled.text == recipe.decode(sampled.token_ids)

    # Written again unsharded into the same folder, no stale shard or index is left.
    monkeypatch.undo()
    make_model(padded, seed=3, dtype=torch.bfloat16, tokenizer=False)
    assert not list(padded.glob("model-*"))
    assert (padded / "model.safetensors").read_bytes() == (single / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="exceeds the model's vocab_size=4096"):
        make_model(tmp_path / "bad", tokenizer_vocab_size=4097)


def test_make_model_cli_dtype_and_device(tmp_path: Path) -> None:
    import subprocess
    import sys

    make_model(tmp_path / "api", seed=2, dtype=torch.bfloat16, tokenizer=False)
    args = ["make-model", str(tmp_path / "cli"), "--seed", "2", "--dtype", "bfloat16", "--device", "cpu"]
    done = subprocess.run([sys.executable, "-m", "tools.cli", *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    # device="cpu" draws what the default draws: the same bytes as the API call.
    assert (tmp_path / "cli/model.safetensors").read_bytes() == (tmp_path / "api/model.safetensors").read_bytes()
    assert done.stderr.strip().splitlines()[-1] == (
        f"wrote a seeded llama checkpoint to {tmp_path / 'cli'}: preset tiny, 4,999,424 params, bfloat16, drawn on cpu"
    )
