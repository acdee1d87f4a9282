"""N ranks of one instance: the engine's process is rank 0 (it schedules, and its runner
gives each step's result); ranks 1..N-1 are worker processes it spawns (worker.py),
each holding its slice of the model and running the same runner step on the same
scheduler output.

Step inputs go to the workers over one pipe each, pickled once per step (vLLM's
MultiprocExecutor broadcasts them through a shared-memory ring for the same reason):

- the workers wait for the next step outside any collective, so an engine idle for an
  hour trips no collective timeout; a ``broadcast_object_list`` on the group would
  either time out while idle or need an unbounded timeout, which turns a dead peer
  into a hang;
- the control messages stay off the tensor-parallel group (NCCL moves tensors on the
  device only: a pickled object would go through GPU memory each step);
- a pipe's end is how a worker learns the engine is gone (EOFError): no orphan ranks.

EPLB's weight moves ride with the execute and launch messages as ``MoveOrder``s
(move_schedule.py): one step's message has every rank start moving a layer on its
mover thread (expert_mover.py, over a second group kept for moves), and the steps run
on with the old placement; once rank 0 learns every rank finished, the next message
has them all switch that layer before the same forward.

Every rank samples the same tokens from the same all-gathered logits (vLLM v1 does
the same), so no tokens cross back; the workers keep their sampling state in step.
With data-parallel attention (EngineConfig.data_parallel_size) each rank runs its own
step instead (``SchedulerOutput.ranks``: rank r is sent its own) and samples its own
requests, so each worker sends its step's result back over its pipe after EXECUTE and
COLLECT, and rank 0 joins them with its own (data_parallel.py).

A dead rank fails loudly: before each step rank 0 checks that every worker lives; a
worker that dies mid-step breaks the step's collective on rank 0 (gloo sees its
connection close; a hung one trips COLLECT_TIMEOUT_S), and the error raised names
the worker, its exit code and the traceback it sent.
"""

import logging
import multiprocessing
import pickle
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

from shared.engine.config import EngineConfig
from shared.engine.executor.base import Command, Executor
from shared.engine.eplb.balancer import ExpertMove
from shared.engine.executor.expert_mover import ExpertMover
from shared.engine.executor.move_schedule import MoveOrder, MoveSchedule
from shared.engine.executor.data_parallel import check_rank_steps, join_rank_outputs
from shared.engine.executor.process_group import (
    COLLECTIVE_TIMEOUT_S, expert_move_group, instance_context, serve_store,
)  # fmt: skip
from shared.engine.executor.rank import RunnerSetup, rank_device
from shared.engine.executor.worker import run_worker
from shared.engine.model_runner import ModelRunner, RunnerOutput, StepHandle
from shared.engine.step import SchedulerOutput
from shared.kv.memory.dp_region import DataParallelKVRegion
from shared.kv.memory.ranked_region import RankedKVRegion, open_region
from shared.kv.memory.region import KVRegion
from shared.model.parallel import ParallelContext
from shared.model.parallel_layers import kv_heads_of_rank

log = logging.getLogger(__name__)

T = TypeVar("T")
CLOSE_TIMEOUT_S = 10.0
"""How long close() waits for a worker to exit before killing it."""
_POLL_S = 0.05


class WorkerFailed(RuntimeError):
    """A tensor-parallel worker died or failed: the instance cannot go on."""


