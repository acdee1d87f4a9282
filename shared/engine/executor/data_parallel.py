"""The executor's side of data-parallel attention (EngineConfig.data_parallel_size): each
rank runs its own step (shared/engine/dp_scheduler.py made them) and samples its own
requests, so the step's result is the ranks' results joined. Kept apart from the
multiprocess plumbing (multiproc.py) so that the rule is read, and tested, alone.

What crosses back from a worker is its tokens, their logprobs and its scored prompt
positions: small, and pickled once per step. Its tokens per expert do not: the model
sums them over the ranks on the device (expert_parallel_model.py), so rank 0's are
the instance's already.
"""

from shared.engine.model_runner import RunnerOutput
from shared.engine.step import SchedulerOutput


def check_rank_steps(sched: SchedulerOutput, num_ranks: int) -> None:
    """A step made for ``num_ranks`` data-parallel ranks: one part each, every part or
    none forwarding (an idle rank pads while any other rank runs: the MoE collectives
    need all of them)."""
    if len(sched.ranks) != num_ranks:
        raise ValueError(f"a data-parallel step needs one part per rank: {len(sched.ranks)} for {num_ranks} ranks")
    forwarding = [not p.is_empty or p.pad_forward for p in sched.ranks]
    assert all(forwarding) or not any(forwarding), f"some ranks would skip the step's collectives: {forwarding}"


def strip_for_rank_zero(result: RunnerOutput) -> RunnerOutput:
    """A worker's result as it is sent to rank 0: without the tokens per expert (rank 0
    holds the same sum) or hidden states (no drafter runs under data parallelism)."""
    return RunnerOutput(result.sampled, result.logprobs, None, result.prompt_logprobs, result.num_accepted,
                        spec_logprobs=result.spec_logprobs)  # fmt: skip


def join_rank_outputs(results: list[RunnerOutput]) -> RunnerOutput:
    """Rank 0's result (first) and the workers': every rank's requests are its own, so
    the per-request maps are disjoint and join; the counts are rank 0's (the sum)."""
    first = results[0]
    joined = RunnerOutput({}, {}, first.expert_counts)
    for result in results:
        joined.sampled.update(result.sampled)
        joined.logprobs.update(result.logprobs)
        joined.prompt_logprobs.update(result.prompt_logprobs)
        joined.num_accepted.update(result.num_accepted)
        joined.spec_logprobs.update(result.spec_logprobs)
    return joined
