"""The engine-core parity tests on a GPU, in bfloat16 (run on the device
machine: `python -m pytest -q tests/gpu`). Skipped where CUDA is missing.

bfloat16 rounds differently in different (correct) kernels, so greedy decoding
can legitimately diverge where two tokens are near-tied. The check is therefore
teacher-forced: transformers scores our whole sequence, and at every step our
token must be transformers' top token or within a bf16 rounding margin of it.
"""

import pytest
import torch

from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from tests.helpers.hf_models import save_tiny_hf_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
BF16_MARGIN = 0.05  # in logits; bf16 keeps ~3 significant digits


def prompts(vocab: int, lengths=(5, 17, 33, 70), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_tiny_hf_model(request.param, path)
    return path


def hf_model(path, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to("cuda").eval()


def test_bf16_prefill_logits_close_to_transformers(checkpoint):
    hf = hf_model(checkpoint, torch.bfloat16)
    llm = LLM(str(checkpoint), dtype="bfloat16", device="cuda", block_size=16)
    for p in prompts(500):
        out = llm.generate([p], SamplingParams(max_tokens=1, temperature=0.0, logprobs=5))[0]
        with torch.inference_mode():
            ref = torch.log_softmax(hf(torch.tensor([p], device="cuda")).logits[0, -1].float(), -1)
        top = out.logprobs[0].top
        for token, logprob in top:
            assert abs(logprob - ref[token].item()) < 0.05


@pytest.mark.parametrize("kernels", ["triton", "torch"])
def test_bf16_greedy_generation_follows_transformers(checkpoint, kernels):
    hf = hf_model(checkpoint, torch.bfloat16)
    llm = LLM(str(checkpoint), dtype="bfloat16", device="cuda", block_size=16, prefill_chunk_size=32, kernels=kernels)
    outs = llm.generate(prompts(500), SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    for p, out in zip(prompts(500), outs):
        seq = torch.tensor([p + out.token_ids], device="cuda")
        with torch.inference_mode():
            logits = hf(seq).logits[0, len(p) - 1 : -1].float()
        chosen = logits.gather(1, torch.tensor(out.token_ids, device="cuda")[:, None])[:, 0]
        gap = logits.max(dim=1).values - chosen
        assert (gap <= BF16_MARGIN).all(), f"a greedy token is not transformers' top one: gaps {gap.tolist()}"


def test_kernels_and_torch_path_agree_on_a_long_fp32_generation(tmp_path):
    # In bf16 the two paths round differently and a random tiny model has near
    # ties everywhere; there both are held to transformers above instead.
    save_tiny_hf_model("llama", tmp_path)
    params = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
    ps = prompts(500, lengths=(9, 40, 130), seed=3)
    with_kernels = LLM(str(tmp_path), dtype="float32", device="cuda", kernels="triton")
    plain = LLM(str(tmp_path), dtype="float32", device="cuda", kernels="torch")
    # A batch, and one request alone (batch 1 decodes through the GEMV kernels).
    for batch in (ps, ps[1:2]):
        assert [o.token_ids for o in with_kernels.generate(batch, params)] == [
            o.token_ids for o in plain.generate(batch, params)
        ]
