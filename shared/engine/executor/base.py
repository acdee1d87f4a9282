"""The seam between the engine and the ranks that run its model (vLLM's
vllm/v1/executor): the engine hands each step to an ``Executor``; the executor runs it
on one model runner (``UniProcExecutor``, one process, the engine as it always was) or
on N ranks at once (``MultiprocExecutor``, multiproc.py: tensor parallelism). Rank 0's
runner lives in the engine's process and gives the step's result; the runner never
knows whether other ranks exist. With data-parallel attention each rank runs its own
part of the step (``SchedulerOutput.ranks``) and the step's result is every rank's
joined (data_parallel.py).

The operations are the runner's that run the model (every rank must run them, in the
same order, since a forward's collectives pair up across ranks); what only reads rank
0's state (its structured matchers) the engine reads off ``runner``. KV that enters or
leaves the instance moves in every rank's cache at once, through one region over all
of them in rank 0's process (MultiprocExecutor.kv_region, shared/kv/memory/ranked_region.py).
"""

from abc import ABC, abstractmethod
from enum import Enum

from shared.engine.eplb.balancer import ExpertMove
from shared.engine.model_runner import ModelRunner, RunnerOutput, StepHandle
from shared.engine.step import SchedulerOutput


class Command(Enum):
    """A runner operation every rank runs, as rank 0 sends it to the others."""

    EXECUTE = "execute"
    LAUNCH = "launch"
    SAMPLE = "sample"
    COLLECT = "collect"
    TIME_STEP = "time_step"
    CLOSE = "close"


class Executor(ABC):
    runner: ModelRunner
    """Rank 0's runner, in this process."""

    @abstractmethod
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """ModelRunner.execute on every rank; rank 0's result."""

    @abstractmethod
    def launch(self, sched: SchedulerOutput) -> StepHandle:
        """ModelRunner.launch on every rank; rank 0's handle."""

    @abstractmethod
    def sample(self, handle: StepHandle) -> None:
        """ModelRunner.sample of the newest launched step on every rank (its deferred
        sampling, once the step before is collected)."""

    @abstractmethod
    def collect(self, handle: StepHandle) -> RunnerOutput:
        """ModelRunner.collect of the oldest launched step on every rank."""

    @abstractmethod
    def time_step(self, num_tokens: int, repeats: int = 3) -> float:
        """ModelRunner.time_step on every rank; rank 0's seconds."""

    @abstractmethod
    def close(self) -> None:
        """Stop the other ranks (and wait for them); the executor runs nothing after."""

    @abstractmethod
    def check_alive(self) -> None:
        """Raise (WorkerFailed, naming it) if a rank died: the engine's loop asks while
        idle too, so a dead rank takes the instance down before the next request."""

    @property
    @abstractmethod
    def accepts_expert_move(self) -> bool:
        """Whether queue_expert_move may be called: the ranks are expert-parallel and no
        move is waiting or in flight."""

    @abstractmethod
    def queue_expert_move(self, move: ExpertMove) -> None:
        """Move one MoE layer's experts (EPLB) on every rank, in the background from the
        next forward on (execute or launch); every rank switches the layer before one
        later forward, the same on all (multiproc.py, move_schedule.py)."""


class UniProcExecutor(Executor):
    """One rank: each operation is the runner's own, called straight through."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        return self.runner.execute(sched)

    def launch(self, sched: SchedulerOutput) -> StepHandle:
        return self.runner.launch(sched)

    def sample(self, handle: StepHandle) -> None:
        self.runner.sample(handle)

    def collect(self, handle: StepHandle) -> RunnerOutput:
        return self.runner.collect(handle)

    def time_step(self, num_tokens: int, repeats: int = 3) -> float:
        return self.runner.time_step(num_tokens, repeats)

    def close(self) -> None:
        pass

    def check_alive(self) -> None:
        pass  # the one rank is this process

    @property
    def accepts_expert_move(self) -> bool:
        return False

    def queue_expert_move(self, move: ExpertMove) -> None:
        raise ValueError("one rank holds every expert: nothing to move")
