"""What the engine's speculative scheduler would choose under a given acceptance
profile, replayed on this model's measured costs (issue 27: acceptance measured with
random weights means little, so bench-spec shows these rows beside the measured ones).

A profile is a mean accepted length τ: tokens one verification emits per request
(the accepted drafted tokens plus the bonus or correction token), at γ drafted tokens.
Its per-position survival is taken geometric, a_j = p^j with 1 + Σ_{j<=γ} p^j = τ
(every position accepted with the same probability p given the ones before: the
simplest curve with that mean; the real curve falls faster with j, which a measured
profile would show). The replay then runs the engine's own decisions on it, for a
batch of R requests that all follow the profile:

- depth: ``choose_depth``, from the profile, the SPS table measured on the target and
  the measured cost of one MTP drafting pass over the batch (d passes draft d tokens);
- verification: ``schedule_greedy`` (DSpark's Algorithm 1) over the drafted tokens,
  with the drafting time as the step's fixed cost;
- both again with drafting free (DSpark's own assumption: the production drafter runs
  inside the target's step), so the choices show with and without the MTP's cost.

Expected tokens per second are Θ = τ_step / (drafting + 1 / SPS(B)) of the chosen
schedule, against R · SPS(R) without speculation. Nothing here is measured output:
it is the scheduler's answer to the profile on these costs.
"""

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.engine.spec.schedule import SpsTable, choose_depth, schedule_greedy, step_rate
from shared.model.forward_batch import AttentionMetadata

PROFILE_SOURCE = (
    "mean accepted length 3.5-5.5 tokens per verification at γ = 5: issue 27, citing the DSpark paper "
    "(DeepSpec, DSpark-5 as V4's production drafter, γ_max = 5) and public V4 deployments (field accept "
    "lengths 2.8-5.5, /work/shared/references/serving-systems.md); per-position survival assumed geometric"
)


@dataclass(slots=True)
class ReplayRow:
    batch: int
    profile: float
    """τ, the profile's mean accepted length (tokens per verification)."""
    p: float
    """The per-position acceptance that gives τ at γ."""
    drafting: str
    """"measured" (the MTP pass's measured cost) or "free" (DSpark's assumption)."""
    depth: int
    """Tokens drafted per request (choose_depth)."""
    verified_per_request: float
    """Drafted tokens verified per request (schedule_greedy), the mean over the batch."""
    tokens_per_step: float
    """Expected tokens emitted per request and step."""
    tokens_per_s: float
    """Expected output tokens per second of the batch."""
    vs_none: float


def geometric_survival(mean_accepted: float, gamma: int) -> tuple[float, list[float]]:
    """(p, [p, p², ..., p^γ]) with 1 + Σ p^j = mean_accepted (1 <= it <= 1 + γ)."""
    if not 1.0 <= mean_accepted <= 1.0 + gamma:
        raise ValueError(f"a mean accepted length at γ = {gamma} lies in [1, {1 + gamma}], got {mean_accepted}")
    lo, hi = 0.0, 1.0
    for _ in range(60):  # bisection: 1 + Σ p^j increases with p
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if 1 + sum(mid**j for j in range(1, gamma + 1)) < mean_accepted else (lo, mid)
    p = (lo + hi) / 2
    return p, [p**j for j in range(1, gamma + 1)]


def replay(
    sps: SpsTable, profiles: Sequence[float], gamma: int, batch: int, draft_seconds: float
) -> list[ReplayRow]:
    """The scheduler's choices for each profile at this batch size, with the measured
    drafting cost (seconds of one MTP pass over the batch) and with drafting free."""
    rows: list[ReplayRow] = []
    none = batch * sps(batch)
    for tau in profiles:
        p, survival = geometric_survival(tau, gamma)
        for drafting, seconds in (("measured", draft_seconds), ("free", 0.0)):
            depth = choose_depth(batch, survival, sps, seconds)
            fixed = depth * seconds
            lengths = schedule_greedy([survival[:depth]] * batch, sps, fixed)
            emitted = sum(1 + sum(survival[:n]) for n in lengths)
            rate = emitted * step_rate(sps, sum(1 + n for n in lengths), fixed)
            rows.append(ReplayRow(batch, tau, p, drafting, depth, sum(lengths) / batch, emitted / batch, rate,
                                  rate / none))  # fmt: skip
    return rows


@torch.inference_mode()
def time_mtp_pass(layer: torch.nn.Module, batch: int, context: int, repeats: int = 5) -> float:
    """Seconds of one drafting pass over ``batch`` requests (the MTP module's forward of
    one row each at position ``context``, over that much window KV, and its logits): the
    fastest of ``repeats``. Its own scratch cache; nothing of the engine's is touched."""
    block_size = 16
    target = layer.target[0]
    dtype = target.dtype
    per_request = -(-(context + 1) // block_size)
    kv = layer.allocate_kv_cache(batch * per_request, block_size, dtype)
    device = kv.device
    tables = torch.arange(batch * per_request, device=device).view(batch, per_request)
    slots = tables[:, context // block_size] * block_size + context % block_size
    meta = AttentionMetadata(slots, tables, list(range(batch + 1)), [context + 1] * batch, block_size)
    # A row is what the target hands over: its hidden state, or V4's hc streams of it.
    width = getattr(layer, "hc_mult", 1) * target.config.hidden_size
    hidden = torch.randn(batch, width, device=device, dtype=dtype)
    ids = torch.zeros(batch, dtype=torch.long, device=device)
    positions = torch.full((batch,), context, dtype=torch.long, device=device)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        layer.compute_logits(layer(hidden, ids, positions, kv, meta))
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def format_replay(rows: list[ReplayRow]) -> str:
    head = (f"{'batch':>5}  {'τ':>4} {'p':>6}  {'drafting':<8} {'depth':>5} {'verified/req':>12} "
            f"{'tok/step/req':>12} {'tok/s (expected)':>16} {'vs none':>7}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.batch:>5}  {r.profile:>4.1f} {r.p:>6.3f}  {r.drafting:<8} {r.depth:>5} "
                     f"{r.verified_per_request:>12.2f} {r.tokens_per_step:>12.2f} {r.tokens_per_s:>16.1f} "
                     f"{r.vs_none:>7.2f}")  # fmt: skip
    return "\n".join(lines)
