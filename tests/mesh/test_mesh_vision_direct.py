"""Image embeddings by the direct path through the mesh (E/P/D under one PID namespace,
as `infermesh up` runs it: nats-server, kvcache, one vision, one prefill, one decode
instance and the balancer, real processes) on a make-model tiny-vl Qwen2.5-VL. The
vision instance writes each image's embeddings into its shared-memory ring as well as
kvcache; prefill maps the ring and copies them out (shared/stage/embedding_share.py).

The ring is sized to hold one image's embeddings, not two. Checked: a chat with one
image gives the in-process engine's tokens and logprobs with its embeddings copied
from the vision instance (prefill's image_embeddings_loaded_total{path="peer"}, the
transfer span's transfer.path); a chat with two new images, whose second overwrote the
first in the ring, gives the in-process answer too: the first is refused by the ring
(overwritten) and comes from kvcache, the second straight from the ring."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from shared.stage.embedding_share import HEADER
from tests.helpers.mesh import running_mesh
from tests.helpers.mesh_procs import span_attributes
from tests.helpers.vlm_models import synthetic_images
from tests.helpers.vl_mesh import ENV, ask, embedding_bytes, in_process, logprobs, prompt_ids
from tests.helpers.vl_mesh import embeddings_loaded as loaded
from tools.launch.up import Mesh
from tools.make_model import make_model

SIZE = (150, 100)
"""Every image's size here: the same number of embedding rows each."""


@pytest.fixture(scope="module")
def vl_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-vl-direct")
    make_model(folder, arch="qwen2_5_vl", preset="tiny-vl", seed=3)
    return folder


@pytest.fixture(scope="module")
def mesh(vl_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    entry = HEADER.size + embedding_bytes(vl_folder, SIZE)
    env = {**ENV, "INFERMESH_VISION__SHARE_BYTES": str(entry + entry // 2)}  # one entry fits, two do not
    with running_mesh(str(vl_folder), tmp_path_factory.mktemp("direct-state"), extra_env=env,
                      num_prefill=1, num_decode=1, num_vision=1) as mesh:  # fmt: skip
        yield mesh


def test_prefill_copies_embeddings_from_the_vision_instance_and_falls_back_to_kvcache_when_the_ring_lost_them(
    mesh: Mesh, vl_folder: Path
) -> None:
    (image,) = synthetic_images([SIZE], seed=9)
    body = ask(mesh, [image], "What is this?")
    tokens, expected = in_process(vl_folder, prompt_ids(body), [image])
    assert body["choices"][0]["token_ids"] == tokens
    torch.testing.assert_close(torch.tensor(logprobs(body)), torch.tensor(expected), rtol=0, atol=1e-4)
    assert (loaded(mesh, "peer"), loaded(mesh, "kvcache")) == (1, 0)
    transfer = span_attributes(mesh.trace_dir, body["id"], "transfer")
    assert transfer["transfer.path"] == "peer" and transfer["transfer.outcome"] == "hit"
    assert transfer["images.peer"] == 1

    # Two new images: the second's entry overwrote the first's in the ring before prefill read it.
    pair = synthetic_images([SIZE, SIZE], seed=31)
    body = ask(mesh, pair, "Compare them.")
    tokens, expected = in_process(vl_folder, prompt_ids(body), pair)
    assert body["choices"][0]["token_ids"] == tokens
    torch.testing.assert_close(torch.tensor(logprobs(body)), torch.tensor(expected), rtol=0, atol=1e-4)
    assert (loaded(mesh, "peer"), loaded(mesh, "kvcache")) == (2, 1)
    transfer = span_attributes(mesh.trace_dir, body["id"], "transfer")
    assert transfer["transfer.path"] == "peer+kvcache" and transfer["transfer.outcome"] == "hit"
    assert "no longer holds" in transfer["transfer.peer_refused"]
