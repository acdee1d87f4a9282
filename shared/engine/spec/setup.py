"""Building the engine's speculator from its settings: the drafter, and for the
dspark schedule the SPS profile (steps per second against tokens per step),
measured on the target when the engine starts."""

import logging
from collections.abc import Callable, Sequence

import torch

from shared.engine.config import EngineConfig
from shared.engine.spec.draft_model import DraftModelDrafter
from shared.engine.spec.mtp_drafter import MtpDrafter
from shared.engine.spec.schedule import SpsTable
from shared.engine.spec.speculator import BatchDrafter, NgramDrafter, Speculator
from shared.model.loader import load_model
from shared.model.interface import CausalLM

log = logging.getLogger(__name__)

DRAFT_KV_BYTES = 64 << 20
"""The most memory the draft model's KV cache takes (it holds one request of
max_model_len whatever this says)."""
PROFILE_TOKENS_CPU = 64
"""Largest step profiled on the CPU (the profile must stay short at start)."""
PROFILE_TOKENS_CUDA = 1024


def sps_profile(time_step: Callable[[int], float], max_tokens: int) -> SpsTable:
    """SPS(B) at B = 1, 2, 4, ... up to max_tokens (and max_tokens itself), made
    non-increasing: a step of more tokens is never faster than one of fewer, and a
    timing that says so is noise (launch-bound eager steps on a GPU measure nearly
    flat), which would stop DSpark's greedy at its first false cliff."""
    counts, b = [], 1
    while b < max_tokens:
        counts.append(b)
        b *= 2
    counts.append(max_tokens)
    rates: list[float] = []
    for n in counts:
        rate = 1.0 / max(time_step(n), 1e-9)
        rates.append(min(rate, rates[-1]) if rates else rate)
    return SpsTable(tuple(counts), tuple(rates))


def make_speculator(
    config: EngineConfig,
    target: CausalLM,
    time_step: Callable[[int], float],
    max_model_len: int,
    dtype: torch.dtype,
    device: torch.device,
    graph_buckets: Sequence[int] = (),
) -> Speculator:
    drafter: BatchDrafter
    if config.speculative == "draft":
        draft = load_model(config.spec_draft_model, dtype=dtype, device=device, kernels=config.kernels)
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"spec_draft_model {config.spec_draft_model} has a vocabulary of {draft.config.vocab_size} tokens, "
                f"the model {target.config.vocab_size}: a draft model must share the target's tokenizer"
            )
        per_request = -(-max_model_len // config.block_size) * len(draft.kv_layout.groups)
        per_block = draft.kv_bytes_per_block(config.block_size, dtype)
        num_blocks = max(min(DRAFT_KV_BYTES // per_block, per_request * config.max_num_seqs), per_request)
        drafter = DraftModelDrafter(draft, config.block_size, num_blocks, dtype, device, config.max_num_seqs,
                                    config.spec_tokens, config.cuda_graphs, max_model_len,
                                    scores=config.spec_schedule != "fixed")  # fmt: skip
    elif config.speculative == "mtp":  # the target's own MTP layer, from its checkpoint
        args = (config.block_size, max_model_len, config.max_num_seqs, dtype, DRAFT_KV_BYTES)
        drafter = MtpDrafter.load(config.model, target, *args)
    else:
        drafter = NgramDrafter()
    sps = None
    if config.spec_schedule != "fixed":
        budget, _ = config.step_sizes()
        cap = PROFILE_TOKENS_CUDA if device.type == "cuda" else PROFILE_TOKENS_CPU
        sps = sps_profile(time_step, min(config.max_num_seqs * (1 + config.spec_tokens), budget, cap))
        log.info("speculative decoding: SPS profile %s", dict(zip(sps.tokens, (round(s, 1) for s in sps.steps_per_s))))
    return Speculator(drafter, config.spec_tokens, config.spec_schedule, sps, graph_buckets)
