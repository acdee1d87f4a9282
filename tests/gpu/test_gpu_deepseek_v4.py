"""DeepSeek-V4 on a GPU (issue 12, point 7; run on the device machine:
`python -m pytest -q tests/gpu`): the tiny seeded V4 checkpoints (tests/deepseek_v4_models.py:
sliding, CSA and HCA layers, hash routing, mHC) through the whole engine on CUDA, in
float32 and bfloat16, teacher-forced against transformers on the same GPU: at every
step our greedy token must be transformers' top token or within a rounding margin
of it (bf16 rounds differently in different correct kernels, and the indexer's top-k
can break exact ties either way), and the prefill's top logprobs must match."""

import pytest
import torch

from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from tests.deepseek_v4_models import save_tiny_v4

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MARGIN = {torch.float32: 1e-3, torch.bfloat16: 0.05}
"""How far below transformers' top logit our greedy token may be."""
LOGPROB_TOL = {torch.float32: 1e-3, torch.bfloat16: 0.05}
NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def prompts(lengths=(5, 17, 40, 70), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module", params=["mixed", "csa_only"])
def checkpoint(request, tmp_path_factory):
    return save_tiny_v4(request.param, tmp_path_factory.mktemp(request.param), seed=1)


def hf_model(path, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to("cuda").eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_v4_on_cuda_follows_transformers(checkpoint, dtype):
    hf = hf_model(checkpoint, dtype)
    llm = LLM(str(checkpoint), dtype=NAMES[dtype], device="cuda", block_size=16, prefill_chunk_size=32)
    for p in prompts():
        first = llm.generate([p], SamplingParams(max_tokens=1, temperature=0.0, logprobs=5))[0]
        with torch.inference_mode():
            ref = torch.log_softmax(hf(torch.tensor([p], device="cuda")).logits[0, -1].float(), -1)
        for token, logprob in first.logprobs[0].top:
            assert abs(logprob - ref[token].item()) < LOGPROB_TOL[dtype], (token, logprob, ref[token].item())
    outs = llm.generate(prompts(), SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    for p, out in zip(prompts(), outs):
        seq = torch.tensor([p + out.token_ids], device="cuda")
        with torch.inference_mode():
            logits = hf(seq).logits[0, len(p) - 1 : -1].float()
        chosen = logits.gather(1, torch.tensor(out.token_ids, device="cuda")[:, None])[:, 0]
        gap = logits.max(dim=1).values - chosen
        assert (gap <= MARGIN[dtype]).all(), f"a greedy token is not transformers' top one: gaps {gap.tolist()}"
