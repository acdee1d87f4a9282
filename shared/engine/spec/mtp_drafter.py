"""The MTP drafter: the target's own multi-token-prediction layer proposes γ tokens per
request from the target's hidden states, in a small paged KV cache of its own for the one
layer. ``load_mtp_module`` picks the family's module: DeepSeek-V4's (shared/model/models/
deepseek_v4_mtp.py, reading the target's residual streams before its hyper head) for a V4
target, the DeepSeek-V3-layout layer (shared/model/mtp.py, reading the final hidden
states) for the Llama family. What the target hands over is its ``draft_hidden``.

MTP position i reads (h_i, t_{i+1}) and predicts t_{i+2}. When a request with context
t_0..t_{n-1} drafts, the target has computed positions 0..n-2 (t_{n-1} was just
sampled), and the engine has handed their hidden states over (`observe_hidden`, from
the runner's `keep_hidden`). One batched forward catches every request's MTP layer up
to position n-2, whose output gives the first drafted token d_1; each further drafted
token applies the layer again one position on, on its own output hidden state and the
token it drafted last (DeepSeek reuses its one MTP layer recursively). The raw
confidence of a drafted token is the layer's probability of it.

Per request the drafter keeps its blocks, how many MTP positions hold KV made from the
target's hidden states and committed tokens (`num_valid`), and the target's hidden
states it has not consumed (`pending`, from position base + num_valid on). Positions
past those are never kept valid: the chained ones came from drafted tokens, so the next
proposal writes them again from the target's states. Hidden states of rejected
drafted tokens (positions at or past the context's last token) are dropped there too.
The last consumed position stays pending and is computed again at each proposal, so a
request proposed twice without a step in between drafts the same again.

A request whose first positions the target never computed (a prefix-cache hit) gets an
MTP layer whose attention starts at the first position it saw (`base`); drafts are then
worse, never wrong (verification is lossless).
"""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from shared.engine.spec.drafter import Draft
from shared.engine.step_inputs import to_device
from shared.model.forward_batch import AttentionMetadata
from shared.model.models.deepseek_v4 import DeepseekV4ForCausalLM
from shared.model.models.deepseek_v4_mtp import load_v4_mtp
from shared.model.mtp import load_mtp
from shared.model.interface import CausalLM


class MtpModule(Protocol):
    """What the drafter drives: the Llama family's MTP layer (shared/model/mtp.py) or
    DeepSeek-V4's (shared/model/models/deepseek_v4_mtp.py). Rows of ``hidden`` are what
    the target's ``draft_hidden`` hands over, and what ``forward`` returns for chaining."""

    target: tuple[CausalLM]

    def __call__(
        self, hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor: ...  # fmt: skip

    def compute_logits(self, out: torch.Tensor) -> torch.Tensor: ...

    def allocate_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype) -> torch.Tensor: ...


def load_mtp_module(folder: str, target: CausalLM) -> MtpModule:
    """The target family's MTP module from its checkpoint: V4's for a V4 target, the
    DeepSeek-V3-layout layer for the Llama family (ValueError for other families)."""
    if isinstance(target, DeepseekV4ForCausalLM):
        return load_v4_mtp(folder, target)
    return load_mtp(folder, target)  # type: ignore[arg-type]


@dataclass(slots=True)
class _Held:
    base: int
    """The first position the MTP layer covers (its KV slot 0)."""
    pending: torch.Tensor
    """The target's hidden states [k, H] of positions base + num_valid on, not yet consumed."""
    num_valid: int = 0
    """MTP positions base .. base + num_valid - 1 hold KV from the target's hidden states."""
    token_ids: list[int] = field(default_factory=list)
    """The tokens those positions read (t_{base+1} ...), checked against the context."""
    block_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Rows:
    """One request's rows of an MTP forward."""

    request_id: str
    hidden: torch.Tensor
    token_ids: list[int]
    start: int
    """Position of the first row."""


