"""Prompt logprobs (vLLM's prompt_logprobs, and echo's logprobs): each prompt
token's logprob under the model given the tokens before it, with its rank and the
k most likely alternatives at its position. Computed from the hidden states of
the prefill chunks that run anyway (the row before a token predicts it), in
slices, so the [rows, vocab] logits never exceed SLICE_ROWS rows at a time."""

from collections.abc import Callable

import torch

from shared.engine.outputs import TokenLogprobs
from shared.engine.step import ScheduledChunk

SLICE_ROWS = 256
"""Rows of logits at a time: 256 × a 128k vocabulary is 128 MiB of float32."""


def chunk_targets(chunk: ScheduledChunk, prompt_token_ids: list[int]) -> list[tuple[int, int]]:
    """(row in the chunk, prompt position scored) for each prompt token this chunk
    predicts: row r (position start_pos + r) predicts position start_pos + r + 1."""
    first, last = chunk.start_pos + 1, min(chunk.start_pos + len(chunk.token_ids), len(prompt_token_ids) - 1)
    return [(pos - 1 - chunk.start_pos, pos) for pos in range(first, last + 1)]


@torch.inference_mode()
def score_prompt(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    rows: list[int],
    targets: list[int],
    num_top: int,
) -> list[TokenLogprobs]:
    """TokenLogprobs of targets[i] given hidden[rows[i]] (raw logits, before any
    sampling setting, as the sampler's own logprobs)."""
    out: list[TokenLogprobs] = []
    for at in range(0, len(rows), SLICE_ROWS):
        index = torch.tensor(rows[at : at + SLICE_ROWS], dtype=torch.long, device=hidden.device)
        wanted = torch.tensor(targets[at : at + SLICE_ROWS], dtype=torch.long, device=hidden.device)
        logprobs = compute_logits(hidden.index_select(0, index)).float().log_softmax(dim=-1)
        chosen = logprobs.gather(1, wanted.unsqueeze(1))
        ranks = (logprobs >= chosen).sum(dim=-1)
        top_values, top_ids = logprobs.topk(min(num_top, logprobs.size(1)), dim=-1)
        for token, lp, rank, values, ids in zip(
            wanted.tolist(), chosen.squeeze(1).tolist(), ranks.tolist(), top_values.tolist(), top_ids.tolist()
        ):
            out.append(TokenLogprobs(token, lp, rank, list(zip(ids, values))))
    return out
