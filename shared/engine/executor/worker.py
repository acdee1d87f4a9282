"""A tensor-parallel worker: one rank > 0 of an instance, a process the engine started
(multiproc.py). It joins the ranks' group, loads its slice of the model, builds the
same runner as rank 0 (rank.py) and then runs whatever rank 0 sends, step by step.

Talk with rank 0 is one pipe, in this order:

1. the worker sends ``("joined", None)`` once it reached the store, then joins the group;
2. rank 0 sends the ``RunnerSetup``; the worker sends ``("ready", description)`` once
   built: with ``setup.share_kv``, how rank 0 maps its KV cache (KVRegion.share()),
   else empty;
3. rank 0 sends each step as pickled ``(Command, args, MoveOrder | None)``; the order
   (EPLB: switch a moved layer, start moving one on the mover thread) is applied before
   the command's forward; nothing comes back (rank 0's own runner gives the step's
   result; with data-parallel attention, ``("result", RunnerOutput)`` after each EXECUTE
   and COLLECT, the rank's own requests' tokens), until ``CLOSE`` (the worker then
   waits for its move in flight, if any, and exits).

Any failure is sent as ``("error", traceback text)`` before the worker exits non-zero,
so that rank 0 (whose collective then fails, the peer gone) says why. The pipe's end
(EOFError) means the engine is gone: the worker exits.
"""

import logging
import pickle
import sys
import traceback
from collections import deque
from multiprocessing.connection import Connection

import torch

from shared.engine.config import EngineConfig
from shared.engine.executor.base import Command
from shared.engine.executor.data_parallel import strip_for_rank_zero
from shared.engine.executor.expert_mover import ExpertMover
from shared.engine.executor.process_group import expert_move_group, instance_context, join_store
from shared.engine.executor.rank import RunnerSetup, build_runner, checkpoint_recipe, load_rank_model, rank_device
from shared.engine.model_runner import ModelRunner, StepHandle

log = logging.getLogger(__name__)


def run_worker(
    rank: int, world_size: int, store_port: int, config: EngineConfig, tensor_parallel_attention: bool,
    conn: Connection,
) -> None:
    """The worker process's entry point (a spawned multiprocessing target);
    ``tensor_parallel_attention`` as the executor's (rank.py's ``splits_attention``)."""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s tp-rank{rank} %(name)s %(message)s")
    try:
        device = rank_device(config.device, rank, world_size)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:  # the host's cores shared out between the ranks, not each rank's threads on all of them
            torch.set_num_threads(max(1, torch.get_num_threads() // world_size))
        store = join_store(store_port, world_size)
        conn.send(("joined", None))
        parallel = instance_context(store, rank, world_size, device, config.enable_expert_parallel,
                                    tensor_parallel_attention)  # fmt: skip
        move_group = expert_move_group(store, rank, world_size, device) if config.enable_expert_parallel else None
        model = load_rank_model(config, parallel, device, progress=False)
        setup: RunnerSetup = conn.recv()
        runner = build_runner(setup, model, device, checkpoint_recipe(config.model), share_kv=setup.share_kv, rank=rank)
        # Rank 0's connector moves this rank's blocks through this mapping (ranked_region.py).
        conn.send(("ready", runner.kv_region.share() if setup.share_kv else b""))
        mover = None if move_group is None else ExpertMover(model, move_group, device)
        _serve(runner, mover, conn, replies=config.data_parallel_size > 1)
    except EOFError:
        return  # the engine closed its end: nothing left to serve
    except BaseException:
        text = traceback.format_exc()
        try:
            conn.send(("error", text))
        except OSError:
            pass  # the engine is gone too; the log line below is all that is left
        print(f"tensor-parallel rank {rank} failed:\n{text}", file=sys.stderr, flush=True)
        sys.exit(1)


def _serve(runner: ModelRunner, mover: ExpertMover | None, conn: Connection, replies: bool = False) -> None:
    """Run rank 0's commands in the order they come. Launched steps wait here, oldest
    first, for the COLLECT that rank 0 sends when it collects its own (one in flight).
    replies: send each EXECUTE's and COLLECT's result back (data-parallel attention:
    this rank sampled its own requests, which rank 0 did not)."""
    launched: deque[StepHandle] = deque()
    while True:
        command, args, order = pickle.loads(conn.recv_bytes())
        if command is Command.CLOSE:
            if mover is not None:  # a mover still in its collective would abort the exit
                mover.close()
            return
        if order is not None:
            assert mover is not None, "an expert move order for ranks that are not expert-parallel"
            mover.apply(order)
        if command is Command.EXECUTE:
            result = runner.execute(*args)
            if replies:
                conn.send(("result", strip_for_rank_zero(result)))
        elif command is Command.LAUNCH:
            launched.append(runner.launch(*args))
        elif command is Command.SAMPLE:  # the newest launch: the one before it was collected
            runner.sample(launched[-1])
        elif command is Command.COLLECT:
            result = runner.collect(launched.popleft())
            if replies:
                conn.send(("result", strip_for_rank_zero(result)))
        elif command is Command.TIME_STEP:
            runner.time_step(*args)
        else:
            raise AssertionError(f"unknown command {command!r}")
