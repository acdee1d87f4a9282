"""Rewrite a seeded checkpoint (as transformers saves it, float32) in the format a model
is released in, since no released weights can be downloaded here:

- ``write_v4_deepseek``: DeepSeek-V4 as DeepSeek ships it: its own names
  (shared/model/models/deepseek_v4_names.py), the attention's and shared experts'
  linears (and the indexer's ``wq_b``, the MTP projections) FP8 e4m3 with an E8M0
  (ue8m0) scale per 128 x 128 tile in ``X.scale``, the routed experts FP4 e2m1 packed
  two a byte in int8 with an E8M0 scale per 32 values, the rest bf16 but the mHC
  tensors, sinks, ``ape``, router bias in float32, an ``mtp.0.*`` block, sharded with
  ``model.safetensors.index.json``, and config.json's ``quantization_config`` and
  ``expert_dtype`` as released;
- ``write_v4_transformers_fp8``: V4 in transformers' names, FP8 with float32 block scales
  in ``X.weight_scale_inv`` (DeepSeek-V3's style, transformers' finegrained fp8), the
  routed experts FP8 too;
- ``write_gpt_oss_mxfp4``: GPT-OSS as OpenAI ships it: the experts' ``gate_up_proj`` and
  ``down_proj`` as MXFP4 ``_blocks``/``_scales``, everything else bf16.

Each copies the source's tokenizer, generation config and chat template (the family's
released chat format, tools/chat_formats.py) into both folders, and also writes ``reference``: the same model in transformers' names and float32,
holding exactly the values the released files decode to (the quantiser's own choice,
computed here, not read back), for transformers to run as the reference. The
quantisers are round-to-nearest with power-of-two (or, for ``float``, amax / 448)
scales: the error bounds the tests state come from here.
"""

import json
import math
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from shared.model.checkpoint_files import INDEX_FILE, SINGLE_FILE
from shared.model.quantized import E8M0_DTYPE, FP4_E2M1_VALUES, FP4_GROUP, FP8_DTYPE

FP8_MAX = 448.0  # the largest e4m3 (fn) value
FP4_MAX = 6.0  # the largest e2m1 value
BLOCK = (128, 128)

V4_FP8_LINEARS = re.compile(r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|indexer\.wq_b|shared_experts\.w[123]|[eh]_proj)\.weight$")
_V4_EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
V4_FLOAT32 = re.compile(r"(hc_(attn|ffn|head)_(fn|base|scale)|\.hc_(fn|base|scale)|\.attn_sink|\.ape|\.gate\.bias)$")
_V4_DEEPSEEK_NAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}


# -- quantisers: (stored tensors, the float32 values they decode to) ---------------------------


def _power_of_two_at_least(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= x (x > 0), as ue8m0 scales are chosen."""
    return torch.exp2(torch.ceil(torch.log2(x)))


def quantize_fp8_blocks(
    w: torch.Tensor, block: tuple[int, int] = BLOCK, scale_fmt: str = "ue8m0"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 codes, scale [..., ceil(rows/b0), ceil(cols/b1)], decoded float32) of ``w``:
    one scale per tile, its amax / 448 rounded up to a power of two (ue8m0) or as is."""
    rows, cols = w.shape[-2:]
    tiles = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    padded = torch.zeros(*w.shape[:-2], tiles[0] * block[0], tiles[1] * block[1])
    padded[..., :rows, :cols] = w
    amax = padded.unflatten(-1, (tiles[1], block[1])).unflatten(-3, (tiles[0], block[0])).abs().amax(dim=(-3, -1))
    scale = amax.clamp(min=2.0**-100) / FP8_MAX
    scale = _power_of_two_at_least(scale) if scale_fmt == "ue8m0" else scale
    full = scale.repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)[..., :rows, :cols]
    codes = (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    stored = scale.to(E8M0_DTYPE) if scale_fmt == "ue8m0" else scale
    return codes, stored, codes.float() * full


def quantize_fp4_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bytes uint8 [..., cols / 2], E8M0 scale [..., cols / 32], decoded float32) of
    ``w`` [..., cols]: per 32 values a power-of-two scale >= amax / 6, each value rounded
    to the nearest e2m1, two a byte, the low nibble first."""
    groups = w.unflatten(-1, (w.shape[-1] // FP4_GROUP, FP4_GROUP))
    scale = _power_of_two_at_least(groups.abs().amax(-1).clamp(min=2.0**-100) / FP4_MAX)
    x = groups / scale[..., None]
    magnitudes = torch.tensor(FP4_E2M1_VALUES[:8])
    index = (x.abs()[..., None] - magnitudes).abs().argmin(-1)  # nearest magnitude, 0..7
    nibble = (index | ((x < 0).long() << 3)).flatten(-2).to(torch.uint8)
    packed = nibble[..., 0::2] | (nibble[..., 1::2] << 4)
    decoded = (magnitudes[index] * torch.where(x < 0, -1.0, 1.0) * scale[..., None]).flatten(-2)
    return packed, scale.to(E8M0_DTYPE), decoded


# -- writers ------------------------------------------------------------------------------------


def write_v4_deepseek(src: Path, out: Path, reference: Path, num_shards: int = 3, mtp_seed: int = 0) -> Path:
    """DeepSeek-V4 in DeepSeek's names and dtypes, FP8/FP4, with an ``mtp.0`` block."""
    weights = load_file(str(src / SINGLE_FILE))
    released: dict[str, torch.Tensor] = {}
    decoded: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        released_name = _V4_DEEPSEEK_NAMES.get(name) or _v4_deepseek_layer_name(name)
        decoded[name] = _add_v4_tensor(released, released_name, w, expert_fp4=True, scale_fmt="ue8m0")
    config = json.loads((src / "config.json").read_text())
    # The reference carries the MTP block's decoded values too (transformers ignores mtp.*).
    decoded.update(_add_mtp_block(released, weights, config, mtp_seed))
    extra = {
        # As V4-Flash ships it: one ratio per layer and one more, 0, for the sliding MTP layer.
        "compress_ratios": [*_compress_ratios(config), 0],
        "expert_dtype": "fp4",
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "scale_fmt": "ue8m0", "weight_block_size": list(BLOCK)},
    }  # fmt: skip
    _write(out, released, {**config, **extra}, num_shards)
    _write(reference, decoded, config, 1)
    _copy_chat_files(src, out, reference)
    return out


