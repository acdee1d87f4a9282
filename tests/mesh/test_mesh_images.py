"""Images through the mesh (real processes: nats-server, kvcache, one prefill, one decode,
the balancer) on a make-model tiny-vl Qwen2.5-VL: the balancer sends each image as a
lossless PNG on the prefill request, prefill runs the processor and the tower, decode
gets the images in the handoff and encodes only an image whose rows it recomputes (none
for an image wholly in the blocks prefill handed over: its images_encoded_total stays). Checked: a chat with an
image gives the in-process engine's tokens and logprobs; two prompts that differ only in
their image share no KV past it; the same image in a later turn is a prefix hit, found by
the balancer's routing keys; the trace holds the request's spans; a photo-sized image
(~1.5 MB of PNG, past nats-server's default 1 MiB) goes through, and so does one past the
mesh's NATS max_payload (MAX_PAYLOAD: in parts; tests/mesh/test_mesh_image_parts.py has the
limit on a request's images); a decode instance SIGKILLed mid-stream lets the
request move on with its images (a mesh of two decode instances) and the tokens are still
the in-process engine's."""

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from PIL import Image

from shared.proto import mesh_pb2
from shared.runtime import subjects
from tests.helpers.image_files import noise
from tests.helpers.mesh import running_mesh
from tests.helpers.mesh_procs import span_attributes
from tests.helpers.metrics import balancer_metric as metric
from tests.helpers.metrics import sample, scrape
from tests.helpers.nats_listener import Listener
from tests.helpers.vlm_models import synthetic_images
from tests.helpers.vl_mesh import (BLOCK, ENV, NUM_NEW, cached, chat, image_part, in_process, logprobs, mesh_model,
                                  prompt_ids)
from tools.launch.nats_auth import MAX_PAYLOAD
from tools.launch.up import Mesh
from tools.make_model import make_model

@pytest.fixture(scope="module")
def vl_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-vl-mesh")
    make_model(folder, arch="qwen2_5_vl", preset="tiny-vl", seed=3)
    return folder


