"""The group of one instance's ranks (tensor- or expert-parallel), made without torch.distributed's
global default group: a TCP store that rank 0 serves, and a gloo (CPU) or NCCL (CUDA)
backend built on it, held by the ``ParallelContext`` that is handed to the model.
Nothing global is set, so several engines (or a test and its engines) live in one
process side by side.

``COLLECTIVE_TIMEOUT_S`` bounds every collective: a rank that stops answering (hung, or
killed where the transport does not notice at once) makes the others raise instead of
waiting forever. The ranks only meet in collectives inside a step, never while idle
(they wait for the next step on a pipe, shared/engine/executor/worker.py), so an idle
engine never trips it.
"""

import datetime

import torch
import torch.distributed as dist

from shared.model.parallel import ParallelContext

COLLECTIVE_TIMEOUT_S = 60.0
STORE_HOST = "127.0.0.1"
"""One host: the ranks of an instance are processes the engine starts beside itself."""


def serve_store(world_size: int, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> dist.TCPStore:
    """Rank 0's store on a free port (``store.port``), which the other ranks join."""
    return dist.TCPStore(STORE_HOST, 0, world_size, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)  # fmt: skip


def join_store(port: int, world_size: int, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> dist.TCPStore:
    return dist.TCPStore(STORE_HOST, port, world_size, False, timeout=datetime.timedelta(seconds=timeout_s))


def tensor_parallel_context(
    store: dist.Store, rank: int, world_size: int, device: torch.device, timeout_s: float = COLLECTIVE_TIMEOUT_S
) -> ParallelContext:
    """This rank's context over a new group of every rank: NCCL for a CUDA device, gloo
    otherwise. Returns once every rank has joined."""
    group = _backend(dist.PrefixStore("tp", store), rank, world_size, device, timeout_s)
    return ParallelContext(tp_rank=rank, tp_size=world_size, group=group)


def expert_parallel_context(
    store: dist.Store, rank: int, world_size: int, device: torch.device, timeout_s: float = COLLECTIVE_TIMEOUT_S,
    tensor_parallel: bool = False,
) -> ParallelContext:
    """This rank's context for an expert-parallel model over every rank: its MoE layers
    split by expert over the "ep" group; with ``tensor_parallel`` its attention and dense
    layers split over a second group of the same ranks ("tp", the one a tensor-parallel
    model all-reduces on), else built whole on every rank (replicated, or data-parallel
    attention)."""
    group = _process_group("ep", store, rank, world_size, device, timeout_s)
    if not tensor_parallel:
        return ParallelContext(ep_rank=rank, ep_size=world_size, ep_group=group)
    tp_group = _backend(dist.PrefixStore("tp", store), rank, world_size, device, timeout_s)
    return ParallelContext(tp_rank=rank, tp_size=world_size, group=tp_group, ep_rank=rank, ep_size=world_size,
                           ep_group=group)  # fmt: skip


def expert_move_group(
    store: dist.Store, rank: int, world_size: int, device: torch.device, timeout_s: float = COLLECTIVE_TIMEOUT_S
) -> dist.ProcessGroup:
    """A second group over the same ranks for EPLB's weight moves alone: a move's
    all-to-all runs on a mover thread while the steps' collectives run on the step's
    group, and two threads must never issue collectives on one group (their order
    would differ between ranks). Only a move in flight uses it: an idle engine trips
    no timeout."""
    return _process_group("epmove", store, rank, world_size, device, timeout_s)


def _process_group(
    prefix: str, store: dist.Store, rank: int, world_size: int, device: torch.device, timeout_s: float
) -> dist.ProcessGroup:
    """A backend wrapped in a ``ProcessGroup`` (still no global registration), which has
    the ``all_to_all_single`` the dispatch and the moves run; the backend alone does not."""
    prefixed = dist.PrefixStore(prefix, store)
    backend = _backend(prefixed, rank, world_size, device, timeout_s)
    group = dist.ProcessGroup(prefixed, rank, world_size)
    kind = dist.ProcessGroup.BackendType.NCCL if device.type == "cuda" else dist.ProcessGroup.BackendType.GLOO
    group._set_default_backend(kind)
    group._register_backend(device, kind, backend)
    return group


def instance_context(
    store: dist.Store, rank: int, world_size: int, device: torch.device, expert_parallel: bool,
    tensor_parallel_attention: bool = True,
) -> ParallelContext:
    """The context every rank of an instance builds alike (rank 0 in the executor, the
    others in worker.py): tensor-parallel over all the ranks, or expert-parallel with
    (``tensor_parallel_attention``, rank.py's ``splits_attention``) or without its
    attention tensor-parallel too."""
    if not expert_parallel:
        return tensor_parallel_context(store, rank, world_size, device)
    return expert_parallel_context(store, rank, world_size, device, tensor_parallel=tensor_parallel_attention)


def _backend(
    store: dist.Store, rank: int, world_size: int, device: torch.device, timeout_s: float
) -> "dist.ProcessGroupGloo | dist.ProcessGroupNCCL":  # a string: CPU builds of torch have no NCCL class
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    gloo_options = dist.ProcessGroupGloo._Options()
    gloo_options._devices = [dist.ProcessGroupGloo.create_device(hostname=STORE_HOST)]
    gloo_options._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, world_size, gloo_options)
