"""The vision stage through the mesh (E/P/D; real processes: nats-server, kvcache, one
vision, one prefill, one decode instance and the balancer) on a make-model tiny-vl
Qwen2.5-VL. The vision instance encodes a request's images and stores the embeddings
in kvcache; prefill and decode fetch them there by the images' identities instead of
running the tower. Checked: a chat with an image gives the in-process engine's tokens
and logprobs, and its trace holds encode, transfer, prefill and decode spans; the same
image again is a hit in the vision instance's cache (no encode); a mesh restarted on
the same kvcache folder serves the image from kvcache without encoding it; a vision
instance SIGKILLed while it holds a request's images lets the request complete
(prefill encodes them) with the same tokens."""

import re
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from shared.proto import mesh_pb2
from shared.runtime import subjects
from tests.helpers.mesh import running_mesh
from tests.helpers.mesh_procs import span_attributes
from tests.helpers.metrics import balancer_metric
from tests.helpers.nats_listener import Listener
from tests.helpers.vlm_models import synthetic_images
from tests.helpers.vl_mesh import ENV, chat, image_part, in_process, logprobs, prompt_ids
from tools.launch.up import Mesh
from tools.make_model import make_model

EPD = {"num_prefill": 1, "num_decode": 1, "num_vision": 1}


@pytest.fixture(scope="module")
def vl_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-vl-epd")
    make_model(folder, arch="qwen2_5_vl", preset="tiny-vl", seed=3)
    return folder


@pytest.fixture(scope="module")
def epd_mesh(vl_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with running_mesh(str(vl_folder), tmp_path_factory.mktemp("epd-state"), extra_env=ENV, **EPD) as mesh:
        yield mesh


def vision_metric(mesh: Mesh, name: str, **labels: str) -> float:
    """The sum of vision-0's series infermesh_vision_<name> with these labels (0 when none)."""
    port = mesh.metrics_ports["vision-0"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    want = "".join(f'(?=[^}}]*{k}="{re.escape(v)}")' for k, v in labels.items())
    return sum(float(m.group(1)) for m in re.finditer(
        rf"^infermesh_vision_{name}(?:\{{{want}[^}}]*\}})? ([0-9.e+]+)$", text, re.M))  # fmt: skip


def ask(mesh: Mesh, image: Any, text: str) -> dict[str, Any]:
    return chat(mesh, [{"role": "user", "content": [image_part(image), {"type": "text", "text": text}]}])


def test_epd_equals_the_in_process_engine_traces_each_stage_and_a_repeat_is_a_cache_hit(
    epd_mesh: Mesh, vl_folder: Path
) -> None:
    (image,) = synthetic_images([(150, 100)], seed=9)
    body = ask(epd_mesh, image, "What is this?")
    tokens, expected = in_process(vl_folder, prompt_ids(body), [image])
    assert body["choices"][0]["token_ids"] == tokens
    torch.testing.assert_close(torch.tensor(logprobs(body)), torch.tensor(expected), rtol=0, atol=1e-4)
    assert vision_metric(epd_mesh, "images_encoded_total") == 1
    assert balancer_metric(epd_mesh, "vision_encodes_total", site="vision") == 1
    # One trace: the vision instance's encode, the embeddings' transfer from kvcache, prefill, decode.
    rid, trace_dir = body["id"], epd_mesh.trace_dir
    encode = span_attributes(trace_dir, rid, "encode")
    assert encode["images.encoded"] == 1 and encode["images.cache_hits"] == 0
    transfer = span_attributes(trace_dir, rid, "transfer")
    assert transfer["transfer.outcome"] == "hit" and transfer["transfer.bytes"] > 0
    assert span_attributes(trace_dir, rid, "prefill")["images.count"] == 1
    assert span_attributes(trace_dir, rid, "decode")["images.count"] == 1
    assert span_attributes(trace_dir, rid, "vision")["vision.site"] == "vision"

    # The same image in another request: the vision instance's cache, no encode; same answer to the same prompt.
    again = ask(epd_mesh, image, "What is this?")
    assert again["choices"][0]["token_ids"] == tokens
    assert vision_metric(epd_mesh, "images_encoded_total") == 1
    assert vision_metric(epd_mesh, "cache_lookups_total", result="memory") == 1
    assert span_attributes(trace_dir, again["id"], "encode")["images.cache_hits"] == 1
    # The balancer routed by affinity: the instance's heartbeat names the image.
    assert span_attributes(trace_dir, again["id"], "vision")["vision.reason"] == "cache_affinity"


def test_a_restarted_mesh_serves_an_image_from_kvcache_and_a_killed_vision_instance_loses_no_request(
    vl_folder: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    state = tmp_path_factory.mktemp("epd-restart-state")
    (image,) = synthetic_images([(120, 90)], seed=17)
    with running_mesh(str(vl_folder), state, extra_env=ENV, **EPD) as mesh:
        first = ask(mesh, image, "Describe it.")
        assert vision_metric(mesh, "images_encoded_total") == 1
    # The same kvcache folder; every process new (the vision instance's memory is empty). Its
    # batches wait 4 s for company, so that the kill below finds an image in its queue.
    slow = {**ENV, "INFERMESH_VISION__BATCH_WAIT_S": "4"}
    with running_mesh(str(vl_folder), state, extra_env=slow, **EPD) as mesh:
        again = ask(mesh, image, "Describe it.")
        assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
        assert vision_metric(mesh, "images_encoded_total") == 0
        assert vision_metric(mesh, "cache_lookups_total", result="kvcache") == 1
        assert span_attributes(mesh.trace_dir, again["id"], "transfer")["transfer.outcome"] == "hit"

        # A new image; the vision instance is killed while the image waits in its queue.
        waiting: list[int] = []

        def on_heartbeat(msg) -> None:  # noqa: ANN001
            hb = mesh_pb2.Heartbeat()
            hb.ParseFromString(msg.data)
            waiting.append(hb.load.num_waiting + hb.load.num_running)

        listener = Listener(subjects.heartbeats_of("vision"), on_heartbeat)
        listener.start(mesh.nats_url)
        (other,) = synthetic_images([(150, 100)], seed=23)
        answers: list[dict[str, Any]] = []
        started = time.monotonic()
        client = threading.Thread(target=lambda: answers.append(ask(mesh, other, "And this one?")))
        client.start()
        while not (waiting and waiting[-1] >= 1):
            assert time.monotonic() - started < 30 and client.is_alive(), "the image never waited on the vision instance"
            time.sleep(0.02)
        dict(mesh.procs)["vision-0"].send_signal(signal.SIGKILL)
        client.join(120)
        assert answers, "the request did not complete"
        # Moved within seconds: not the vision timeout (30 s), the kill's advisory.
        assert time.monotonic() - started < 20
        assert balancer_metric(mesh, "vision_failures_total", cause="left_mesh") == 1
        assert balancer_metric(mesh, "vision_encodes_total", site="prefill") == 1
        body = answers[0]
    tokens, _ = in_process(vl_folder, prompt_ids(body), [other])
    assert body["choices"][0]["token_ids"] == tokens