def write_v4_transformers_fp8(src: Path, out: Path, reference: Path) -> Path:
    """DeepSeek-V4 in transformers' names: FP8 with float32 ``weight_scale_inv``, experts too."""
    weights = load_file(str(src / SINGLE_FILE))
    released: dict[str, torch.Tensor] = {}
    decoded = {
        name: _add_v4_tensor(released, name, w, expert_fp4=False, scale_fmt="float", scale_suffix=".weight_scale_inv")
        for name, w in weights.items()
    }
    config = json.loads((src / "config.json").read_text())
    quant = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
    _write(out, released, {**config, "quantization_config": quant}, 1)
    _write(reference, decoded, config, 1)
    _copy_chat_files(src, out, reference)
    return out


def write_gpt_oss_mxfp4(src: Path, out: Path, reference: Path) -> Path:
    """GPT-OSS as released: MXFP4 experts, bf16 elsewhere."""
    weights = _load_folder(src)
    released: dict[str, torch.Tensor] = {}
    decoded: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            # Stored as x @ W ([E, in, out]); MXFP4 groups run along the input, so the
            # blocks hold W^T's rows: [E, out, in / 32, 16].
            packed, scale, values = quantize_fp4_groups(w.transpose(1, 2))
            released[name + "_blocks"] = packed.unflatten(-1, (-1, FP4_GROUP // 2))
            released[name + "_scales"] = scale.view(torch.uint8)
            decoded[name] = values.transpose(1, 2).contiguous()
        else:
            released[name] = w.to(torch.bfloat16)
            decoded[name] = released[name].float()
    config = json.loads((src / "config.json").read_text())
    quant = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
    }
    _write(out, released, {**config, "quantization_config": quant}, 1)
    _write(reference, decoded, config, 1)
    _copy_chat_files(src, out, reference)
    return out


def _v4_deepseek_layer_name(name: str) -> str:
    if not name.startswith("model.layers."):
        return name  # head.weight
    return name.removeprefix("model.").replace(".attn.norm.", ".attn.kv_norm.")


def _add_v4_tensor(
    released: dict[str, torch.Tensor], name: str, w: torch.Tensor, expert_fp4: bool, scale_fmt: str,
    scale_suffix: str = ".scale",
) -> torch.Tensor:  # fmt: skip
    """Store ``w`` under ``name`` as V4's release does; return the values it decodes to."""
    base = name.removesuffix(".weight")
    if _V4_EXPERT.search(name) and expert_fp4:
        packed, scale, values = quantize_fp4_groups(w)
        released[name], released[base + scale_suffix] = packed.view(torch.int8), scale
        return values
    if V4_FP8_LINEARS.search(name) or _V4_EXPERT.search(name):
        codes, scale, values = quantize_fp8_blocks(w, BLOCK, scale_fmt)
        released[name], released[base + scale_suffix] = codes, scale
        return values
    if not w.is_floating_point() or V4_FLOAT32.search(name):
        released[name] = w
        return w
    released[name] = w.to(torch.bfloat16)
    return released[name].float()


def _add_mtp_block(released: dict[str, torch.Tensor], weights: Mapping[str, torch.Tensor], config: Mapping[str, Any],
                   seed: int) -> dict[str, torch.Tensor]:  # fmt: skip
    """``mtp.0`` as V4 releases it: a sliding-window decoder block with a learned router
    (the last layer's shapes without its compressor, indexer or hash table; fresh values)
    plus the MTP projections, norms and its own hyper head, in the release's dtypes.
    Returns name -> the float32 values the stored tensors decode to."""
    g = torch.Generator().manual_seed(seed)
    last = f"model.layers.{config['num_hidden_layers'] - 1}."
    hidden, hc = config["hidden_size"], config["hc_mult"]
    block = {
        "mtp.0." + _v4_deepseek_layer_name(n).split(".", 2)[2]: w
        for n, w in weights.items()
        if n.startswith(last) and not re.search(r"\.(compressor|indexer)\.|\.tid2eid$", n)
    }
    block.setdefault("mtp.0.ffn.gate.bias", torch.zeros(config["n_routed_experts"]))
    block.update({
        "mtp.0.enorm.weight": torch.ones(hidden), "mtp.0.hnorm.weight": torch.ones(hidden),
        "mtp.0.e_proj.weight": torch.empty(hidden, hidden), "mtp.0.h_proj.weight": torch.empty(hidden, hidden),
        "mtp.0.norm.weight": torch.ones(hidden), "mtp.0.hc_head_fn": torch.empty(hc, hc * hidden),
        "mtp.0.hc_head_base": torch.empty(hc), "mtp.0.hc_head_scale": torch.empty(1),
    })  # fmt: skip
    decoded = {}
    for name, w in sorted(block.items()):
        # Norms near 1, each its own (a swapped or skipped norm shows); the rest as the tiny models'.
        noise = torch.randn(w.shape, generator=g)
        fresh = 1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.05 * noise
        decoded[name] = _add_v4_tensor(released, name, fresh if w.is_floating_point() else w, expert_fp4=True,
                                       scale_fmt="ue8m0")  # fmt: skip
    return decoded


def _compress_ratios(config: Mapping[str, Any]) -> list[int]:
    """Per layer, its compression rate (0: sliding only), from layer_types and compress_rates."""
    rates = config.get("compress_rates") or {}
    return [int(rates.get(t, 0)) if t != "sliding_attention" else 0 for t in config["layer_types"]]


def _load_folder(src: Path) -> dict[str, torch.Tensor]:
    if (src / INDEX_FILE).is_file():
        files = sorted(set(json.loads((src / INDEX_FILE).read_text())["weight_map"].values()))
        return {k: v for file in files for k, v in load_file(str(src / file)).items()}
    return load_file(str(src / SINGLE_FILE))


CHAT_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
"""What a release ships beside the weights for chat: the tokenizer with the family's format
tokens and its template (make_model's chat_formats.py wrote them into the seeded source)."""


def _copy_chat_files(src: Path, *outs: Path) -> None:
    for out in outs:
        for name in CHAT_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, out / name)


