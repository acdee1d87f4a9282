"""Image embeddings through NIXL in a running E/P/D mesh whose kvcache, vision, prefill
and decode each run in a PID namespace of their own, as containers run them
(Mesh.pid_namespaces), on a make-model tiny-vl Qwen2.5-VL. Prefill cannot map the
vision instance's shared-memory ring through /proc (the same-namespace copy refuses
it), so with vision.nixl on it READs the image's entry through NIXL: the vision
instance registered its ring with its agent and answers prefill's metadata ask over
NATS (shared/stage/embedding_nixl.py). tests/mesh/test_mesh_vision_direct.py is the
same mesh in one namespace.

The ring is sized to hold one image's embeddings, not two. Checked: a chat with one
image gives the in-process engine's tokens and logprobs with its embeddings read
through NIXL (prefill's image_embeddings_loaded_total{path="nixl"}, the transfer
span's transfer.path=nixl); a chat with two new images, whose second overwrote the
first in the ring, gives the in-process answer too: NIXL's read of the first is
refused by the ring's generation check and it comes from kvcache, the second through
NIXL."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from shared.stage.embedding_share import HEADER
from tests.helpers.mesh import running_mesh
from tests.helpers.mesh_procs import span_attributes
from tests.helpers.nixl_wheel import skip_without_nixl
from tests.helpers.vl_mesh import ENV, ask, embedding_bytes, embeddings_loaded, in_process, logprobs, prompt_ids
from tests.helpers.vlm_models import synthetic_images
from tools.launch.up import Mesh
from tools.make_model import make_model

skip_without_nixl()

SIZE = (150, 100)
"""Every image's size here: the same number of embedding rows each."""


@pytest.fixture(scope="module")
def vl_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-vl-nixl")
    make_model(folder, arch="qwen2_5_vl", preset="tiny-vl", seed=3)
    return folder


@pytest.fixture(scope="module")
def mesh(vl_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    entry = HEADER.size + embedding_bytes(vl_folder, SIZE)
    env = {**ENV, "INFERMESH_VISION__SHARE_BYTES": str(entry + entry // 2),  # one entry fits, two do not
           "INFERMESH_VISION__NIXL": "true"}  # fmt: skip
    with running_mesh(str(vl_folder), tmp_path_factory.mktemp("vision-nixl-state"), extra_env=env,
                      num_prefill=1, num_decode=1, num_vision=1, pid_namespaces=True) as mesh:  # fmt: skip
        yield mesh


def counts(mesh: Mesh) -> tuple[float, float, float]:
    return tuple(embeddings_loaded(mesh, path) for path in ("peer", "nixl", "kvcache"))


def test_prefill_reads_embeddings_through_nixl_across_pid_namespaces_and_falls_back_to_kvcache_when_the_ring_lost_them(
    mesh: Mesh, vl_folder: Path
) -> None:
    (image,) = synthetic_images([SIZE], seed=9)
    body = ask(mesh, [image], "What is this?")
    tokens, expected = in_process(vl_folder, prompt_ids(body), [image])
    assert body["choices"][0]["token_ids"] == tokens
    torch.testing.assert_close(torch.tensor(logprobs(body)), torch.tensor(expected), rtol=0, atol=1e-4)
    assert counts(mesh) == (0, 1, 0)
    transfer = span_attributes(mesh.trace_dir, body["id"], "transfer")
    assert transfer["transfer.path"] == "nixl" and transfer["transfer.outcome"] == "hit"
    assert (transfer["images.nixl"], transfer["images.peer"]) == (1, 0)
    assert "transfer.peer_refused" not in transfer

    # Two new images: the second's entry overwrote the first's in the ring before prefill read it.
    pair = synthetic_images([SIZE, SIZE], seed=31)
    body = ask(mesh, pair, "Compare them.")
    tokens, expected = in_process(vl_folder, prompt_ids(body), pair)
    assert body["choices"][0]["token_ids"] == tokens
    torch.testing.assert_close(torch.tensor(logprobs(body)), torch.tensor(expected), rtol=0, atol=1e-4)
    assert counts(mesh) == (0, 2, 1)
    transfer = span_attributes(mesh.trace_dir, body["id"], "transfer")
    assert transfer["transfer.path"] == "nixl+kvcache" and transfer["transfer.outcome"] == "hit"
    assert transfer["transfer.peer_refused"].startswith("NIXL: ") and "no longer holds" in transfer["transfer.peer_refused"]
