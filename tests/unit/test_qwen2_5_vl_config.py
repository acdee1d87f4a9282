"""Qwen2.5-VL's config reading and its multimodal rotary positions, torch-free: the
released (v4, flat) spelling and transformers 5.24's (v5, nested) parse to the same
model; M-RoPE tables as get_rope_index lays them out, worked by hand."""

import pytest

from shared.model.config import ModelConfig
from shared.model.vision.mrope import mrope_positions
from tools.make_model import PRESETS, hf_config_dict

IMG = 9


def _v5() -> dict:
    return hf_config_dict("qwen2_5_vl", PRESETS["tiny-vl"], "bfloat16", 1, 2)


def _v4(v5: dict) -> dict:
    """The same model as the released checkpoints spell it: the language model's keys
    at the top level, rope_scaling of type "mrope", torch_dtype."""
    flat = {k: v for k, v in v5.items() if k not in ("text_config", "dtype")}
    text = {k: v for k, v in v5["text_config"].items() if k not in ("model_type", "dtype", "rope_parameters")}
    rope = v5["text_config"]["rope_parameters"]
    flat.update(text, torch_dtype="bfloat16", rope_theta=rope["rope_theta"],
                rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]})  # fmt: skip
    flat["vision_config"] = {**v5["vision_config"], "model_type": "qwen2_5_vl"}
    return flat


def test_released_and_v5_spellings_are_one_model() -> None:
    v5 = ModelConfig.from_dict(_v5())
    v4 = ModelConfig.from_dict(_v4(_v5()))
    assert v4 == v5 and v4.fingerprint() == v5.fingerprint()
    assert v5.qkv_bias and not v5.o_bias and v5.head_dim == 32 and v5.dtype == "bfloat16"
    assert v5.vision_language is not None and v5.vision_language.mrope_section == (4, 6, 6)
    assert v5.vision_language.vision.fullatt_block_indexes == (1, 3)


def test_sections_must_cover_the_rotary_pairs() -> None:
    bad = _v5()
    bad["text_config"]["rope_parameters"]["mrope_section"] = [4, 6, 5]
    with pytest.raises(ValueError, match="must sum to head_dim / 2 = 16"):
        ModelConfig.from_dict(bad)


def test_positions_of_text_then_an_image_then_text() -> None:
    """2 text tokens, an image of 1x4x6 patches (2x3 merged tokens) from position 2,
    the text after it at 2 + max(4, 6) / 2 = 5; delta = 6 + 1 - 9."""
    ids = [1, 2] + [IMG] * 6 + [3]
    m = mrope_positions(ids, [(1, 4, 6)], IMG, 2)
    assert m.table == (
        (0, 1, 2, 2, 2, 2, 2, 2, 5),
        (0, 1, 2, 2, 2, 3, 3, 3, 5),
        (0, 1, 2, 3, 4, 2, 3, 4, 5),
    )
    assert m.delta == -3
    # Past the prompt every axis is the sequence position plus delta.
    assert m.rows(8, 11) == [[5, 6, 7], [5, 6, 7], [5, 6, 7]]


def test_text_only_positions_are_the_sequence() -> None:
    m = mrope_positions([4, 5, 6], [], IMG, 2)
    assert m.table == ((0, 1, 2),) * 3 and m.delta == 0


@pytest.mark.parametrize(
    ("ids", "grids", "message"),
    [
        ([1] + [IMG] * 5, [(1, 4, 6)], "needs 6 consecutive image tokens"),
        ([1] + [IMG] * 7, [(1, 4, 6)], "more image tokens"),
        ([1, 2], [(1, 4, 6)], "cover 0 of its 1 images"),
    ],
)
def test_image_tokens_must_match_the_grids(ids: list[int], grids: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        mrope_positions(ids, grids, IMG, 2)


def test_the_3b_preset_is_qwen2_5_vl_3b_instructs_shape() -> None:
    """The GPU figure's model (tools/bench/vision_goodput.py): config.json as make-model
    writes it, read back, is Qwen2.5-VL-3B-Instruct's shape (its weights are drawn only on
    the GPU; here the config alone)."""
    preset = PRESETS["qwen2.5-vl-3b"]
    assert preset["arch"] == "qwen2_5_vl" and preset["tokenizer_vocab_size"] == 32768
    d = hf_config_dict("qwen2_5_vl", preset, "bfloat16", 1, 2)
    text, tower = d["text_config"], d["vision_config"]
    assert (text["hidden_size"], text["num_hidden_layers"], text["num_attention_heads"], text["num_key_value_heads"],
            text["intermediate_size"], text["vocab_size"]) == (2048, 36, 16, 2, 11008, 151936)  # fmt: skip
    assert d["tie_word_embeddings"] is True
    assert text["rope_parameters"] == {"rope_theta": 1e6, "rope_type": "default", "mrope_section": [16, 24, 24]}
    assert {k: tower[k] for k in ("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size",
                                  "patch_size", "temporal_patch_size", "spatial_merge_size", "window_size",
                                  "fullatt_block_indexes")} == {  # fmt: skip
        "depth": 32, "hidden_size": 1280, "num_heads": 16, "intermediate_size": 3420, "out_hidden_size": 2048,
        "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2, "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
    }
    c = ModelConfig.from_dict(d)
    assert c.head_dim == 128 and c.tie_word_embeddings and c.dtype == "bfloat16"
    assert c.vision_language is not None and c.vision_language.mrope_section == (16, 24, 24)
    assert c.vision_language.vision.head_dim == 80


def test_the_3b_preset_has_qwen2_5_vl_3bs_parameter_count() -> None:
    """3,754,622,976 parameters, the released checkpoint's count (tower, merger and a tied
    embedding), from the model built on the meta device (nothing allocated)."""
    from shared.model.models import build_model

    c = ModelConfig.from_dict(hf_config_dict("qwen2_5_vl", PRESETS["qwen2.5-vl-3b"], "bfloat16", 1, 2))
    tensors = build_model(c, device="meta").checkpoint_tensors()
    assert sum(t.numel() for t in tensors.values()) == 3_754_622_976
    assert "lm_head.weight" not in tensors
