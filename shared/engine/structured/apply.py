"""The runner's side of structured outputs: each structured request's matcher, and its
token bitmasks applied to its logits rows before the sampler reads them, so greedy and
sampled tokens alike come from the grammar (logprobs are still those of the raw
logits, as vLLM reports them).

Masks are filled on the host while the step's forward still runs on the device
(nothing here waits for it) and applied with xgrammar's kernel: a native one on the
CPU, Triton or CUDA on the GPU. Verification of drafted tokens gets one mask per
drafted position: the matcher walks the draft and is rolled back.
"""

from dataclasses import dataclass, field

import torch

from shared.engine.step import SchedulerOutput
from shared.engine.structured.grammar import GrammarCompiler
from shared.engine.structured.matcher import GrammarState, bitmask_words
from shared.engine.structured.setup import grammar_state


@dataclass
class StructuredRows:
    """The model runner's matchers, one per running structured request."""

    compiler: GrammarCompiler | None = None
    """Set by the engine (None: a checkpoint without a tokenizer; it admits no structured request)."""
    matchers: dict[str, GrammarState] = field(default_factory=dict)

    def update(self, sched: SchedulerOutput) -> None:
        """Drop finished requests' matchers; a fresh one for each request the runner
        (re)starts: it replays the output the request brings (a handoff, a migration)."""
        for rid in sched.finished_request_ids:
            self.matchers.pop(rid, None)
        for new in sched.new_requests:
            state = grammar_state(new.sampling_params, self.compiler)
            if state is None:
                self.matchers.pop(new.request_id, None)
            else:
                self.matchers[new.request_id] = state

    def mask(self, logits: torch.Tensor, request_ids: list[str], outputs: list[list[int]]) -> torch.Tensor:
        """logits [rows, vocab], row i that of request_ids[i] whose output so far is
        outputs[i]; the structured rows masked (a new tensor), logits itself if none is."""
        if not self.matchers:
            return logits
        rows = [i for i, rid in enumerate(request_ids) if rid in self.matchers]
        if not rows:
            return logits
        bitmask = torch.full((len(request_ids), bitmask_words(logits.size(1))), -1, dtype=torch.int32)
        for i in rows:
            matcher = self.matchers[request_ids[i]]
            matcher.sync(outputs[i])
            matcher.fill(bitmask, i)
        x = logits.clone()
        _apply(x, bitmask, rows)
        return x

    def mask_draft(self, logits: torch.Tensor, request_id: str, draft: list[int], output: list[int]) -> torch.Tensor:
        """logits [len(draft) + 1, vocab]: one request's verification rows, row i masked
        to what its grammar allows after the output and the first i drafted tokens;
        logits itself for an unstructured request."""
        matcher = self.matchers.get(request_id)
        if matcher is None:
            return logits
        matcher.sync(output)
        bitmask = torch.full((len(draft) + 1, bitmask_words(logits.size(1))), -1, dtype=torch.int32)
        matcher.fill_draft(draft, bitmask)
        x = logits.clone()
        _apply(x, bitmask, list(range(len(draft) + 1)))
        return x


def _apply(x: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    import xgrammar as xgr

    if x.device.type != "cpu":
        bitmask = bitmask.pin_memory().to(x.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(x, bitmask, vocab_size=x.size(1), indices=rows)