class MtpDrafter:
    has_scores = True
    """Its drafts carry the layer's probabilities (calibrated by temperature scaling)."""

    def __init__(self, layer: MtpModule, block_size: int, num_blocks: int, dtype: torch.dtype) -> None:
        self.layer = layer
        self.block_size = block_size
        self.max_len = layer.target[0].config.max_position_embeddings
        self.kv_cache = layer.allocate_kv_cache(num_blocks, block_size, dtype)
        self.device = self.kv_cache.device
        self._free = list(range(num_blocks))
        self._held: dict[str, _Held] = {}

    @classmethod
    def load(
        cls, folder: str, target: CausalLM, block_size: int, max_model_len: int, max_num_seqs: int,
        dtype: torch.dtype, kv_bytes: int,
    ) -> "MtpDrafter":  # fmt: skip
        """The MTP layer of the target's checkpoint (ValueError if it has none), with a KV
        cache of at most kv_bytes that holds at least one request of max_model_len."""
        layer = load_mtp_module(folder, target)
        per_request = -(-max_model_len // block_size)
        one = layer.allocate_kv_cache(1, block_size, dtype)  # the module says its row; one block is small
        per_block = one.numel() * one.element_size()
        num_blocks = max(min(kv_bytes // per_block, per_request * max_num_seqs), per_request)
        return cls(layer, block_size, num_blocks, dtype)

    def observe_hidden(self, request_id: str, start_pos: int, hidden: torch.Tensor) -> None:
        """The target computed positions start_pos .. start_pos + len(hidden) - 1 of the
        request this step; hidden: their final hidden states (copied here)."""
        held = self._held.get(request_id)
        if held is not None:
            first = held.base + held.num_valid
            if start_pos < held.base or start_pos > first + len(held.pending):
                # Recomputed from before our start, or a gap (a prefix hit after preemption): start over.
                self._release(held)
                held = None
            elif start_pos < first:  # recomputed positions already consumed (preemption): from there on
                held.num_valid = start_pos - held.base
                del held.token_ids[held.num_valid :]
                held.pending = hidden.clone()
            else:  # the usual case; drops states of rejected drafted tokens past start_pos
                held.pending = torch.cat([held.pending[: start_pos - first], hidden])
        if held is None:
            self._held[request_id] = _Held(start_pos, hidden.clone())

    def forget(self, request_id: str) -> None:
        held = self._held.pop(request_id, None)
        if held is not None:
            self._release(held)

    def propose(self, contexts: dict[str, Sequence[int]], max_tokens: int) -> dict[str, Draft]:
        """Up to max_tokens greedy tokens after each context (none for a request whose
        hidden states are not all here, that would pass max_position_embeddings, or
        whose blocks do not fit)."""
        if max_tokens < 1:  # nothing to run: the catch-up below must not be marked done
            return {}
        rows: list[_Rows] = []
        for rid, context in contexts.items():
            held = self._held.get(rid)
            end = len(context) - 1  # positions < end were computed by the target
            if held is None or not self._read_context(rid, held, context) or end - 1 + max_tokens > self.max_len:
                continue
            first = held.base + held.num_valid
            num_new = end - first
            if num_new < 1 or len(held.pending) < num_new or not self._reserve(held, end - 1 + max_tokens):
                continue
            tokens = list(context[first + 1 : end + 1])
            rows.append(_Rows(rid, held.pending[:num_new], tokens, first))
            # All but the last row become valid KV; the last is recomputed next time (see above).
            held.num_valid += num_new - 1
            held.token_ids += tokens[:-1]
            held.pending = held.pending[num_new - 1 : num_new]
        drafted: dict[str, list[int]] = {r.request_id: [] for r in rows}
        scores: dict[str, list[float]] = {r.request_id: [] for r in rows}
        for k in range(max_tokens):
            if not rows:
                break
            out = self._forward(rows)
            last = torch.tensor([len(r.token_ids) for r in rows], device=self.device).cumsum(0) - 1
            outs = out[last]
            probs, tokens = self.layer.compute_logits(outs).softmax(-1).max(-1)
            for r, token, p in zip(rows, tokens.tolist(), probs.tolist()):
                drafted[r.request_id].append(token)
                scores[r.request_id].append(p)
            # The next token: this output hidden state and the token just drafted, one position on.
            rows = [
                _Rows(r.request_id, o[None], [t], r.start + len(r.token_ids))
                for r, o, t in zip(rows, outs, tokens.tolist())
            ]
        return {rid: Draft(tuple(t), tuple(scores[rid]), tuple(scores[rid])) for rid, t in drafted.items() if t}

    def _read_context(self, rid: str, held: _Held, context: Sequence[int]) -> bool:
        """Whether the held KV read the context's tokens; if not (not expected: committed
        tokens do not change), the request's MTP state is dropped and restarts later."""
        if list(context[held.base + 1 : held.base + 1 + held.num_valid]) == held.token_ids:
            return True
        self.forget(rid)
        return False

    def _forward(self, rows: list[_Rows]) -> torch.Tensor:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        for r in rows:
            held = self._held[r.request_id]
            n = len(r.token_ids)
            input_ids += r.token_ids
            positions += range(r.start, r.start + n)
            local = range(r.start - held.base, r.start - held.base + n)
            slots += [held.block_ids[j // bs] * bs + j % bs for j in local]
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(local.stop)
            tables.append(held.block_ids)
        width = max(len(t) for t in tables)
        meta = AttentionMetadata(
            slot_mapping=to_device(slots, torch.int64, self.device),
            block_tables=to_device([t + [0] * (width - len(t)) for t in tables], torch.int64, self.device),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_size=bs,
        )
        hidden = torch.cat([r.hidden for r in rows])
        ids = to_device(input_ids, torch.long, self.device)
        return self.layer(hidden, ids, to_device(positions, torch.long, self.device), self.kv_cache, meta)

    def _reserve(self, held: _Held, end: int) -> bool:
        """Blocks for positions base .. end - 1; False, taking none, when short."""
        need = -(-(end - held.base) // self.block_size) - len(held.block_ids)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        held.block_ids += self._free[-need:]
        del self._free[-need:]
        return True

    def _release(self, held: _Held) -> None:
        self._free += held.block_ids
        held.block_ids = []