class MultiprocExecutor(Executor):
    """Starts the workers and joins their group at construction (``parallel`` is then rank
    0's context, for the engine to load its slice with); ``start(setup, runner)`` has
    them build their runners, after which it runs steps."""

    def __init__(self, config: EngineConfig, tensor_parallel_attention: bool) -> None:
        """``tensor_parallel_attention``: the ranks split the attention's heads (rank.py's
        ``splits_attention``), with expert parallelism or without."""
        self.world_size = config.num_ranks
        self.data_parallel = config.data_parallel_size > 1
        """Each rank runs its own step and sends back its result (data-parallel attention)."""
        self._workers: list[BaseProcess] = []
        self._conns: list[Connection] = []
        self._closed = False
        self.moves = MoveSchedule(blocking=config.eplb_settings().blocking_moves)
        self._mover: ExpertMover | None = None
        store = serve_store(self.world_size)
        context = multiprocessing.get_context("spawn")  # a forked child would inherit the parent's threads and CUDA
        for rank in range(1, self.world_size):
            ours, theirs = context.Pipe()
            args = (rank, self.world_size, store.port, config, tensor_parallel_attention, theirs)
            proc = context.Process(target=run_worker, args=args,
                                   name=f"infermesh-tp-rank{rank}", daemon=True)  # fmt: skip
            proc.start()
            theirs.close()  # ours alone stays open here: the worker reads EOF once we are gone
            self._workers.append(proc)
            self._conns.append(ours)
        # Workers that outlive their engine (dropped without close()) are stopped with it.
        self._finalizer = weakref.finalize(self, _stop, self._workers, self._conns)
        try:
            self._await_all("joined")
            device = rank_device(config.device, 0, self.world_size)
            self.parallel: ParallelContext = instance_context(
                store, 0, self.world_size, device, config.enable_expert_parallel, tensor_parallel_attention
            )
            self._move_group = (
                expert_move_group(store, 0, self.world_size, device) if config.enable_expert_parallel else None
            )
        except BaseException:
            self.close()
            raise
        self._store = store  # the workers' rendezvous: kept while the group lives

    def start(self, setup: RunnerSetup, runner: ModelRunner) -> None:
        """Have every worker build its runner as rank 0 built ``runner``; returns once all did."""
        self.runner = runner
        if self._move_group is not None:
            self._mover = ExpertMover(runner.model, self._move_group, runner.device)
        for conn in self._conns:
            conn.send(setup)
        shares = self._await_all("ready")
        self._kv_shares = [shares[rank] for rank in range(1, self.world_size)]
        """Each worker's KV cache description (setup.share_kv), rank after rank."""

    def kv_region(self, num_kv_heads: int | None) -> KVRegion:
        """The instance's KV over every rank, for its connector: rank 0's region and the
        workers' caches mapped here (started with setup.share_kv). num_kv_heads: the
        model's, split over the ranks as its attention splits them (tensor parallelism,
        with expert parallelism or without); None: every rank holds the whole KV
        (``CausalLM.splits_kv_heads`` False: DeepSeek-V4's one KV head and compressed
        caches, under tensor parallelism or beside it). With data-parallel
        attention each rank's cache holds its own requests' KV: one region over them under
        instance-wide block ids (shared/kv/memory/dp_region.py)."""
        first = self.runner.kv_region
        others = []
        for rank, description in enumerate(self._kv_shares, start=1):
            if not description:
                raise ValueError(f"rank {rank}'s KV cache is not shared: start the workers with RunnerSetup.share_kv")
            others.append(open_region(description, first.kv_layout, first.device))
        if self.data_parallel:
            return DataParallelKVRegion([first, *others])
        if num_kv_heads is None:
            return RankedKVRegion([first, *others])
        heads = [kv_heads_of_rank(num_kv_heads, rank, self.world_size) for rank in range(self.world_size)]
        return RankedKVRegion([first, *others], heads, num_kv_heads)

    def check_alive(self) -> None:
        self._check_alive()

    # -- steps ----------------------------------------------------------------

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        order = self._move_order()
        own = self._send_step(Command.EXECUTE, sched, order)
        result = self._guarded(self._ordered_then, order, self.runner.execute, own)
        return self._joined(result)

    def launch(self, sched: SchedulerOutput) -> StepHandle:
        order = self._move_order()
        own = self._send_step(Command.LAUNCH, sched, order)
        return self._guarded(self._ordered_then, order, self.runner.launch, own)

    def _send_step(self, command: Command, sched: SchedulerOutput, order: MoveOrder | None) -> SchedulerOutput:
        """Send the workers their step (the same one, or with data-parallel attention each
        its own); returns rank 0's."""
        if not self.data_parallel:
            self._send(command, (sched,), order)
            return sched
        self._check_open()
        check_rank_steps(sched, self.world_size)
        self._send_each(command, [(part,) for part in sched.ranks[1:]], order)
        return sched.ranks[0]

    def _joined(self, own: RunnerOutput) -> RunnerOutput:
        """Rank 0's result, joined with every worker's under data-parallel attention."""
        if not self.data_parallel:
            return own
        return join_rank_outputs([own, *self._receive_results()])

    @property
    def accepts_expert_move(self) -> bool:
        return self._mover is not None and self.moves.accepting

    def queue_expert_move(self, move: ExpertMove) -> None:
        if self._mover is None:
            raise ValueError("the ranks are not expert-parallel: no experts to move")
        self.moves.queue(move)

    def _move_order(self) -> MoveOrder | None:
        return None if self._mover is None else self.moves.order(moved_everywhere=self._mover.finished)

    def _ordered_then(self, order: MoveOrder | None, run: Callable[..., T], *args: Any) -> T:
        if order is not None:
            assert self._mover is not None
            self._mover.apply(order)
        return run(*args)

    def sample(self, handle: StepHandle) -> None:
        self._send(Command.SAMPLE, ())
        self._guarded(self.runner.sample, handle)

    def collect(self, handle: StepHandle) -> RunnerOutput:
        self._send(Command.COLLECT, ())
        return self._joined(self._guarded(self.runner.collect, handle))

    def time_step(self, num_tokens: int, repeats: int = 3) -> float:
        self._send(Command.TIME_STEP, (num_tokens, repeats))
        return self._guarded(self.runner.time_step, num_tokens, repeats)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._mover is not None:  # the workers' movers need rank 0's in their collectives
            self._mover.close()
        self._finalizer()

    # -- the workers ----------------------------------------------------------

    def _send(self, command: Command, args: tuple[Any, ...], order: MoveOrder | None = None) -> None:
        self._send_each(command, [args] * len(self._conns), order)

    def _send_each(self, command: Command, args: list[tuple[Any, ...]], order: MoveOrder | None = None) -> None:
        """Worker rank r is sent ``args[r - 1]`` (each distinct payload pickled once)."""
        self._check_open()
        self._check_alive()
        pickled: dict[int, bytes] = {}
        for rank, (conn, own) in enumerate(zip(self._conns, args, strict=True), start=1):
            if id(own) not in pickled:
                pickled[id(own)] = pickle.dumps((command, own, order), protocol=pickle.HIGHEST_PROTOCOL)
            try:
                conn.send_bytes(pickled[id(own)])
            except OSError as e:
                raise self._failure(rank, f"could not be sent a step ({e})") from e

    def _check_open(self) -> None:
        if self._closed:
            raise WorkerFailed("the tensor-parallel executor is closed")

    def _receive_results(self) -> list[RunnerOutput]:
        """Each worker's result of the step just run, rank after rank (data-parallel
        attention); WorkerFailed naming one that died or failed instead."""
        results: list[RunnerOutput] = []
        for rank, (proc, conn) in enumerate(zip(self._workers, self._conns), start=1):
            deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S
            while not conn.poll(_POLL_S):
                if proc.exitcode is not None or time.monotonic() > deadline:
                    raise self._failure(rank, "sent no result for its step")
            try:
                kind, payload = conn.recv()
            except (EOFError, OSError):
                raise self._failure(rank, "exited during a step") from None
            if kind == "error":
                proc.join(timeout=1.0)
                self.close()
                raise WorkerFailed(f"data-parallel worker rank {rank} failed during a step; exit code "
                                   f"{proc.exitcode}; its error:\n{payload}")  # fmt: skip
            assert kind == "result", f"worker rank {rank} sent {kind!r} during a step"
            results.append(payload)
        return results

    def _guarded(self, run: Callable[..., T], *args: Any) -> T:
        """Rank 0's own part of a step; a collective broken by a failed worker becomes
        WorkerFailed naming it."""
        try:
            return run(*args)
        except RuntimeError as e:
            dead = self._first_failed(wait_s=1.0)
            if dead is None:
                raise
            raise self._failure(dead, f"failed during a step ({e})") from e

    def _check_alive(self) -> None:
        dead = self._first_failed(wait_s=0.0)
        if dead is not None:
            raise self._failure(dead, "died")

    def _first_failed(self, wait_s: float) -> int | None:
        """The rank of a worker that exited or reported an error (waiting up to wait_s for
        one: its exit trails the broken collective that rank 0 saw)."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, (proc, conn) in enumerate(zip(self._workers, self._conns), start=1):
                if proc.exitcode is not None or _has_error(conn):
                    return rank
            if time.monotonic() >= deadline:
                return None
            time.sleep(_POLL_S)

    def _failure(self, rank: int, what: str) -> WorkerFailed:
        proc, conn = self._workers[rank - 1], self._conns[rank - 1]
        proc.join(timeout=1.0)
        detail = _error_text(conn)
        self.close()
        message = f"tensor-parallel worker rank {rank} {what}; exit code {proc.exitcode}"
        return WorkerFailed(message + (f"; its error:\n{detail}" if detail else ""))

    def _await_all(self, stage: str) -> dict[int, Any]:
        """Wait until every worker sent ``stage``; what each sent with it, by rank.
        WorkerFailed if one fails first."""
        sent: dict[int, Any] = {}
        pending = set(range(1, self.world_size))
        while pending:
            for rank in sorted(pending):
                proc, conn = self._workers[rank - 1], self._conns[rank - 1]
                if conn.poll(_POLL_S / len(pending)):
                    try:
                        kind, payload = conn.recv()
                    except EOFError:
                        raise self._failure(rank, f"exited before it was {stage}") from None
                    if kind == "error":
                        self.close()
                        raise WorkerFailed(f"tensor-parallel worker rank {rank} failed to start:\n{payload}")
                    assert kind == stage, f"worker rank {rank} sent {kind!r} while starting, expected {stage!r}"
                    pending.discard(rank)
                    sent[rank] = payload
                elif proc.exitcode is not None:
                    raise self._failure(rank, f"exited before it was {stage}")
        return sent


def _has_error(conn: Connection) -> bool:
    """Whether the worker sent something during steps (it sends only its error then)."""
    try:
        return conn.poll()
    except OSError:
        return True


def _error_text(conn: Connection) -> str:
    try:
        if conn.poll():
            kind, payload = conn.recv()
            return str(payload) if kind == "error" else ""
    except (EOFError, OSError):
        pass
    return ""


def _stop(workers: list[BaseProcess], conns: list[Connection]) -> None:
    """Ask every live worker to close, wait, then kill what is left (close() and the finalizer)."""
    close = pickle.dumps((Command.CLOSE, (), None), protocol=pickle.HIGHEST_PROTOCOL)
    for proc, conn in zip(workers, conns):
        if proc.exitcode is None:
            try:
                conn.send_bytes(close)
            except OSError:
                pass
    deadline = time.monotonic() + CLOSE_TIMEOUT_S
    for proc in workers:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.exitcode is None:
            log.warning("tensor-parallel worker %s did not exit in %.0f s: killing it", proc.name, CLOSE_TIMEOUT_S)
            proc.kill()
            proc.join(timeout=1.0)
    for conn in conns:
        conn.close()