def _write(out: Path, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any], num_shards: int) -> None:
    """config.json and the tensors, in ``num_shards`` files (with an index) when > 1. The
    names go in sorted order, and the first cut falls between a scale and its weight
    (``X.scale`` sorts just before ``X.weight``) where there is one: the loader must pair
    tensors across files, as it must with real releases."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if num_shards == 1:
        save_file(dict(tensors), str(out / SINGLE_FILE), {"format": "pt"})
        return
    names = sorted(tensors)
    per = math.ceil(len(names) / num_shards)
    cuts = [min(i * per, len(names)) for i in range(num_shards + 1)]
    pairs = [k for k in range(1, cuts[2]) if names[k - 1].endswith(".scale")
             and names[k] == names[k - 1].removesuffix(".scale") + ".weight"]  # fmt: skip
    if pairs:
        cuts[1] = min(pairs, key=lambda k: abs(k - cuts[1]))
    weight_map: dict[str, str] = {}
    for i in range(num_shards):
        file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[cuts[i] : cuts[i + 1]]}
        save_file(part, str(out / file), {"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))




WRITERS = {"v4_deepseek": write_v4_deepseek, "v4_transformers_fp8": write_v4_transformers_fp8,
           "gpt_oss_mxfp4": write_gpt_oss_mxfp4}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """python -m tools.release_formats FORMAT SRC OUT REFERENCE: rewrite make-model's
    seeded checkpoint SRC as released (e.g. a V4 with its mtp.0 block, for bench-spec)."""
    import argparse

    p = argparse.ArgumentParser(prog="release_formats", description=main.__doc__)
    p.add_argument("format", choices=list(WRITERS))
    p.add_argument("src", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("reference", type=Path, help="where the decoded values go, in transformers' names")
    args = p.parse_args(argv)
    WRITERS[args.format](args.src, args.out, args.reference)
    # The tokenizer and generation config travel with the weights, as a release has them.
    for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"):
        if (args.src / extra).is_file():
            shutil.copy(args.src / extra, args.out / extra)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
