"""Shared test helpers: a minimal paged-KV driver for ``CausalLM`` (no scheduler),
and the mesh of real processes the integration tests run against."""

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from shared.model.forward_batch import AttentionMetadata
from tools.make_model import make_model
from shared.model.interface import CausalLM
from shared.runtime import rpc
from tools.launch.nats_auth import new_password
from tools.launch.up import Mesh, StartFailed, free_port


class PagedDriver:
    """Runs varlen steps of a model over a paged cache. Blocks are handed out in a
    shuffled order, so a sequence's blocks are scattered and block 0 (the padding
    value of block tables) holds real data of some sequence. Every KV cache group
    of the model gets its own blocks (groups share the cache tensors)."""

    def __init__(
        self,
        model: CausalLM,
        num_seqs: int,
        num_blocks: int = 128,
        block_size: int = 4,
        seed: int = 0,
        kv_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.num_groups = len(model.kv_layout.groups)
        self.kv_caches = model.allocate_kv_cache(num_blocks, block_size, kv_dtype, "cpu")
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.blocks: list[list[list[int]]] = [[[] for _ in range(num_seqs)] for _ in range(self.num_groups)]
        self.lens = [0] * num_seqs

    def step(self, new_tokens: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Feed ``new_tokens[s]`` to sequence s (all in one forward); logits [n, vocab] per sequence."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[list[int]] = [[] for _ in range(self.num_groups)]
        starts = [0]
        seq_lens: list[int] = []
        order = list(new_tokens)
        for s in order:
            for token in new_tokens[s]:
                pos = self.lens[s]
                ids.append(token)
                positions.append(pos)
                for g, blocks in enumerate(self.blocks):
                    if pos % self.block_size == 0:
                        blocks[s].append(self.free.pop())
                    slots[g].append(blocks[s][pos // self.block_size] * self.block_size + pos % self.block_size)
                self.lens[s] += 1
            starts.append(len(ids))
            seq_lens.append(self.lens[s])
        metas = []
        for g, blocks in enumerate(self.blocks):
            width = max(len(blocks[s]) for s in order)
            tables = torch.zeros(len(order), width, dtype=torch.int64)
            for row, s in enumerate(order):
                tables[row, : len(blocks[s])] = torch.tensor(blocks[s])
            metas.append(
                AttentionMetadata(
                    slot_mapping=torch.tensor(slots[g], dtype=torch.int64),
                    block_tables=tables,
                    query_start_loc=starts,
                    seq_lens=seq_lens,
                    block_size=self.block_size,
                )
            )
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.kv_caches, metas)
        logits = self.model.compute_logits(hidden)
        return {s: logits[starts[row] : starts[row + 1]] for row, s in enumerate(order)}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b|: our tolerance metric against the reference b."""
    return ((a - b).abs().max() / b.abs().max()).item()


# -- the mesh ------------------------------------------------------------------------------


# The meshes of a test session share one gRPC token, which this process's own
# clients (KVCacheClient(mesh.kv_address) in a test) send too. A mesh makes its
# NATS users itself: tests reach its NATS as mesh.nats_url's operator (admin).
GRPC_TOKEN = new_password()
rpc.configure(GRPC_TOKEN, "127.0.0.1")


@contextmanager
def _running_mesh(model_dir: str, state_dir: Path, timeout_s: float = 240.0, **options: Any) -> Iterator[Mesh]:
    """nats-server, kvcache, prefill, decode and the balancer as real processes,
    started as `infermesh up` starts them (NATS users and gRPC token on); stopped on
    exit, also when the start fails. options: Mesh's num_prefill, num_decode, extra_env,
    supervise."""
    for attempt in (1, 2):
        mesh = Mesh(model_dir, port=free_port(), state_dir=state_dir, grpc_token=GRPC_TOKEN, **options)
        try:
            mesh.start(timeout_s=timeout_s)
            break
        except StartFailed as exc:
            mesh.stop()
            # A free port is picked, then bound by the service: another process on the
            # machine may take it in between. Once, with fresh ports, then it is a failure.
            if attempt == 2 or not any(m in str(exc) for m in ("Failed to bind", "ddress already in use")):
                raise
    try:
        yield mesh
    finally:
        mesh.stop()


@pytest.fixture(scope="session")
def mesh_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The seeded default model (made here, no download), one for every mesh of the session."""
    path = tmp_path_factory.mktemp("mesh-model")
    make_model(path)
    return str(path)


@pytest.fixture(scope="module")
def mesh(mesh_model_dir: str, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Mesh]:
    """One mesh shared by the tests of a module, shaped by the module's MESH dict
    (num_prefill, num_decode, extra_env). Its tests must leave it as they found it."""
    with _running_mesh(mesh_model_dir, tmp_path_factory.mktemp("mesh-state"), **getattr(request.module, "MESH", {})) as m:
        yield m


@pytest.fixture
def start_mesh(mesh_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Mesh]]:
    """A mesh of this test's own, for a test that breaks it: start_mesh(num_decode=2, ...)
    (Mesh's options). Stopped when the test ends."""
    with ExitStack() as stack:
        yield lambda **options: stack.enter_context(
            _running_mesh(mesh_model_dir, tmp_path_factory.mktemp("mesh-state"), **options)
        )
