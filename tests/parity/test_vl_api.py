"""/v1/chat/completions with images through the in-process server (LocalGenerator over
a make-model tiny-vl folder, uvicorn on a free port): the front door decodes the
images, expands each placeholder to the image's token count, the local generator runs
the model's image processor and the engine the tower; the reply's tokens and
logprobs are transformers' generate on the same conversation (its chat template, its
processor), and the same images again hit the prefix cache."""

import asyncio
import io
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from services.balancer.frontend.api import create_app
from services.balancer.frontend.images import ModelImages
from services.balancer.local import LocalGenerator
from shared.engine.config import EngineConfig
from shared.recipe import Recipe
from shared.runtime.settings import BalancerSettings
from tests.helpers.image_files import data_url
from tests.helpers.uvicorn_app import Served, serve
from tests.helpers.vlm_models import folder_chat_prompt, hf_vl_model, synthetic_images

transformers = pytest.importorskip("transformers")

MODEL = "tiny-vl"
NUM_NEW = 6
LOGPROB_TOLERANCE = 1e-4


@dataclass
class Server:
    folder: Path
    served: Served
    recipe: Recipe
    hf: Any

    def chat(self, content: list[dict[str, Any]]) -> dict[str, Any]:
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": NUM_NEW,
                "temperature": 0, "logprobs": True}  # fmt: skip
        response = httpx.post(f"{self.served.url}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from tools.make_model import make_model

    folder = tmp_path_factory.mktemp("tiny_vl_api")
    make_model(folder, arch="qwen2_5_vl", preset="tiny-vl", seed=3)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="vl-api-loop", daemon=True)
    thread.start()
    config = EngineConfig(model=str(folder), block_size=8, num_kv_blocks=128, max_model_len=1024)
    generator = asyncio.run_coroutine_threadsafe(_start(config, loop), loop).result(120)
    recipe = Recipe.from_pretrained(folder)
    image_token = json.loads((folder / "config.json").read_text())["image_token_id"]
    processor = json.loads((folder / "preprocessor_config.json").read_text())
    app = create_app(generator=generator, recipe=recipe, model_name=MODEL, max_model_len=1024,
                     settings=BalancerSettings(), model_images=ModelImages(True, processor, image_token))  # fmt: skip
    served = serve(loop, app)
    yield Server(folder, served, recipe, hf_vl_model(folder))
    served.stop()
    asyncio.run_coroutine_threadsafe(generator.shutdown(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


async def _start(config: EngineConfig, loop: asyncio.AbstractEventLoop) -> LocalGenerator:
    return LocalGenerator.start(config, loop)


def _png(image: Any) -> str:
    out = io.BytesIO()
    image.save(out, "PNG")
    return data_url(out.getvalue())


def _reference(server: Server, template_content: list[dict[str, Any]], images: list[Any]) -> tuple[int, list[int], list[float]]:
    """transformers on the conversation: prompt length, greedy tokens, their logprobs."""
    prompt = folder_chat_prompt(server.folder, [{"role": "user", "content": template_content}], images)
    image_token = server.hf.config.image_token_id
    ids = torch.tensor([prompt.token_ids])
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=prompt.pixel_values,
                  image_grid_thw=prompt.image_grid_thw, mm_token_type_ids=(ids == image_token).to(torch.int32))  # fmt: skip
    with torch.no_grad():
        greedy = server.hf.generate(**inputs, max_new_tokens=NUM_NEW, do_sample=False)[0, ids.shape[1] :].tolist()
        full = torch.tensor([prompt.token_ids + greedy])
        inputs.update(input_ids=full, attention_mask=torch.ones_like(full),
                      mm_token_type_ids=(full == image_token).to(torch.int32))  # fmt: skip
        logprobs = torch.log_softmax(server.hf(**inputs).logits[0].float(), dim=-1)
    n = len(prompt.token_ids)
    return n, greedy, [float(logprobs[n - 1 + i, t]) for i, t in enumerate(greedy)]


def test_chat_with_images_equals_transformers(server: Server) -> None:
    images = synthetic_images([(150, 100), (70, 90)], seed=9)
    api_content = [{"type": "image_url", "image_url": {"url": _png(images[0])}},
                   {"type": "text", "text": "Compare these two pictures:"},
                   {"type": "image_url", "image_url": {"url": _png(images[1])}}]  # fmt: skip
    template_content = [{"type": "image"}, {"type": "text", "text": "Compare these two pictures:"}, {"type": "image"}]
    n, greedy, chosen = _reference(server, template_content, images)
    body = server.chat(api_content)
    assert body["usage"]["prompt_tokens"] == n  # the placeholders expanded as the processor's grids say
    assert body["usage"]["completion_tokens"] == len(greedy)
    assert body["choices"][0]["message"]["content"] == server.recipe.decode(greedy)
    got = [entry["logprob"] for entry in body["choices"][0]["logprobs"]["content"]]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(chosen), rtol=0, atol=LOGPROB_TOLERANCE)
    # The same images again: a prefix hit past them (their names are in the block hashes).
    again = server.chat(api_content)
    assert again["choices"][0]["message"]["content"] == body["choices"][0]["message"]["content"]
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (n - 1) // 8 * 8


def test_another_image_of_the_same_size_is_its_own(server: Server) -> None:
    """Same size, so the same prompt tokens: only the image's name tells the prefix apart,
    and the reply is transformers' for this image."""
    first, other = synthetic_images([(150, 100)], seed=21) + synthetic_images([(150, 100)], seed=22)
    content = lambda image: [{"type": "text", "text": "What is in"}, {"type": "image_url", "image_url": {"url": _png(image)}}]  # noqa: E731
    server.chat(content(first))
    n, greedy, chosen = _reference(server, [{"type": "text", "text": "What is in"}, {"type": "image"}], [other])
    body = server.chat(content(other))
    assert body["choices"][0]["message"]["content"] == server.recipe.decode(greedy)
    got = [entry["logprob"] for entry in body["choices"][0]["logprobs"]["content"]]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(chosen), rtol=0, atol=LOGPROB_TOLERANCE)
    prompt = folder_chat_prompt(server.folder, [{"role": "user", "content": [{"type": "text", "text": "What is in"},
                                                                           {"type": "image"}]}], [other])  # fmt: skip
    assert len(prompt.token_ids) == n
    image_start = prompt.token_ids.index(server.hf.config.image_token_id)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == image_start // 8 * 8
