"""DeepSeek-V4 on a GPU (issue 12, point 7; run on the device machine:
`python -m pytest -q tests/gpu`): the tiny seeded V4 checkpoints (tests/helpers/deepseek_v4_models.py:
sliding, CSA and HCA layers, hash routing, mHC) through the whole engine on CUDA, in
float32 and bfloat16, teacher-forced against transformers on the same GPU: at every
step our greedy token must be transformers' top token or within a rounding margin
of it (bf16 rounds differently in different correct kernels, and the indexer's top-k
can break exact ties either way), and the prefill's top logprobs must match."""

import pytest
import torch

from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from tests.helpers.deepseek_v4_models import save_tiny_v4, seeded_prompts as prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MARGIN = {torch.float32: 1e-3, torch.bfloat16: 0.05}
"""How far below transformers' top logit our greedy token may be."""
LOGPROB_TOL = {torch.float32: 1e-3, torch.bfloat16: 0.05}
NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


@pytest.fixture(scope="module", params=["mixed", "csa_only"])
def checkpoint(request, tmp_path_factory):
    return save_tiny_v4(request.param, tmp_path_factory.mktemp(request.param), seed=1)


def hf_model(path, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to("cuda").eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_v4_on_cuda_follows_transformers(checkpoint, dtype):
    hf = hf_model(checkpoint, dtype)
    hf32 = hf if dtype == torch.float32 else hf_model(checkpoint, torch.float32)
    llm = LLM(str(checkpoint), dtype=NAMES[dtype], device="cuda", block_size=16, prefill_chunk_size=32)
    for p in prompts():
        first = llm.generate([p], SamplingParams(max_tokens=1, temperature=0.0, logprobs=5))[0]
        with torch.inference_mode():
            ids = torch.tensor([p], device="cuda")
            ref = torch.log_softmax(hf(ids).logits[0, -1].float(), -1)
            truth = torch.log_softmax(hf32(ids).logits[0, -1].float(), -1)
        top = first.logprobs[0].top
        ours_err = max(abs(lp - truth[t].item()) for t, lp in top)
        if dtype == torch.float32:
            assert ours_err < LOGPROB_TOL[dtype], (top, [truth[t].item() for t, _ in top])
        else:
            # bf16: as close to float32 as transformers' own bf16 is (V4 rounds in many more
            # places than Llama: mHC streams, compressors, the indexer), or within the tolerance.
            hf_err = max(abs(ref[t].item() - truth[t].item()) for t, _ in top)
            assert ours_err < max(LOGPROB_TOL[dtype], 1.5 * hf_err), (ours_err, hf_err)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts(), params)
    ours_all, hf_all = [], []
    for p, out in zip(prompts(), outs):
        seq = torch.tensor([p + out.token_ids], device="cuda")
        chosen_ids = torch.tensor(out.token_ids, device="cuda")[:, None]
        with torch.inference_mode():
            theirs = torch.log_softmax(hf(seq).logits[0, len(p) - 1 : -1].float(), -1)
            truth = torch.log_softmax(hf32(seq).logits[0, len(p) - 1 : -1].float(), -1)
        if dtype == torch.float32:
            gap = theirs.max(dim=1).values - theirs.gather(1, chosen_ids)[:, 0]
            assert (gap <= MARGIN[dtype]).all(), f"a greedy token is not transformers' top one: gaps {gap.tolist()}"
            continue
        # bf16: measured against float32 (transformers' bf16 is another rounding, not the
        # truth: at a near-tie the two bf16 paths may pick different tokens, and then the
        # teacher-forced sequences part). Our logprob of each chosen token must be as close
        # to float32's as transformers' bf16 is, and a chosen token may trail float32's top
        # only by what that rounding error can flip.
        ours_lp = torch.tensor([lp.logprob for lp in out.logprobs], device="cuda")
        ours_errs = (ours_lp - truth.gather(1, chosen_ids)[:, 0]).abs()
        hf_errs = (theirs.gather(1, chosen_ids)[:, 0] - truth.gather(1, chosen_ids)[:, 0]).abs()
        # One prompt's 32 positions are a small sample: on the H100 (docs/perf/
        # v4_bf16_error_h100_2026-12-07.txt) ours/transformers' mean ranged 0.78-1.64 from
        # prompt to prompt with our kernels and 0.47-1.46 with PyTorch's, while over all
        # prompts it was 1.05 and 0.97. So each prompt within 2x, all of them pooled within 1.25x.
        assert ours_errs.mean() <= max(LOGPROB_TOL[dtype] / 4, 2 * hf_errs.mean()), (ours_errs, hf_errs)
        assert ours_errs.max() <= max(LOGPROB_TOL[dtype], 2 * hf_errs.max()), (ours_errs, hf_errs)
        ours_all.append(ours_errs)
        hf_all.append(hf_errs)
    if dtype == torch.bfloat16:
        ours_mean, hf_mean = torch.cat(ours_all).mean(), torch.cat(hf_all).mean()
        assert ours_mean <= max(LOGPROB_TOL[dtype] / 4, 1.25 * hf_mean), (ours_mean, hf_mean)
