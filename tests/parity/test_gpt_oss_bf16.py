"""GPT-OSS in bf16 on the CPU, against transformers in bf16 (issue 12's bf16 parity).

transformers' GptOssRMSNorm multiplies the float32-normalised rows by the weight in
float32 and casts once; LlamaRMSNorm casts first, then scales in bf16. The engine's
GPT-OSS norms take GPT-OSS's order (float32 weights, ``norm_scale_in_float32``): the
norm equals transformers' bit for bit, and the model's bf16 logits agree with
transformers' bf16 within bf16 tolerance at (nearly) every position, the few others
being positions where transformers' own bf16 leaves its float32 (a router's top-k
flipped by rounding)."""

import pytest
import torch

from shared.model.layers import RMSNorm
from shared.model.loader import load_model
from tests.helpers.paged_driver import PagedDriver
from tests.helpers.hf_models import random_prompts, save_tiny_hf_model
from shared.model.models.gpt_oss import GptOssForCausalLM

transformers = pytest.importorskip("transformers")

BF16_TOLERANCE = 1e-2  # per position: max |ours - theirs| / max |theirs|


def test_gpt_oss_norm_equals_transformers_in_bf16() -> None:
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(64, 256, generator=g)).to(torch.bfloat16)
    weight = 1 + 0.1 * torch.randn(256, generator=g)
    theirs = GptOssRMSNorm(256, eps=1e-5).to(torch.bfloat16)
    theirs.weight.data.copy_(weight)
    ours = RMSNorm(256, 1e-5, torch.bfloat16, torch.device("cpu"), scale_in_float32=True)
    ours.weight.copy_(theirs.weight)
    assert ours.weight.dtype == torch.float32
    assert torch.equal(ours(x), theirs(x))
    x2, residual = ours.fused_add(x, x)
    assert torch.equal(x2, theirs(x + x)) and torch.equal(residual, x + x)
    # The Llama order (cast, then scale in bf16) is another function in bf16.
    llama = RMSNorm(256, 1e-5, torch.bfloat16, torch.device("cpu"))
    llama.weight.copy_(theirs.weight)
    reference = LlamaRMSNorm(256, eps=1e-5).to(torch.bfloat16)
    reference.weight.data.copy_(theirs.weight)
    assert torch.equal(llama(x), reference(x))
    assert not torch.equal(llama(x), theirs(x))


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_hf_model("gpt_oss", tmp_path_factory.mktemp("gpt_oss"), seed=1))


def test_only_gpt_oss_keeps_float32_norms(gpt_oss: str) -> None:
    model = load_model(gpt_oss, dtype=torch.bfloat16, kernels="torch")
    assert isinstance(model, GptOssForCausalLM)
    norms = [m.weight.dtype for m in model.modules() if isinstance(m, RMSNorm)]
    assert norms and set(norms) == {torch.float32}
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16


def test_bf16_logits_match_transformers_bf16(gpt_oss: str) -> None:
    model = load_model(gpt_oss, dtype=torch.bfloat16, kernels="torch")
    hf = transformers.AutoModelForCausalLM.from_pretrained(gpt_oss, dtype=torch.bfloat16).eval()
    prompts = random_prompts([40, 23, 31], vocab=model.config.vocab_size, seed=4)
    out = PagedDriver(model, num_seqs=len(prompts), block_size=4).step(dict(enumerate(prompts)))
    errors = []
    for s, prompt in enumerate(prompts):
        with torch.no_grad():
            theirs = hf(torch.tensor([prompt])).logits[0].float()
        errors += ((out[s].float() - theirs).abs().max(-1).values / theirs.abs().max()).tolist()
        assert (out[s].float().argmax(-1) == theirs.argmax(-1)).float().mean() > 0.9, f"sequence {s}"
    within = sum(e < BF16_TOLERANCE for e in errors) / len(errors)
    # With the Llama norm order 91 % of these 94 positions are within tolerance; with GPT-OSS's, 98 %.
    assert within >= 0.95, f"{within:.3f} of positions within {BF16_TOLERANCE}"
