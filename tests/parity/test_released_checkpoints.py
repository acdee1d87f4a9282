"""Checkpoints in the formats models are released in (tools/release_formats.py writes
them from tiny seeded transformers checkpoints) load, and run as transformers runs the
same weights.

Each case is a released folder and its reference: the values the released files
decode to, in transformers' names and float32, run by transformers' own classes.

- logits of a varlen prefill and of decode steps within 1e-4 (rel_err, as every parity
  test here) of transformers on the reference: loading dequantises exactly, so what is
  left is float32 arithmetic;
- separately, the loaded weights are within the format's own error of the seeded float32
  ones (x the seeded value, amax the tensor's largest |x|, s a tile's or group's scale):
  FP8 e4m3 (3 mantissa bits, round to nearest; a power-of-two or amax/448 tile scale s <=
  amax / 224): |err| <= 2^-4 |x| + 2^-10 s; FP4 e2m1 (steps of 0.5, 1, 2 up to 6; s <=
  the group's amax / 3): |err| <= max(|x|, s) / 4; bf16: 2^-8 |x|; float32 tensors exact.

Cases: V4 in DeepSeek's names (FP8 ue8m0 tiles, FP4 experts, an mtp.0 block, three
shards) on a shape with whole 128-tiles and ragged ones, and held out on another seed
and shape where every tile is ragged; V4 in transformers' names with float32
``weight_scale_inv`` (experts FP8 too); GPT-OSS with MXFP4 experts, and held out.
"""

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from shared.model.loader import load_model
from tests.helpers.deepseek_v4_models import save_tiny_v4
from tests.helpers.hf_models import ParityCase, check_prefill_then_decode, hf_logits, save_tiny_hf_model
from tests.helpers.paged_driver import PagedDriver
from tools import release_formats as rf

pytest.importorskip("transformers")

TOLERANCE = 1e-4
NUM_DECODE = 4
V4_PROMPT_LENS = (70, 53, 91)  # several sliding windows (16) and compression windows (4, 16)
GPT_OSS_PROMPT_LENS = (5, 13, 22)  # past the window of 6


@dataclass(frozen=True)
class Case:
    seed_source: Callable[[Path], Path]
    write: Callable[[Path, Path, Path], Path]
    prompt_lens: tuple[int, ...]
    block_size: int
    kind_of: Callable[[str], str]
    """checkpoint name -> "fp8", "fp4", "bf16" or "exact": how the release stores it."""


_EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
_GPT_OSS_EXPERT = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")


def _v4_kind(experts: str) -> Callable[[str], str]:
    def kind(name: str) -> str:
        if _EXPERT.search(name):
            return experts
        if rf.V4_FP8_LINEARS.search(name):
            return "fp8"
        return "exact" if rf.V4_FLOAT32.search(name) or name.endswith("tid2eid") else "bf16"

    return kind


def _gpt_oss_kind(name: str) -> str:
    return "fp4" if _GPT_OSS_EXPERT.search(name) else "bf16"


# 256 wide: whole 128-tiles beside ragged ones (q_lora_rank 192: wq_a's rows, wq_b's columns; wkv's 64 rows).
_WIDE_V4 = dict(hidden_size=256, head_dim=64, q_lora_rank=192, o_lora_rank=64, moe_intermediate_size=64)
CASES: dict[str, Case] = {
    "v4_deepseek": Case(
        lambda p: save_tiny_v4("mixed", p, seed=11, **_WIDE_V4), rf.write_v4_deepseek, V4_PROMPT_LENS, 16, _v4_kind("fp4")
    ),
    "v4_deepseek_held_out": Case(
        lambda p: save_tiny_v4("csa_only", p, seed=7), rf.write_v4_deepseek, V4_PROMPT_LENS, 16, _v4_kind("fp4")
    ),
    "v4_transformers_fp8": Case(
        lambda p: save_tiny_v4("hca_first", p, seed=3), rf.write_v4_transformers_fp8, V4_PROMPT_LENS, 16,
        _v4_kind("fp8"),
    ),  # fmt: skip
    "gpt_oss_mxfp4": Case(
        lambda p: save_tiny_hf_model("gpt_oss", p, seed=1), rf.write_gpt_oss_mxfp4, GPT_OSS_PROMPT_LENS, 4,
        _gpt_oss_kind,
    ),  # fmt: skip
    "gpt_oss_mxfp4_held_out": Case(
        lambda p: save_tiny_hf_model("gpt_oss", p, seed=9, hidden_size=96, intermediate_size=64, head_dim=24),
        rf.write_gpt_oss_mxfp4, GPT_OSS_PROMPT_LENS, 4, _gpt_oss_kind,
    ),  # fmt: skip
}


@dataclass
class Loaded:
    case: Case
    seeded: Path
    released: Path
    parity: ParityCase


@pytest.fixture(scope="module", params=list(CASES))
def loaded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Loaded:
    case = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    seeded = case.seed_source(root / "seeded")
    released = case.write(seeded, root / "released", root / "reference")
    model = load_model(released)
    g = torch.Generator().manual_seed(2)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in case.prompt_lens]
    full = [p + torch.randint(3, vocab, (NUM_DECODE,), generator=g).tolist() for p in prompts]
    parity = ParityCase(released, model, prompts, full, hf_logits(root / "reference", full))
    return Loaded(case, seeded, released, parity)


def test_logits_equal_transformers_on_the_dequantised_weights(loaded: Loaded) -> None:
    driver = PagedDriver(loaded.parity.model, num_seqs=len(loaded.parity.prompts), num_blocks=256,
                         block_size=loaded.case.block_size)  # fmt: skip
    check_prefill_then_decode(loaded.parity, driver, NUM_DECODE, TOLERANCE)


def test_dequantised_weights_within_the_formats_error(loaded: Loaded) -> None:
    ours = loaded.parity.model.checkpoint_tensors()
    seeded = load_model(loaded.seeded).checkpoint_tensors()
    assert ours.keys() == seeded.keys()
    seen = set()
    for name, w in seeded.items():
        got, kind = ours[name].float(), loaded.case.kind_of(name)
        err, x = (got - w.float()).abs(), w.float().abs()
        if kind == "fp8":
            bound = 2**-4 * x + 2**-10 * x.max() / 224
        elif kind == "fp4":
            # Groups of 32 along the input: the last dim, or GPT-OSS's x @ W's first.
            inputs_last = x if name.endswith(".weight") else x.transpose(-1, -2)
            group_max = inputs_last.unflatten(-1, (-1, 32)).amax(-1, keepdim=True).expand(*inputs_last.shape[:-1], -1, 32)
            s = group_max.flatten(-2) / 3
            bound = torch.maximum(inputs_last, s) / 4
            bound = bound if name.endswith(".weight") else bound.transpose(-1, -2)
        elif kind == "bf16":
            bound = 2**-8 * x
        else:
            bound = torch.zeros_like(x)
        assert (err <= bound).all(), f"{name} ({kind}): max error {err.max():.3g}"
        if kind in ("fp8", "fp4"):
            assert err.max() > 0, f"{name} was not quantised"
        seen.add(kind)
    assert {"fp8", "fp4"} & seen, "the case quantises nothing"
