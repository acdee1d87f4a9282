"""The fixtures every tier shares: real processes (a nats-server, a kvcache
process, the mesh), the tiny models tests run on, and the interpreter's place-free
dot; and the hook that marks each test with its tier (its folder). Plain helpers
live in tests/helpers/; this file is never imported as a module.

At import, this process's gRPC clients get the session's prefill token (the
meshes' GRPC_TOKEN: tests store and read blocks as a prefill instance does)."""

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from tools.make_model import make_model
from shared.runtime import rpc
from tests.helpers.hf_models import save_tiny_hf_model
from tests.helpers.kvcache_proc import KVCacheProc, serving_kvcache
from tests.helpers.mesh import GRPC_TOKEN, mesh_key, running_mesh
from tests.helpers.mesh_procs import NatsServer
from tools.launch.up import Mesh

rpc.configure(GRPC_TOKEN, "127.0.0.1")

TIERS = ("unit", "parity", "mesh", "deploy", "gpu")
"""The tier folders under tests/, each the name of its registered marker (pyproject.toml)."""


@pytest.hookimpl(tryfirst=True)  # before -m selects
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks each test with its tier, the folder it lies in: `pytest -m unit` runs the unit tier."""
    tests = Path(__file__).parent
    for item in items:
        tier = item.path.relative_to(tests).parts[0]
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: a test lies in a tier folder ({', '.join(TIERS)}), not in {tier}")
        item.add_marker(getattr(pytest.mark, tier))


# -- processes ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A plain nats-server (JetStream on, no users) of the module's own."""
    server = NatsServer(tmp_path_factory.mktemp("nats"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def kvcache(nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KVCacheProc]:
    """A kvcache process of the module's own, serving; at the end it must exit 0
    (continued first: a test may leave it stopped with SIGSTOP)."""
    with serving_kvcache(nats_server.url, tmp_path_factory.mktemp("kvcache")) as svc:
        yield svc


@pytest.fixture(scope="session")
def mesh_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The seeded default model (made here, no download), one for every mesh of the session."""
    path = tmp_path_factory.mktemp("mesh-model")
    make_model(path)
    return str(path)


@pytest.fixture(scope="session")
def shared_meshes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str, dict[str, Any]], Mesh]]:
    """The meshes that modules with MESH_SHARED = True share: one per (model folder,
    MESH), started on first use and stopped when the session ends."""
    started: dict[str, Mesh] = {}
    with ExitStack() as stack:

        def get(model_dir: str, options: dict[str, Any]) -> Mesh:
            key = mesh_key(model_dir, options)
            if key not in started:
                started[key] = stack.enter_context(
                    running_mesh(model_dir, tmp_path_factory.mktemp("shared-mesh-state"), **options)
                )
            return started[key]

        yield get


@pytest.fixture(scope="module")
def mesh(mesh_model_dir: str, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Mesh]:
    """The mesh of a module's tests, shaped by the module's MESH dict (num_prefill,
    num_decode, extra_env). Its tests must leave it as they found it. A module with
    MESH_SHARED = True gets the session's mesh of that model and MESH, shared with other
    such modules: only for modules whose assertions hold on a mesh that served others
    before (deltas, not counters from zero; prompts of their own)."""
    options = getattr(request.module, "MESH", {})
    if getattr(request.module, "MESH_SHARED", False):
        yield request.getfixturevalue("shared_meshes")(mesh_model_dir, options)
        return
    with running_mesh(mesh_model_dir, tmp_path_factory.mktemp("mesh-state"), **options) as m:
        yield m


@pytest.fixture
def start_mesh(mesh_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Mesh]]:
    """A mesh of this test's own, for a test that breaks it: start_mesh(num_decode=2, ...)
    (Mesh's options). Stopped when the test ends."""
    with ExitStack() as stack:
        yield lambda **options: stack.enter_context(
            running_mesh(mesh_model_dir, tmp_path_factory.mktemp("mesh-state"), **options)
        )


# -- models ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The module's tiny model, chosen by its TINY_MODEL: an architecture that
    save_tiny_hf_model saves with transformers ("llama", "qwen2", "qwen3", ...), or
    "made" (make_model's seeded default model) or "made-token-ids" (the same without
    its tokenizer: prompts are token ids)."""
    kind: str = request.module.TINY_MODEL
    path = tmp_path_factory.mktemp(f"model-{kind}")
    if kind == "made":
        make_model(path)
    elif kind == "made-token-ids":
        make_model(path, tokenizer=False)
    else:
        save_tiny_hf_model(kind, path)
    return str(path)


# -- the Triton interpreter -----------------------------------------------------------------


@pytest.fixture
def place_free_dot(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter's tl.dot swapped for one whose sums do not depend on an element's
    place in the tile (tests/helpers/interpreter_dot.py says why). A module asks for it with
    pytestmark = pytest.mark.usefixtures("place_free_dot"), after setting TRITON_INTERPRET."""
    from tests.helpers.interpreter_dot import use_place_free_dot

    use_place_free_dot(monkeypatch)
