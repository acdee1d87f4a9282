"""What the vision-language mesh tests share (tests/mesh/test_mesh_images.py and
test_mesh_vision.py): the block size their meshes run with, chat requests with images
as PNG data: URLs, the fields read back from a response, and the in-process engine's
tokens and logprobs for the same prompt ids and images (the reference they are held to);
for the E/P/D tests of the vision instance's arena (test_mesh_vision_direct.py,
test_mesh_vision_nixl.py), one image's embedding bytes and prefill's count of images
loaded by path."""

import io
import json
import math
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from shared.engine.engine_request import RequestImages
from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from shared.model.vision.processor import ImageProcessor
from tests.helpers.image_files import data_url
from tests.helpers.metrics import scrape
from tests.helpers.vlm_models import synthetic_images
from tools.launch.up import Mesh

BLOCK = 16
NUM_NEW = 6
ENV = {"INFERMESH_ENGINE__BLOCK_SIZE": str(BLOCK), "INFERMESH_WORKER__HEARTBEAT_INTERVAL_S": "0.2"}


def _png(image: Any) -> str:
    out = io.BytesIO()
    image.save(out, "PNG")
    return data_url(out.getvalue())


def image_part(image: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": _png(image)}}


def chat(mesh: Mesh, messages: list[dict[str, Any]], status: int = 200) -> dict[str, Any]:
    body = {"model": mesh_model(mesh), "messages": messages, "max_tokens": NUM_NEW, "temperature": 0,
            "logprobs": True, "return_token_ids": True, "ignore_eos": True}  # fmt: skip
    response = httpx.post(f"{mesh.api_url}/chat/completions", json=body, timeout=120)
    assert response.status_code == status, response.text
    return response.json()


def mesh_model(mesh: Mesh) -> str:
    return httpx.get(f"{mesh.api_url}/models", timeout=10).json()["data"][0]["id"]


def prompt_ids(body: dict[str, Any]) -> list[int]:
    return body.get("prompt_token_ids") or body["choices"][0]["prompt_token_ids"]


def logprobs(body: dict[str, Any]) -> list[float]:
    return [entry["logprob"] for entry in body["choices"][0]["logprobs"]["content"]]


def cached(body: dict[str, Any]) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def in_process(
    folder: Path, prompt: list[int], images: list[Any], num_new: int = NUM_NEW
) -> tuple[list[int], list[float]]:
    """The in-process engine on the same prompt ids and images (the model's processor)."""
    llm = LLM(str(folder), block_size=BLOCK, enable_prefix_caching=False)
    inputs = ImageProcessor(folder)([np.asarray(image) for image in images])
    hashes = tuple(bytes([k + 1]) * 32 for k in range(len(images)))
    params = SamplingParams(max_tokens=num_new, temperature=0.0, logprobs=0, ignore_eos=True)
    out = llm.generate([prompt], params, images=[RequestImages(inputs, hashes)])[0]
    return out.token_ids, [lp.logprob for lp in out.logprobs]


def embedding_bytes(folder: Path, size: tuple[int, int]) -> int:
    """One image's embeddings in bytes, for an image of `size` (float32: the model's dtype here)."""
    vision = json.loads((folder / "config.json").read_text())["vision_config"]
    assert vision["dtype"] == "float32"
    (grid,) = ImageProcessor(folder)([np.asarray(synthetic_images([size], seed=1)[0])]).grids
    return math.prod(grid) // vision["spatial_merge_size"] ** 2 * vision["out_hidden_size"] * 4


def embeddings_loaded(mesh: Mesh, path: str) -> float:
    """prefill-0's image_embeddings_loaded_total{path}."""
    samples = scrape(f"http://127.0.0.1:{mesh.metrics_ports['prefill-0']}/metrics")
    found = [v for (n, ls), v in samples.items()
             if n == "infermesh_prefill_image_embeddings_loaded_total" and ("path", path) in ls]  # fmt: skip
    return sum(found)


def ask(mesh: Mesh, images: list[Any], text: str) -> dict[str, Any]:
    """A chat with these images, then the text."""
    content = [image_part(image) for image in images] + [{"type": "text", "text": text}]
    return chat(mesh, [{"role": "user", "content": content}])
