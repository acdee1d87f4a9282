"""Loading checkpoints in their released formats (tools/release_formats.py over
make_model's seeded checkpoints): the weights load as exactly the values the files
decode to, DeepSeek's ``mtp.*`` are set aside with one log line, and every broken
quantised checkpoint is a CheckpointError that names what to fix."""

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.model.checkpoint_files import INDEX_FILE, SINGLE_FILE
from shared.model.loader import CheckpointError, load_model
from shared.model.models.deepseek_v4_names import deepseek_name, v4_checkpoint_names
from tools import release_formats as rf
from tools.make_model import make_model

WRITERS = {"v4_deepseek": rf.write_v4_deepseek, "v4_transformers_fp8": rf.write_v4_transformers_fp8,
           "gpt_oss_mxfp4": rf.write_gpt_oss_mxfp4}  # fmt: skip


@pytest.fixture(scope="module")
def released(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """format -> (released folder, reference folder), from make_model's tiny V4 (256 wide:
    whole 128-tiles) and GPT-OSS."""
    root = tmp_path_factory.mktemp("released")
    seeded = {"deepseek_v4": root / "v4", "gpt_oss": root / "gpt_oss"}
    for arch, path in seeded.items():
        make_model(path, arch=arch, seed=5, tokenizer=False)
    out = {}
    for fmt, write in WRITERS.items():
        src = seeded["gpt_oss" if fmt.startswith("gpt_oss") else "deepseek_v4"]
        out[fmt] = (write(src, root / fmt, root / f"{fmt}_reference"), root / f"{fmt}_reference")
    return out


def _broken(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(folder: Path, drop: tuple[str, ...] = (), put: dict[str, torch.Tensor] | None = None) -> None:
    """Drop or replace stored tensors in whichever file holds them (index kept in step)."""
    index = folder / INDEX_FILE
    weight_map = json.loads(index.read_text())["weight_map"] if index.is_file() else None
    files = sorted(set(weight_map.values())) if weight_map else [SINGLE_FILE]
    for file in files:
        tensors = load_file(str(folder / file))
        if not set(drop) & set(tensors) and not set(put or {}) & set(tensors):
            continue
        tensors = {k: (put or {}).get(k, v) for k, v in tensors.items() if k not in drop}
        save_file(tensors, str(folder / file), {"format": "pt"})
    if weight_map:
        index.write_text(json.dumps({"weight_map": {k: v for k, v in weight_map.items() if k not in drop}}))


def _edit_config(folder: Path, **changes: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


@pytest.mark.parametrize("fmt", list(WRITERS))
def test_released_weights_load_as_the_values_they_decode_to(
    fmt: str, released: dict[str, tuple[Path, Path]], caplog: pytest.LogCaptureFixture
) -> None:
    path, reference = released[fmt]
    with caplog.at_level(logging.INFO, logger="shared.model.loader"):
        ours = load_model(path).checkpoint_tensors()
    expected = load_model(reference).checkpoint_tensors()
    assert ours.keys() == expected.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, expected[name]), name
    aside = [r for r in caplog.records if "not the model's" in r.getMessage()]
    if fmt == "v4_deepseek":
        assert len(aside) == 1 and "mtp.0.attn" in aside[0].getMessage()
    else:
        assert not aside


def test_the_deepseek_release_layout(released: dict[str, tuple[Path, Path]]) -> None:
    """What the writer promises: DeepSeek's names and dtypes, shards with an index."""
    path, _ = released["v4_deepseek"]
    weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
    assert len(set(weight_map.values())) == 3
    # Some weight and its scale sit in different shards: the loader pairs across files.
    assert any(weight_map[n] != weight_map[n.removesuffix(".scale") + ".weight"] for n in weight_map if n.endswith(".scale"))
    tensors = {k: v for f in sorted(set(weight_map.values())) for k, v in load_file(str(path / f)).items()}
    assert {"embed.weight", "head.weight", "norm.weight", "hc_head_fn", "layers.0.ffn.gate.tid2eid"} <= set(tensors)
    assert tensors["layers.1.attn.wq_b.weight"].dtype == torch.float8_e4m3fn
    assert tensors["layers.1.attn.wq_b.scale"].dtype == torch.float8_e8m0fnu
    rows, cols = tensors["layers.1.attn.wq_b.weight"].shape
    assert tensors["layers.1.attn.wq_b.scale"].shape == (-(-rows // 128), -(-cols // 128))
    expert, scale = tensors["layers.1.ffn.experts.0.w2.weight"], tensors["layers.1.ffn.experts.0.w2.scale"]
    assert expert.dtype == torch.int8 and scale.dtype == torch.float8_e8m0fnu and scale.shape[-1] * 16 == expert.shape[-1]
    assert tensors["layers.1.attn.kv_norm.weight"].dtype == torch.bfloat16
    assert tensors["layers.1.hc_attn_fn"].dtype == torch.float32
    assert any(k.startswith("mtp.0.") for k in tensors)
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128] and config["expert_dtype"] == "fp4"


def test_v4_name_map() -> None:
    assert deepseek_name("embed.weight") == "model.embed_tokens.weight"
    assert deepseek_name("hc_head_scale") == "model.hc_head.hc_scale"
    assert deepseek_name("layers.3.attn.kv_norm.weight") == "model.layers.3.attn.norm.weight"
    assert deepseek_name("layers.3.attn.compressor.norm.weight") == "model.layers.3.attn.compressor.norm.weight"
    ours = ["model.layers.0.attn.wq_a.weight", "head.weight", "model.mtp.0.enorm.weight"]
    assert v4_checkpoint_names(ours) == {**{n: n for n in ours[:2]}, ours[2]: None}
    theirs = v4_checkpoint_names(["layers.0.ffn.experts.1.w2.weight", "mtp.0.e_proj.weight"])
    assert theirs == {"layers.0.ffn.experts.1.w2.weight": "model.layers.0.ffn.experts.1.w2.weight",
                      "mtp.0.e_proj.weight": None}  # fmt: skip


def test_a_missing_scale_names_the_weight(released: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    for fmt, scale in [("v4_deepseek", "layers.1.attn.wq_a.scale"),
                       ("v4_transformers_fp8", "model.layers.1.attn.wq_a.weight_scale_inv")]:  # fmt: skip
        path = _broken(released[fmt][0], tmp_path / fmt)
        _edit_tensors(path, drop=(scale,))
        with pytest.raises(CheckpointError, match=r"attn\.wq_a\.weight is F8_E4M3 but has no scale"):
            load_model(path)
    path = _broken(released["v4_deepseek"][0], tmp_path / "fp4")
    _edit_tensors(path, drop=("layers.2.ffn.experts.3.w1.scale",))
    with pytest.raises(CheckpointError, match=r"layers\.2\.ffn\.experts\.3\.w1\.weight is I8 but has no scale"):
        load_model(path)
    path = _broken(released["gpt_oss_mxfp4"][0], tmp_path / "mx")
    _edit_tensors(path, drop=("model.layers.0.mlp.experts.down_proj_scales",))
    with pytest.raises(CheckpointError, match=r"down_proj_blocks has no model\.layers\.0\.mlp\.experts\.down_proj_scales"):
        load_model(path)


def test_a_scale_that_does_not_fit_names_the_tensor(released: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    path = _broken(released["v4_deepseek"][0], tmp_path / "shape")
    _edit_tensors(path, put={"layers.1.attn.wo_b.scale": torch.ones(1, 1).to(torch.float8_e8m0fnu)})
    with pytest.raises(CheckpointError, match=r"layers\.1\.attn\.wo_b\.weight with layers\.1\.attn\.wo_b\.scale: scale shape"):
        load_model(path)


def test_an_orphan_scale_is_named(released: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    path = _broken(released["v4_deepseek"][0], tmp_path / "orphan")
    _edit_tensors(path, drop=("layers.1.attn.wkv.weight",))
    with pytest.raises(CheckpointError, match=r"scale layers\.1\.attn\.wkv\.scale has no layers\.1\.attn\.wkv\.weight"):
        load_model(path)


def test_quantization_config_errors(released: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    path = _broken(released["v4_deepseek"][0], tmp_path / "unknown")
    _edit_config(path, quantization_config={"quant_method": "awq", "bits": 4})
    with pytest.raises(CheckpointError, match=r"config\.json: quantization_config\.quant_method 'awq' is not supported"):
        load_model(path)
    path = _broken(released["v4_deepseek"][0], tmp_path / "none")
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="no quantization_config, but the checkpoint has quantised tensors"):
        load_model(path)
    path = _broken(released["v4_deepseek"][0], tmp_path / "block")
    _edit_config(path, quantization_config={"quant_method": "fp8"})
    with pytest.raises(CheckpointError, match="needs weight_block_size"):
        load_model(path)
    path = _broken(released["gpt_oss_mxfp4"][0], tmp_path / "not_converted")
    _edit_config(path, quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.mlp.experts"]})
    with pytest.raises(CheckpointError, match=r"experts\.down_proj_blocks is MXFP4, but .*modules_to_not_convert lists"):
        load_model(path)