@pytest.fixture(scope="module")
def vl_mesh(vl_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with running_mesh(str(vl_folder), tmp_path_factory.mktemp("vl-mesh-state"), num_prefill=1, num_decode=1,
                      extra_env=ENV) as mesh:  # fmt: skip
        yield mesh


def route_held(mesh: Mesh, request_id: str) -> float:
    """The prompt blocks the balancer found on the prefill instance, by its routing keys."""
    attrs = span_attributes(mesh.trace_dir, request_id, "route")
    return float(attrs["prefill.held"][0]) if attrs["prefill.reason"] == "prefix" else 0.0


def test_a_chat_with_an_image_equals_the_in_process_engine(vl_mesh: Mesh, vl_folder: Path) -> None:
    (image,) = synthetic_images([(150, 100)], seed=9)
    messages = [{"role": "user", "content": [image_part(image), {"type": "text", "text": "What is this?"}]}]
    body = chat(vl_mesh, messages)
    prompt = prompt_ids(body)
    tokens, expected = in_process(vl_folder, prompt, [image])
    assert body["choices"][0]["token_ids"] == tokens
    # Decode computes the partial last block with the first token (other shapes than one engine's).
    torch.testing.assert_close(torch.tensor(logprobs(body)), torch.tensor(expected), rtol=0, atol=1e-4)
    rid = body["id"]
    prefill = span_attributes(vl_mesh.trace_dir, rid, "prefill")
    decode = span_attributes(vl_mesh.trace_dir, rid, "decode")
    images = span_attributes(vl_mesh.trace_dir, rid, "images")
    assert prefill["images.count"] == 1 and decode["images.count"] == 1 and images["images.count"] == 1
    assert decode["kv.loaded_blocks"] == len(prompt) // BLOCK  # the image's blocks came from prefill


def test_decode_runs_no_tower_for_an_image_whose_kv_prefill_handed_over(vl_mesh: Mesh, vl_folder: Path) -> None:
    (image,) = synthetic_images([(120, 90)], seed=51)
    text = "Describe the picture above in one careful sentence, please, naming its colours and its shapes."
    prefill_metrics, decode_metrics = (f"http://127.0.0.1:{vl_mesh.metrics_ports[f'{stage}-0']}/metrics"
                                       for stage in ("prefill", "decode"))  # fmt: skip

    def encoded(url: str, stage: str) -> float:
        return sample(scrape(url), f"infermesh_{stage}_images_encoded_total")

    time.sleep(0.5)  # earlier tests' counts reach the series at the next heartbeat (0.2 s)
    before = encoded(prefill_metrics, "prefill"), encoded(decode_metrics, "decode")
    body = chat(vl_mesh, [{"role": "user", "content": [image_part(image), {"type": "text", "text": text}]}])
    prompt = prompt_ids(body)
    pad = json.loads((vl_folder / "config.json").read_text())["image_token_id"]
    last_image_token = len(prompt) - 1 - prompt[::-1].index(pad)
    assert last_image_token < len(prompt) // BLOCK * BLOCK  # the image lies in the full blocks decode loads
    assert body["choices"][0]["token_ids"] == in_process(vl_folder, prompt, [image])[0]
    deadline = time.monotonic() + 10
    while encoded(prefill_metrics, "prefill") < before[0] + 1:
        assert time.monotonic() < deadline, "prefill's images_encoded_total did not count the image"
        time.sleep(0.1)
    time.sleep(0.5)  # a heartbeat later: decode's series would have moved too
    assert encoded(decode_metrics, "decode") == before[1]
    assert span_attributes(vl_mesh.trace_dir, body["id"], "decode")["kv.load_failed"] is False  # nothing recomputed


def test_another_image_shares_no_kv_and_the_same_image_is_a_prefix_hit(vl_mesh: Mesh, vl_folder: Path) -> None:
    first, other = synthetic_images([(120, 90)], seed=31) + synthetic_images([(120, 90)], seed=32)
    lead = "Describe the picture below in one careful sentence, please, then stop."
    content = lambda image: [{"type": "text", "text": lead}, image_part(image)]  # noqa: E731
    a = chat(vl_mesh, [{"role": "user", "content": content(first)}])
    prompt = prompt_ids(a)
    pad = json.loads((vl_folder / "config.json").read_text())["image_token_id"]
    image_start, image_end = prompt.index(pad), len(prompt) - prompt[::-1].index(pad)
    assert image_start >= BLOCK  # a whole text block before the image: shared by both
    b = chat(vl_mesh, [{"role": "user", "content": content(other)}])
    assert prompt_ids(b) == prompt  # same size: the same tokens; only the image tells them apart
    assert cached(b) == image_start // BLOCK * BLOCK  # nothing past the image's first block
    assert route_held(vl_mesh, b["id"]) == image_start // BLOCK
    assert b["choices"][0]["token_ids"] != a["choices"][0]["token_ids"] or logprobs(b) != logprobs(a)
    # A second turn with the first image: its blocks are a hit, on prefill and in the routing keys.
    turn = [{"role": "user", "content": content(first)},
            {"role": "assistant", "content": a["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And its colours?"}]  # fmt: skip
    c = chat(vl_mesh, turn)
    assert prompt_ids(c)[: len(prompt)] == prompt
    assert cached(c) >= len(prompt) // BLOCK * BLOCK >= image_end  # the whole image's blocks
    assert route_held(vl_mesh, c["id"]) >= len(prompt) // BLOCK


def test_a_photo_sized_image_crosses_the_mesh(vl_mesh: Mesh) -> None:
    # Noise does not compress: 720x720 is ~1.55 MB of PNG, a 1024x768 photo's size, past
    # nats-server's default 1 MiB and within the mesh's MAX_PAYLOAD.
    photo = Image.fromarray(noise(720, 720, seed=6))
    part = image_part(photo)
    assert len(part["image_url"]["url"]) * 3 // 4 > 1 << 20
    body = chat(vl_mesh, [{"role": "user", "content": [{"type": "text", "text": "Look:"}, part]}])
    assert len(body["choices"][0]["token_ids"]) == NUM_NEW
    assert span_attributes(vl_mesh.trace_dir, body["id"], "prefill")["images.count"] == 1


def test_an_image_past_one_mesh_message_crosses_in_parts(vl_mesh: Mesh) -> None:
    side = int((MAX_PAYLOAD / 3) ** 0.5) + 16  # 3 bytes a pixel of noise: a PNG just past MAX_PAYLOAD
    big = Image.fromarray(noise(side, side, seed=5))
    part = image_part(big)
    assert len(part["image_url"]["url"]) * 3 // 4 > MAX_PAYLOAD
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look:"}, part]}]
    body = chat(vl_mesh, messages)  # the prefill request and decode's handoff go in parts
    assert len(body["choices"][0]["token_ids"]) == NUM_NEW
    assert span_attributes(vl_mesh.trace_dir, body["id"], "prefill")["images.count"] == 1
    assert span_attributes(vl_mesh.trace_dir, body["id"], "decode")["images.count"] == 1


def test_a_decode_instance_killed_mid_stream_moves_the_request_with_its_images(
    vl_folder: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    running: dict[str, int] = {}

    def on_heartbeat(msg) -> None:  # noqa: ANN001
        hb = mesh_pb2.Heartbeat()
        hb.ParseFromString(msg.data)
        running[hb.instance_id] = hb.load.num_running

    heartbeats = Listener(subjects.heartbeats_of("decode"), on_heartbeat)
    num_new = 200
    (image,) = synthetic_images([(150, 100)], seed=41)
    messages = [{"role": "user", "content": [image_part(image), {"type": "text", "text": "Tell me a long story."}]}]
    with running_mesh(str(vl_folder), tmp_path_factory.mktemp("vl-kill-state"), num_prefill=1, num_decode=2,
                      extra_env=ENV) as mesh:  # fmt: skip
        heartbeats.start(mesh.nats_url)
        body = {"model": mesh_model(mesh), "messages": messages, "max_tokens": num_new, "temperature": 0,
                "stream": True, "return_token_ids": True, "ignore_eos": True}  # fmt: skip
        prompt: list[int] = []
        tokens: list[int] = []
        error: list[BaseException] = []

        def stream() -> None:
            try:
                with httpx.stream("POST", f"{mesh.api_url}/chat/completions", json=body, timeout=120) as response:
                    assert response.status_code == 200, response.read()
                    for line in response.iter_lines():
                        if not line.startswith("data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        assert "error" not in chunk, chunk
                        prompt.extend(chunk.get("prompt_token_ids") or [])
                        for choice in chunk["choices"]:
                            tokens.extend(choice.get("token_ids") or [])
            except BaseException as exc:  # noqa: BLE001 - reported below
                error.append(exc)

        running.clear()
        reader = threading.Thread(target=stream)
        reader.start()
        deadline = time.monotonic() + 60
        victim = None
        while victim is None:
            assert time.monotonic() < deadline and reader.is_alive(), "the stream never ran on a decode instance"
            busy = [iid for iid, n in sorted(running.items()) if n >= 1]
            victim = busy[0] if busy and len(tokens) >= 4 else None
            time.sleep(0.01)
        dict(mesh.procs)[victim].send_signal(signal.SIGKILL)
        num_before = len(tokens)
        reader.join(120)
        assert not error, error
        assert num_before < num_new // 2  # killed mid-stream, not at its end
        assert metric(mesh, "migrations_total") >= 1
    # The survivor re-encoded the image for the continuation (prompt, image and tokens so far).
    expected, _ = in_process(vl_folder, prompt, [image], num_new)
    assert tokens == expected
