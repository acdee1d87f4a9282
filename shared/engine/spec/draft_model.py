"""The draft-model drafter: a small model with the target's tokenizer proposes γ
tokens per request by greedy decoding, in this process, on a ModelRunner of its
own with its own small paged KV cache.

Each request keeps its blocks and the tokens whose draft KV they hold. At the
next proposal the context has moved on (the accepted drafted tokens, then the
target's correction or bonus token): the held tokens are compared with it, and
the draft recomputes from the first that differs (rejected drafts' KV is simply
overwritten). One batched forward catches every request up and drafts its first
token; each further drafted token is one batched single-token forward, launched
behind the one before it on the device (its input token stays there), with one
read-back for all of them (ModelRunner.collect_passes). The raw confidence of a
drafted token is its probability under the draft model, computed only where the
speculator's schedule reads it (not the fixed one).
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shared.engine.model_runner import ModelRunner
from shared.engine.sampling_params import SamplingParams
from shared.engine.spec.drafter import Draft
from shared.engine.step import PLACEHOLDER, NewRequestData, ScheduledChunk, SchedulerOutput
from shared.model.interface import CausalLM

_PARAMS = SamplingParams(temperature=0.0, max_tokens=1 << 30, logprobs=0, ignore_eos=True)
"""Greedy, with the chosen token's logprob (its probability is the raw confidence)."""
_PARAMS_NO_SCORES = SamplingParams(temperature=0.0, max_tokens=1 << 30, ignore_eos=True)
"""Greedy alone, where nobody reads the confidences (the fixed schedule)."""


@dataclass(slots=True)
class _Held:
    block_ids: list[list[int]]
    """Per KV group of the draft model."""
    token_ids: list[int] = field(default_factory=list)
    """The tokens whose draft KV the blocks hold, in order."""


class DraftModelDrafter:
    has_scores: bool
    """Whether its drafts carry raw probabilities (calibrated by temperature scaling)."""

    def __init__(
        self,
        model: CausalLM,
        block_size: int,
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
        max_batch: int = 64,
        max_tokens: int = 4,
        cuda_graphs: bool = True,
        max_model_len: int | None = None,
        scores: bool = True,
    ) -> None:
        """max_batch, max_tokens: the most requests and drafted tokens per request a
        proposal serves; with cuda_graphs (on CUDA), its single-token passes and short
        catch-ups (the accepted drafts and the correction: up to max_tokens + 1 tokens)
        replay CUDA graphs: a small draft model's eager forward is all launch overhead.
        scores: give each drafted token's probability (draft_probs); without, every pass
        skips its logprobs (a log-softmax over the vocabulary and four copies back) and
        each confidence is 1, for a schedule that reads none (fixed)."""
        self.model = model
        self.has_scores = scores
        self._params = _PARAMS if scores else _PARAMS_NO_SCORES
        self.block_size = block_size
        self.max_len = model.config.max_position_embeddings
        self.runner = ModelRunner(
            model, num_blocks, block_size, dtype, device, cuda_graphs=cuda_graphs,
            max_model_len=min(self.max_len, max_model_len or self.max_len), max_batch=max_batch,
            max_graph_query=max_tokens + 1,
        )  # fmt: skip
        self.num_groups = len(model.kv_layout.groups)
        self._free = list(range(num_blocks))
        self._held: dict[str, _Held] = {}
        self._finished: set[str] = set()

    def forget(self, request_id: str) -> None:
        held = self._held.pop(request_id, None)
        if held is not None:
            for ids in held.block_ids:
                self._free += ids
            self._finished.add(request_id)

    def propose(self, contexts: dict[str, Sequence[int]], max_tokens: int) -> dict[str, Draft]:
        """Up to max_tokens greedy draft tokens after each context (none for a request
        whose context would pass the draft's length or whose blocks do not fit)."""
        sched = self._sched()
        chunks: dict[str, ScheduledChunk] = {}
        for rid, context in contexts.items():
            if len(context) + max_tokens > self.max_len or not self._reserve(rid, len(context) + max_tokens):
                continue
            held = self._held[rid]
            start = min(_common_prefix(held.token_ids, context), len(context) - 1)
            if rid not in self.runner.states:
                sched.new_requests.append(NewRequestData(rid, list(context[:1]), self._params, frozenset(), []))
            chunks[rid] = ScheduledChunk(rid, list(context[start:]), start, held.block_ids, sample=True)
            held.token_ids = list(context)
        # Every pass is launched without waiting for the one before: pass k + 1 reads pass
        # k's tokens on the device (placeholders, as the engine's overlapped steps do), and
        # all of them come back to the host once, at the end. Read back pass by pass, a
        # small draft model spent its time in the host's syncs, not on the device.
        handles = []
        for k in range(max_tokens):
            if not chunks:
                break
            sched.chunks = list(chunks.values())
            handles.append(self.runner.launch(sched))
            sched = self._sched()
            if k + 1 < max_tokens:
                for rid in chunks:
                    held = self._held[rid]
                    position = len(held.token_ids) + k  # the token sampled by pass k
                    chunks[rid] = ScheduledChunk(rid, [PLACEHOLDER], position, held.block_ids, sample=True)
        by_pass, logprobs = self.runner.collect_passes(handles)
        assert not by_pass or (logprobs is not None) == self.has_scores, "logprobs exactly when scoring"
        drafts: dict[str, Draft] = {}
        for row, rid in enumerate(chunks):  # the passes' rows are the chunks, in order
            drafted = tuple(tokens[row] for tokens in by_pass)
            self._held[rid].token_ids += drafted[:-1]  # the last one's KV is not written yet
            if not drafted:
                continue
            if logprobs is None:
                drafts[rid] = Draft(drafted, (1.0,) * len(drafted))
            else:
                scores = tuple(math.exp(lps[row]) for lps in logprobs)
                drafts[rid] = Draft(drafted, scores, scores)
        return drafts

    def _sched(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished)
        self._finished = set()
        return out

    def _reserve(self, rid: str, num_tokens: int) -> bool:
        """Blocks for num_tokens in every group; False, taking none, when short."""
        held = self._held.setdefault(rid, _Held([[] for _ in range(self.num_groups)]))
        need = -(-num_tokens // self.block_size) - len(held.block_ids[0])
        if need <= 0:
            return True
        if need * self.num_groups > len(self._free):
            return False
        for ids in held.block_ids:
            ids += self._free[-need:]
            del self._free[-need:]
        return True


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    # Held tokens and context differ, if at all, within the last step's drafts: compare
    # all but a tail of 16 at C speed, then walk the tail (from 0 if they differ earlier),
    # rather than walking the whole context in Python per request per step.
    i = max(n - 16, 0)
    if a[:i] != b[:i]:
        i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
