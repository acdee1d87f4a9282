"""Tensor-parallel ranks for the parity tests: spawned processes that each load their
slice of a checkpoint and run the same paged steps, rank 0 handing back its logits.
Module-level functions, so a spawned process can import them."""

import multiprocessing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from shared.engine.config import EngineConfig
from shared.engine.executor.process_group import instance_context, join_store, serve_store, tensor_parallel_context
from shared.engine.executor.rank import load_rank_model, splits_attention
from shared.model.interface import CausalLM
from shared.model.loader import load_model, read_config
from shared.model.parallel import SINGLE, ParallelContext
from tests.helpers.paged_driver import PagedDriver

Steps = list[dict[int, list[int]]]
"""Each step: sequence -> the tokens it is fed (PagedDriver.step's argument)."""
DriverArgs = Mapping[str, Any]
"""PagedDriver's keyword arguments beyond the model and num_seqs (block_size, num_blocks)."""


def paged_logits(
    path: Path, steps: Steps, parallel: ParallelContext = SINGLE, driver: DriverArgs | None = None
) -> list[dict[int, torch.Tensor]]:
    """The logits of every step, run with PagedDriver over the model (its slice with ``parallel``)."""
    return run_steps(load_model(path, parallel=parallel), steps, driver)


def run_steps(model: CausalLM, steps: Steps, driver: DriverArgs | None = None) -> list[dict[int, torch.Tensor]]:
    """``driver``: PagedDriver's arguments (None: blocks of 4)."""
    num_seqs = 1 + max(s for step in steps for s in step)
    paged = PagedDriver(model, num_seqs=num_seqs, **(driver if driver is not None else {"block_size": 4}))
    with torch.inference_mode():
        return [paged.step(step) for step in steps]


Logits = list[dict[int, torch.Tensor]]
"""Each step's logits per sequence, as PagedDriver.step returns them."""


def _rank(rank: int, world_size: int, expert_parallel: bool, port: int, cases: list[tuple[Path, Steps]],
          driver: DriverArgs | None, results: Any) -> None:  # fmt: skip
    torch.set_num_threads(1)  # the ranks share the host's few cores
    store = join_store(port, world_size)
    cpu = torch.device("cpu")
    if expert_parallel:
        # As an instance's ranks build it (the executor's group, rank.py's load_rank_model).
        configs = [EngineConfig(model=str(path), tensor_parallel_size=world_size, enable_expert_parallel=True)
                   for path, _ in cases]  # fmt: skip
        tp_attention = splits_attention(configs[0], read_config(cases[0][0]))
        parallel = instance_context(store, rank, world_size, cpu, True, tp_attention)
        logits = [run_steps(load_rank_model(c, parallel, cpu, progress=False), steps, driver)
                  for c, (_, steps) in zip(configs, cases)]  # fmt: skip
    else:
        parallel = tensor_parallel_context(store, rank, world_size, cpu)
        logits = [paged_logits(path, steps, parallel, driver) for path, steps in cases]
    # As numpy arrays: a torch tensor would cross as a shared-memory handle, gone with this process.
    results.put((rank, [[{s: t.numpy() for s, t in step.items()} for step in case] for case in logits]))


def tensor_parallel_logits(
    cases: list[tuple[Path, Steps]], world_size: int, timeout_s: float = 300.0, driver: DriverArgs | None = None,
    expert_parallel: bool = False,
) -> list[list[Logits]]:  # fmt: skip
    """[case][rank]: every rank's logits of every step of each (checkpoint, steps) case,
    the ranks real processes over gloo (one start for all the cases). ``expert_parallel``:
    the MoE layers expert-parallel over the same ranks too (``--tensor-parallel-size N
    --enable-expert-parallel``), the rest as the family splits beside it."""
    got = spawn_ranks(_rank, world_size, (world_size, expert_parallel), (cases, driver), timeout_s)
    return [
        [[{s: torch.from_numpy(a) for s, a in step.items()} for step in got[rank][case]] for rank in range(world_size)]
        for case in range(len(cases))
    ]


def spawn_ranks(target: Callable[..., None], world_size: int, before_port: tuple[Any, ...],
                after_port: tuple[Any, ...], timeout_s: float) -> list[Any]:  # fmt: skip
    """Per rank (in rank order), what ``target`` put on its queue: ``world_size`` spawned
    processes, each called ``target(rank, *before_port, port, *after_port, results)`` with
    the port of one TCPStore they meet at; each puts ``(rank, value)`` on ``results``."""
    context = multiprocessing.get_context("spawn")
    store = serve_store(world_size)
    results = context.Queue()
    procs = [
        context.Process(target=target, args=(rank, *before_port, store.port, *after_port, results), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    try:
        got = dict(results.get(timeout=timeout_s) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.exitcode is None:
                proc.kill()
    assert all(proc.exitcode == 0 for proc in procs), [proc.exitcode for proc in procs]
    return [got[rank] for rank in range(world_size)]
