"""Turns one step's logits into one token per request: constraints (allowed
tokens, bad words, logit bias: logit_constraints.py), penalties, greedy or
temperature / top-k / top-p / min-p sampling, and logprobs.

Pure torch, no model code. Rows are grouped by what they need so the common
case (all greedy, no penalties, no logprobs) is a single argmax.

Sampling uses the exponential race (argmax(p / q), q ~ Exp(1)), equivalent to
the Gumbel-max trick, with counter-based noise (keyed_random.py): the noise of
the token at sequence position P is a pure function of (seed, P), so a seeded
request's tokens depend on its seed and its logits alone — not on the batch
around it, its row, the process, a restart or a handoff, and no sampler state
travels anywhere. Unseeded requests get a seed from the engine's on first draw.
"""

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain

import torch

from shared.engine.keyed_random import Stream, keys_tensor, mix64, race
from shared.engine.logit_constraints import apply_constraints
from shared.engine.outputs import TokenLogprobs
from shared.engine.sampling_params import SamplingParams
from shared.engine.step_inputs import to_device


@dataclass(slots=True)
class SamplingState:
    """Sampling context of one running request, owned by the engine."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    """Grows as the engine appends sampled tokens; the sampler only reads it."""
    seed: int | None
    """The seed of the request's draws: params.seed, or for an unseeded request one
    the sampler assigns on its first sampled step (None until then)."""
    eos_token_ids: frozenset[int]
    """Masked, with stop_token_ids, while the output is shorter than min_tokens."""

    @property
    def next_position(self) -> int:
        """The sequence position of the next token, as this state knows it (an
        overlapped engine's runner knows better: its appends lag a step)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        prompt_token_ids: Iterable[int],
        eos_token_ids: Iterable[int] = (),
    ) -> "SamplingState":
        if isinstance(eos_token_ids, (str, torch.device)):
            # Guards the old create(params, prompt, device): a str would become a set of characters.
            raise TypeError("eos_token_ids must be token ids: create(params, prompt, eos_token_ids)")
        return cls(params, list(prompt_token_ids), [], params.seed, frozenset(eos_token_ids))


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    """None where params.logprobs is None."""


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        """Where unseeded requests' seeds come from: the n-th such request gets
        mix64(seed, n), so an engine's unseeded output is reproducible from its seed
        and its order of requests (the mesh's balancer seeds every request anyway)."""
        self._num_unseeded = 0

    def seed_of(self, state: SamplingState) -> int:
        """The state's seed, assigned on first use (see `seed`)."""
        if state.seed is None:
            self._num_unseeded += 1
            state.seed = mix64(mix64(self.seed) + self._num_unseeded) >> 1  # [0, 2**63), as params.seed
        return state.seed

    def __call__(
        self, logits: torch.Tensor, states: list[SamplingState], positions: list[int] | None = None
    ) -> SamplerOutput:
        """logits: [num_reqs, vocab]; row i belongs to states[i] and samples the token at
        sequence position positions[i] (default: each state's next_position). The input
        is not modified."""
        tokens = self.sample_tokens(logits, states, positions)
        token_ids: list[int] = tokens.tolist()
        wanted = logprob_tensors(logits, states, tokens)
        logprobs = wanted.unpack(token_ids) if wanted is not None else [None] * len(states)
        return SamplerOutput(token_ids, logprobs)

    def sample_tokens(
        self,
        logits: torch.Tensor,
        states: list[SamplingState],
        positions: list[int] | None = None,
        pending: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The sampled token ids [num_reqs], left on the logits' device: an
        overlapped engine reads them back later without stalling the next launch.
        positions as in __call__: the key of each row's noise. pending: [num_reqs] on the
        logits' device, per row the output token the previous step sampled that the
        state does not hold yet (-1: none); penalties count it there, on the device."""
        if logits.dim() != 2 or logits.size(0) != len(states):
            raise ValueError(f"logits must be [{len(states)}, vocab], got {list(logits.shape)}")
        if positions is None:
            positions = [s.next_position for s in states]
        elif len(positions) != len(states):
            raise ValueError(f"positions must have one entry per row ({len(states)}), got {len(positions)}")
        if logits.dtype != torch.float32:
            logits = logits.float()  # softmax / cumsum in half precision would bias top-p
        num_reqs = len(states)
        x = _apply_penalties(apply_constraints(logits, states), states, pending)
        greedy_rows = [i for i, s in enumerate(states) if s.params.greedy]
        if len(greedy_rows) == num_reqs:
            return x.argmax(dim=-1)  # the common case: one argmax, no sort, no row gathers
        tokens = torch.empty(num_reqs, dtype=torch.long, device=logits.device)
        if greedy_rows:
            rows = _index(greedy_rows, logits.device)
            tokens[rows] = x[rows].argmax(dim=-1)
        random_rows = [i for i, s in enumerate(states) if not s.params.greedy]
        rows = _index(random_rows, logits.device)
        sampled = [states[i] for i in random_rows]
        # The race argmax(p / q) is scale-invariant, so probs need no renormalisation
        # after masking; zeroed tokens can never win.
        keys = keys_tensor([self.seed_of(s) for s in sampled], [positions[i] for i in random_rows],
                           Stream.TOKEN, logits.device)  # fmt: skip
        tokens[rows] = race(sampling_probs(x[rows], sampled), keys)
        return tokens


def sampling_probs(x: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """The distribution each non-greedy row samples from, given its constrained and
    penalised logits x: temperature, top-k / top-p, softmax, min-p. Rows are not
    renormalised after min-p (callers that need a distribution divide by the sum)."""
    device, vocab = x.device, x.size(1)
    temps = to_device([s.params.temperature for s in states], torch.float32, device)
    x = x / temps.unsqueeze(1)

    # Top-k / top-p only on the rows that ask: a row's result must not depend on
    # which other rows share the batch (rounding in a top_p=1 cumsum could cut its tail).
    cut = [j for j, s in enumerate(states) if (s.params.top_k or vocab) < vocab or s.params.top_p < 1.0]
    if cut:
        rows = _index(cut, device)
        top_k = to_device([min(states[j].params.top_k or vocab, vocab) for j in cut], torch.long, device)
        top_p = to_device([states[j].params.top_p for j in cut], torch.float32, device)
        x[rows] = _top_k_top_p(x[rows], top_k, top_p)

    probs = x.softmax(dim=-1)
    # min-p compares probabilities to the row's maximum, a ratio that renormalisation
    # after top-k/top-p does not change, so it can use the probabilities directly.
    floor = [j for j, s in enumerate(states) if s.params.min_p > 0.0]
    if floor:
        rows = _index(floor, device)
        min_p = to_device([states[j].params.min_p for j in floor], torch.float32, device)
        p = probs[rows]
        p_max = p.amax(dim=-1, keepdim=True)
        probs[rows] = p.masked_fill(p < min_p.unsqueeze(1) * p_max, 0.0)
    return probs


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return to_device(rows, torch.long, device)


def _token_keys(
    rows: list[int], seqs: list[list[list[int]]], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct flat positions row * vocab + id of the tokens of seqs[j] (its lists chained)
    in row rows[j] of a contiguous [num_reqs, vocab] tensor, and how often each occurs.

    Ids outside [0, vocab) are dropped: the tokenizer's vocab may exceed the logits' (or
    ids be placeholders), and such tokens cannot be sampled anyway.
    """
    ids = to_device(list(chain.from_iterable(chain.from_iterable(seqs))), torch.long, device)
    lengths = to_device([sum(map(len, parts)) for parts in seqs], torch.long, device)
    row_of = torch.repeat_interleave(_index(rows, device), lengths)
    valid = (ids >= 0) & (ids < vocab)
    keys, counts = torch.unique(row_of[valid] * vocab + ids[valid], return_counts=True)
    return keys, counts


def _apply_penalties(
    logits: torch.Tensor, states: list[SamplingState], pending: torch.Tensor | None = None
) -> torch.Tensor:
    """min_tokens masking, repetition, presence and frequency penalties, in that order.

    Returns logits itself when no row needs any of them (no copy), else a new tensor.
    pending: see Sampler.sample_tokens (min_tokens does not count it: an overlapped
    step with such a row samples once the step before is read back, ModelRunner.sample).
    """
    vocab, device = logits.size(1), logits.device
    mask_rows: list[int] = []
    mask_ids: list[int] = []
    for i, s in enumerate(states):
        if len(s.output_token_ids) < s.params.min_tokens:
            # ignore_eos: EOS never ends the request, so there is nothing to hold back.
            banned = set(s.params.stop_token_ids)
            if not s.params.ignore_eos:
                banned |= s.eos_token_ids
            for t in banned:
                if 0 <= t < vocab:
                    mask_rows.append(i)
                    mask_ids.append(t)
    rep = [i for i, s in enumerate(states) if s.params.repetition_penalty != 1.0]
    pres_freq = [
        i for i, s in enumerate(states) if s.params.presence_penalty != 0.0 or s.params.frequency_penalty != 0.0
    ]
    if not (mask_rows or rep or pres_freq):
        return logits
    if pending is not None and (rep or pres_freq):
        x = logits.clone(memory_format=torch.contiguous_format)
        if mask_rows:
            x[_index(mask_rows, device), _index(mask_ids, device)] = float("-inf")
        return _penalties_with_pending(x, states, rep, pres_freq, pending)

    x = logits.clone(memory_format=torch.contiguous_format)  # contiguous for the flat view below
    if mask_rows:
        x[_index(mask_rows, device), _index(mask_ids, device)] = float("-inf")
    # x is a fresh contiguous clone, so writes through the flat view land in it. Penalties
    # touch only the seen (row, token) positions: O(tokens), no dense [rows, vocab] temporary.
    flat = x.view(-1)
    if rep:
        keys, _ = _token_keys(rep, [[states[i].prompt_token_ids, states[i].output_token_ids] for i in rep], vocab, device)
        penalty = to_device([s.params.repetition_penalty for s in states], torch.float32, device)[keys // vocab]
        seen = flat[keys]
        # HF RepetitionPenaltyLogitsProcessor: shrink towards 0 whatever the sign.
        flat[keys] = torch.where(seen < 0, seen * penalty, seen / penalty)
    if pres_freq:
        keys, counts = _token_keys(pres_freq, [[states[i].output_token_ids] for i in pres_freq], vocab, device)
        presence = to_device([s.params.presence_penalty for s in states], torch.float32, device)[keys // vocab]
        frequency = to_device([s.params.frequency_penalty for s in states], torch.float32, device)[keys // vocab]
        flat[keys] -= presence + frequency * counts
    return x


def _penalties_with_pending(
    x: torch.Tensor, states: list[SamplingState], rep: list[int], pres_freq: list[int], pending: torch.Tensor
) -> torch.Tensor:
    """The penalties of _apply_penalties, with each row's pending token (on the device)
    counted as one more output token: the host's counts go to the device as they are,
    the pending token is added there, so nothing waits for the step in flight. Dense
    [penalised rows, vocab] counts; the same arithmetic as the sparse path on every
    token seen, and x unchanged on the others, so the tokens are the same."""
    vocab, device = x.size(1), x.device
    if rep:
        rows = _index(rep, device)
        seen = _dense_counts(rep, [[states[i].prompt_token_ids, states[i].output_token_ids] for i in rep], vocab,
                             device, pending[rows]) > 0  # fmt: skip
        penalty = to_device([states[i].params.repetition_penalty for i in rep], torch.float32, device)[:, None]
        sub = x[rows]
        x[rows] = torch.where(seen, torch.where(sub < 0, sub * penalty, sub / penalty), sub)
    if pres_freq:
        rows = _index(pres_freq, device)
        counts = _dense_counts(pres_freq, [[states[i].output_token_ids] for i in pres_freq], vocab, device, pending[rows])
        presence = to_device([states[i].params.presence_penalty for i in pres_freq], torch.float32, device)[:, None]
        frequency = to_device([states[i].params.frequency_penalty for i in pres_freq], torch.float32, device)[:, None]
        sub = x[rows]
        x[rows] = torch.where(counts > 0, sub - (presence + frequency * counts), sub)
    return x


def _dense_counts(
    rows: list[int], seqs: list[list[list[int]]], vocab: int, device: torch.device, pending: torch.Tensor
) -> torch.Tensor:
    """[len(rows), vocab] float32: how often each token occurs in seqs[j] (counted on the
    host, where the lists are) plus row j's pending token when it is one (>= 0)."""
    ids = torch.tensor(list(chain.from_iterable(chain.from_iterable(seqs))), dtype=torch.long)
    row_of = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor([sum(map(len, p)) for p in seqs]))
    valid = (ids >= 0) & (ids < vocab)
    host = torch.zeros(len(rows), vocab, dtype=torch.float32)
    host.view(-1).index_put_((row_of[valid] * vocab + ids[valid],), torch.ones(int(valid.sum())), accumulate=True)
    counts = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
    has = (pending >= 0) & (pending < vocab)
    counts[torch.arange(len(rows), device=device), pending.clamp(0, vocab - 1)] += has.float()
    return counts


def _top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Masks to -inf all but each row's top_k tokens, then all but its nucleus.

    top_k: [rows] long (vocab = keep all); top_p: [rows] float (1.0 = keep all).
    One stable descending sort serves both, so ties keep the lower id first, like argmax.
    """
    vocab = x.size(1)
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
    position = torch.arange(vocab, device=x.device).unsqueeze(0)
    sorted_x = sorted_x.masked_fill(position >= top_k.unsqueeze(1), float("-inf"))
    probs = sorted_x.softmax(dim=-1)
    # Probability mass strictly before each token: keep it while that is below top_p,
    # i.e. the smallest prefix reaching top_p; position 0 always stays (mass 0 < top_p).
    before = torch.nn.functional.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))
    drop = (before >= top_p.unsqueeze(1)) & (top_p.unsqueeze(1) < 1.0)
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(-1, order, sorted_x)


@dataclass(slots=True)
class LogprobTensors:
    """One step's logprobs, computed where the logits are and read back later: an
    overlapped engine copies them to the host with the sampled tokens, without
    waiting for the device. Rows are those of the requests that asked, in order."""

    num_rows: int
    """Rows of the step (requests sampled)."""
    rows: list[int]
    num_top: list[int]
    """Per wanted row, how many top entries its request asked for."""
    chosen: torch.Tensor
    ranks: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor

    def to_host(self) -> "LogprobTensors":
        """Copies into pinned host memory, queued on the current stream (non-blocking)."""
        def host(t: torch.Tensor) -> torch.Tensor:
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return out.copy_(t, non_blocking=True)

        return LogprobTensors(
            self.num_rows, self.rows, self.num_top,
            host(self.chosen), host(self.ranks), host(self.top_values), host(self.top_ids),
        )

    def unpack(self, token_ids: list[int]) -> list[TokenLogprobs | None]:
        """Per row of the step (token_ids: its sampled tokens), its logprobs or None."""
        out: list[TokenLogprobs | None] = [None] * self.num_rows
        chosen: list[float] = self.chosen.tolist()
        ranks: list[int] = self.ranks.tolist()
        top_values: list[list[float]] = self.top_values.tolist()
        top_ids: list[list[int]] = self.top_ids.tolist()
        for j, (i, k) in enumerate(zip(self.rows, self.num_top)):
            top = list(zip(top_ids[j][:k], top_values[j][:k]))
            out[i] = TokenLogprobs(token_ids[i], chosen[j], ranks[j], top)
        return out


def logprob_tensors(logits: torch.Tensor, states: list[SamplingState], tokens: torch.Tensor) -> LogprobTensors | None:
    """Logprobs of the raw logits (before penalties and temperature, vLLM's default)
    for the rows whose request asked for them; None when none did. Nothing is read
    back to the host here."""
    wanted = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    if not wanted:
        return None
    rows = _index(wanted, logits.device)
    logprobs = logits[rows].float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens[rows].unsqueeze(1))
    ranks = (logprobs >= chosen).sum(dim=-1)
    num_top = [states[i].params.logprobs or 0 for i in wanted]
    top_values, top_ids = logprobs.topk(min(max(num_top), logprobs.size(1)), dim=-1)
    return LogprobTensors(len(states), wanted, num_top, chosen.squeeze(1), ranks, top_values, top_ids)
