"""The vision stage through the mesh (E/P/D) on a make-model tiny Qwen3-VL, whose tower
also hands the language model its deepstack features (the vision tower's intermediate
layers, added to the first decoder layers' hidden states): the vision instance encodes,
prefill and decode fetch the embeddings (deepstack included) from kvcache, and the
chat gives the in-process engine's tokens and logprobs. A repeat of the image is a
hit in the vision instance's cache and the same reply."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers.mesh import running_mesh
from tests.helpers.mesh_procs import span_attributes
from tests.helpers.vl_mesh import ENV, ask, in_process, logprobs, prompt_ids
from tests.helpers.vlm_models import synthetic_images
from tools.launch.up import Mesh
from tools.make_model import make_model


@pytest.fixture(scope="module")
def vl_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-qwen3-vl-epd")
    make_model(folder, arch="qwen3_vl", preset="tiny-qwen3-vl", seed=4)
    return folder


@pytest.fixture(scope="module")
def mesh(vl_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with running_mesh(str(vl_folder), tmp_path_factory.mktemp("qwen3-epd-state"), extra_env=ENV,
                      num_prefill=1, num_decode=1, num_vision=1) as mesh:  # fmt: skip
        yield mesh


def test_qwen3_vl_epd_equals_the_in_process_engine(mesh: Mesh, vl_folder: Path) -> None:
    images = synthetic_images([(150, 100), (96, 128)], seed=11)
    for image in images:
        body = ask(mesh, [image], "What is this?")
        tokens, expected = in_process(vl_folder, prompt_ids(body), [image])
        assert body["choices"][0]["token_ids"] == tokens
        torch.testing.assert_close(torch.tensor(logprobs(body)), torch.tensor(expected), rtol=0, atol=1e-4)
        # Encoded by the vision instance, its embeddings (deepstack too) fetched, not recomputed by prefill.
        encode = span_attributes(mesh.trace_dir, body["id"], "encode")
        assert encode["images.encoded"] == 1
        transfer = span_attributes(mesh.trace_dir, body["id"], "transfer")
        assert transfer["transfer.outcome"] == "hit" and transfer["transfer.bytes"] > 0
    again = ask(mesh, [images[0]], "What is this?")
    assert span_attributes(mesh.trace_dir, again["id"], "encode")["images.cache_hits"] == 1
