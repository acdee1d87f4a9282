"""Images past one NATS message (issue 32, point 2): on a nats-server left at its
default 1 MiB max_payload, a request's images go over the bus in parts (the Bus,
shared/runtime/bus_parts.py) on every hop that carries them (balancer -> vision,
balancer -> prefill, prefill -> decode's handoff), and the limit is the mesh's bound
on a request's images (services/balancer/router/wire.py MAX_REQUEST_BYTES), not
max_payload. Real processes (E/P/D: nats-server, kvcache, one vision, one prefill,
one decode instance and the balancer) on a make-model tiny-vl Qwen2.5-VL.

Checked: a chat with three noise images, ~1.2 MB of PNG in all, gives the in-process
engine's tokens and logprobs, encoded by the vision instance (all three images) with
the embeddings fetched by prefill and all three images in decode's handoff; four
images past the bound (~69 MB of PNG, fetched from a local image host) are a 400
naming the image and the limit."""

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from PIL import Image

from services.balancer.router.wire import MAX_REQUEST_BYTES
from tests.helpers.image_files import ImageServer, Route, encode, noise
from tests.helpers.mesh import running_mesh
from tests.helpers.mesh_procs import span_attributes
from tests.helpers.metrics import balancer_metric
from tests.helpers.vl_mesh import ENV, chat, image_part, in_process, logprobs, mesh_model, prompt_ids
from tools.launch.up import Mesh
from tools.make_model import make_model

NATS_DEFAULT_MAX_PAYLOAD = 1 << 20


@pytest.fixture(scope="module")
def vl_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-vl-parts")
    make_model(folder, arch="qwen2_5_vl", preset="tiny-vl", seed=3)
    return folder


@pytest.fixture(scope="module")
def mesh(vl_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    env = {**ENV, "INFERMESH_IMAGES__FETCH_PRIVATE": "true"}  # the local image host below
    with running_mesh(str(vl_folder), tmp_path_factory.mktemp("parts-state"), num_prefill=1, num_decode=1,
                      num_vision=1, nats_max_payload=None, extra_env=env) as mesh:  # fmt: skip
        assert "max_payload" not in mesh.nats_config.read_text()  # nats-server's default 1 MiB
        yield mesh


def test_images_past_one_nats_message_go_through_vision_prefill_and_decode(mesh: Mesh, vl_folder: Path) -> None:
    # Noise does not compress: 360x360 is ~390 KB of PNG, the three together past 1 MiB
    # on every hop (the balancer's lossless PNGs are the same pixels).
    images = [Image.fromarray(noise(360, 360, seed)) for seed in (11, 12, 13)]
    parts = [image_part(image) for image in images]
    assert sum(len(encode(noise(360, 360, seed))) for seed in (11, 12, 13)) > NATS_DEFAULT_MAX_PAYLOAD
    body = chat(mesh, [{"role": "user", "content": [*parts, {"type": "text", "text": "Compare them."}]}])
    tokens, expected = in_process(vl_folder, prompt_ids(body), images)
    assert body["choices"][0]["token_ids"] == tokens
    torch.testing.assert_close(torch.tensor(logprobs(body)), torch.tensor(expected), rtol=0, atol=1e-4)
    # Through the vision instance (all three encoded there), prefill fetched the embeddings,
    # and decode's handoff (in parts too) held the three images.
    assert balancer_metric(mesh, "vision_encodes_total", site="vision") == 1
    rid, trace_dir = body["id"], mesh.trace_dir
    assert span_attributes(trace_dir, rid, "encode")["images.encoded"] == 3
    assert span_attributes(trace_dir, rid, "transfer")["transfer.outcome"] == "hit"
    assert span_attributes(trace_dir, rid, "prefill")["images.count"] == 3
    assert span_attributes(trace_dir, rid, "decode")["images.count"] == 3


def test_images_past_the_mesh_bound_are_a_400_naming_it(mesh: Mesh) -> None:
    # 2400x2400 noise is ~17.3 MB of PNG (within images.max_bytes, 20 MiB); four of them
    # pass MAX_REQUEST_BYTES (64 MiB). Fetched by URL: inline they would pass the body's 50 MiB.
    png = encode(noise(2400, 2400, seed=21))
    assert 4 * len(png) > MAX_REQUEST_BYTES > 3 * len(png)
    server = ImageServer()
    server.routes["/big.png"] = Route(png, headers={"Content-Type": "image/png"})
    content = [{"type": "text", "text": "Look:"}]
    content += [{"type": "image_url", "image_url": {"url": server.url(f"/big.png?k={k}")}} for k in range(4)]
    request = {"model": mesh_model(mesh), "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    with server.running():
        response = httpx.post(f"{mesh.api_url}/chat/completions", json=request, timeout=300)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "messages.0.content.4", error
    assert f"limit of {MAX_REQUEST_BYTES} bytes" in error["message"] and "lossless PNG" in error["message"], error
    assert len(server.hits) == 4
