"""Chat requests with image_url content parts through the balancer's HTTP front door
(in process, over a scripted generator that records what reaches it; the image
host is a real local HTTP server). A text-only model refuses images with a 400
naming the part and fetches nothing; a model that accepts images gets them loaded
onto the request the router receives; every bad image is a 400 that names its
part and says why."""

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from services.balancer.frontend.api import create_app
from services.balancer.frontend.images import ModelImages
from shared.multimodal.identity import image_hash
from shared.recipe import Recipe
from shared.runtime.settings import BalancerSettings, ImageSettings
from tests.helpers.image_files import ImageServer, Route, data_url, encode, noise, png_header_only
from tests.helpers.tool_api import Scripted
from tools.make_model import make_model

MODEL = "tiny-vl"
PROCESSOR = {"patch_size": 14, "merge_size": 2}
RED = noise(20, 10, seed=1)
BLUE = noise(8, 12, seed=2)
# A template as VL models write theirs: an image part is a placeholder in the text.
VL_TEMPLATE = (
    "{%- for message in messages -%}<|im_start|>{{ message.role }}\n"
    "{%- if message.content is string -%}{{ message.content }}{%- else -%}"
    "{%- for part in message.content -%}"
    "{%- if part.type == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>{%- else -%}{{ part.text }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}<|im_end|>\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)
VL_LIMITS = ImageSettings(fetch_private=True, max_per_request=3, max_bytes=64 << 10, fetch_timeout_s=0.5)
"""The model that accepts images: its host is the local server, on loopback."""


@dataclass
class App:
    http: TestClient
    generator: Scripted
    recipe: Recipe

    def chat(self, *content: Any, **body: Any) -> httpx.Response:
        messages = body.pop("messages", None) or [{"role": "user", "content": list(content)}]
        return self.http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, **body})


@pytest.fixture(scope="module")
def image_server() -> Iterator[ImageServer]:
    served = ImageServer()
    served.routes.update({
        "/blue.png": Route(encode(BLUE)),
        "/slow.png": Route(encode(BLUE), delay_s=2.0),
        "/huge.png": Route(encode(noise(300, 300, seed=3))),  # past VL_LIMITS.max_bytes
        "/missing.png": Route(status=404),
    })
    with served.running():
        yield served


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("image-api-model")
    make_model(base, arch="qwen2_5_vl", preset="tiny-vl")  # a tokenizer with the vision tokens
    vl = tmp_path_factory.mktemp("vl") / "model"
    shutil.copytree(base, vl)
    (vl / "chat_template.jinja").write_text(VL_TEMPLATE, encoding="utf-8")
    return vl


def _app(model_dir: Path, max_model_len: int = 1024, **kw: Any) -> Iterator[App]:
    recipe = Recipe.from_pretrained(model_dir)
    generator = Scripted(recipe)
    generator.reply = "A picture."
    app = create_app(generator=generator, recipe=recipe, model_name=MODEL, max_model_len=max_model_len,
                     settings=BalancerSettings(), **kw)
    with TestClient(app, base_url="http://balancer") as http:
        yield App(http, generator, recipe)


@pytest.fixture(scope="module")
def text_only(model_dir: Path) -> Iterator[App]:
    """The model's architecture takes no images (every architecture served today)."""
    yield from _app(model_dir)


def _vl_images(model_dir: Path) -> ModelImages:
    pad = Recipe.from_pretrained(model_dir).backend.token_to_id("<|image_pad|>")
    return ModelImages(accepts=True, processor_settings=PROCESSOR, image_token_id=pad)


@pytest.fixture(scope="module")
def vl(model_dir: Path) -> Iterator[App]:
    yield from _app(model_dir, images=VL_LIMITS, model_images=_vl_images(model_dir))


@pytest.fixture(scope="module")
def vl_default(model_dir: Path) -> Iterator[App]:
    """Accepts images, with the default image and body settings: closed to private
    addresses; a context long enough for a photo's tokens."""
    yield from _app(model_dir, max_model_len=4096, model_images=_vl_images(model_dir))


def text(words: str) -> dict[str, Any]:
    return {"type": "text", "text": words}


def image(url: str, **part: Any) -> dict[str, Any]:
    detail = part.pop("detail", None)
    return {"type": "image_url", "image_url": {"url": url, **({"detail": detail} if detail else {})}, **part}


def refused(response: httpx.Response, param: str, *words: str) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error["message"]
    return error


# -- a text-only model -----------------------------------------------------------------


def test_a_text_only_model_refuses_an_image_part_and_fetches_nothing(text_only: App, image_server: ImageServer) -> None:
    before, hits = len(text_only.generator.requests), len(image_server.hits)
    response = text_only.chat(text("What is this?"), image(image_server.url("/blue.png")))
    error = refused(response, "messages.0.content.1", f"the model `{MODEL}` does not accept images")
    assert error["code"] == "image_input_not_supported"
    later = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"},
             {"role": "user", "content": [image(data_url(encode(RED))), text("and this?")]}]
    refused(text_only.chat(messages=later), "messages.2.content.0", "does not accept images")
    tokenized = text_only.http.post("/tokenize", json={"model": MODEL, "messages": later})
    refused(tokenized, "messages.2.content.0", "does not accept images")
    assert len(text_only.generator.requests) == before and len(image_server.hits) == hits
    # Text parts alone are served as before.
    assert text_only.chat(text("Hello "), text("there")).status_code == 200


# -- a model that accepts images -------------------------------------------------------


def test_data_and_http_images_reach_the_router_loaded_and_named(vl: App, image_server: ImageServer) -> None:
    blue_url = image_server.url("/blue.png")
    messages = [
        {"role": "user", "content": [text("Compare "), image(data_url(encode(RED)), detail="low"), text(" with "),
                                     image(blue_url, uuid="blue-1", detail="high")]},
        {"role": "assistant", "content": "They differ."},
        {"role": "user", "content": [image(data_url(encode(BLUE, "WEBP", lossless=True), "image/webp")), text("?")]},
    ]
    response = vl.chat(messages=messages)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "A picture."
    request = vl.generator.requests[-1]
    red, blue, blue_webp = request.images
    assert np.array_equal(red.pixels, RED) and red.size == (20, 10) and red.detail == "low"
    assert red.source == "data:image/png;base64" and red.hash == image_hash(MODEL, PROCESSOR, RED)
    assert np.array_equal(blue.pixels, BLUE) and blue.source == blue_url and blue.detail == "high"
    assert blue.uuid == "blue-1" and blue.hash == image_hash(MODEL, PROCESSOR, BLUE, uuid="blue-1")
    assert np.array_equal(blue_webp.pixels, BLUE) and blue_webp.hash == image_hash(MODEL, PROCESSOR, BLUE)
    # Each names its part, for a refusal after loading (too large for the mesh's messages).
    assert [red.param, blue.param, blue_webp.param] == ["messages.0.content.1", "messages.0.content.3",
                                                        "messages.2.content.0"]
    # The template saw each image as a placeholder, in its place, and never its URL; each
    # placeholder is then repeated once per image token: both images (20x10 and 8x12
    # pixels) grow to the minimum area, 4x6 and 6x4 patches, 6 tokens after the 2x2 merge.
    prompt = vl.recipe.decode(request.prompt_token_ids, skip_special_tokens=False)
    slot = "<|vision_start|>" + "<|image_pad|>" * 6 + "<|vision_end|>"
    assert f"Compare {slot} with {slot}" in prompt and f"{slot}?" in prompt
    assert "base64" not in prompt and "127.0.0.1" not in prompt


def test_each_sample_of_a_request_carries_its_images(vl: App) -> None:
    response = vl.chat(text("Describe"), image(data_url(encode(RED))), n=2, temperature=1.0)
    assert response.status_code == 200, response.text
    samples = vl.generator.requests[-2:]
    assert [len(r.images) for r in samples] == [1, 1] and samples[0].images[0].hash == samples[1].images[0].hash


BAD_IMAGES = [
    ("bad base64", lambda s: "data:image/png;base64,iVBORw0K!!!", "not valid base64"),
    ("not an image", lambda s: data_url(b"<svg xmlns='http://www.w3.org/2000/svg'/>", "image/svg+xml"),
     "not an image"),
    ("truncated", lambda s: data_url(encode(noise(64, 64, seed=7))[:600]), "truncated or damaged"),
    ("too many pixels", lambda s: data_url(png_header_only(8192, 8192)), "8192x8192, 67108864 pixels, more than"),
    ("too large a download", lambda s: s.url("/huge.png"), f"more than the {64 << 10} allowed"),
    ("too large a data URL", lambda s: data_url(encode(noise(300, 300, seed=3))), f"more than the {64 << 10}"),
    ("a slow host", lambda s: s.url("/slow.png"), "was not downloaded within 0.5 s"),
    ("a missing image", lambda s: s.url("/missing.png"), "answered 404"),
    ("another scheme", lambda s: "file:///etc/passwd", "a base64 data: URL or an http(s) URL"),
]


@pytest.mark.parametrize("case, url, why", BAD_IMAGES, ids=[case for case, _, _ in BAD_IMAGES])
def test_every_bad_image_is_a_400_naming_its_part(vl: App, image_server: ImageServer, case: str, url: Any,
                                                  why: str) -> None:
    before = len(vl.generator.requests)
    response = vl.chat(text("Look: "), image(data_url(encode(RED))), image(url(image_server)))
    refused(response, "messages.0.content.2", "messages.0.content.2: ", why)
    assert len(vl.generator.requests) == before  # nothing dispatched


def test_too_many_images_are_refused_before_any_is_fetched(vl: App, image_server: ImageServer) -> None:
    hits = len(image_server.hits)
    parts = [image(image_server.url("/blue.png")) for _ in range(4)]
    messages = [{"role": "user", "content": parts[:2]}, {"role": "user", "content": [text("and "), *parts[2:]]}]
    # The fourth image, the first past the cap, is named.
    error = refused(vl.chat(messages=messages), "messages.1.content.2", "4 images, more than the 3 allowed per request")
    assert error["code"] == "too_many_images"
    assert len(image_server.hits) == hits


def test_the_default_settings_refuse_a_loopback_url(vl_default: App, image_server: ImageServer) -> None:
    hits = len(image_server.hits)
    for url in (image_server.url("/blue.png"), image_server.url("/blue.png", host="localhost")):
        error = refused(vl_default.chat(image(url), text("?")), "messages.0.content.0", "is not a public address",
                        "images.fetch_private")
        assert error["code"] == "image_url_refused"
    assert len(image_server.hits) == hits


def test_the_default_body_limit_admits_an_image_of_images_max_bytes_inline(vl_default: App) -> None:
    photo = noise(1300, 1300, seed=7)  # noise does not compress: ~5 MB of PNG, ~6.8 MB as a data: URL
    response = vl_default.chat(image(data_url(encode(photo))), text("?"))
    assert response.status_code == 200, response.text  # the old 4 MiB body limit answered 413
    assert np.array_equal(vl_default.generator.requests[-1].images[0].pixels, photo)
    # The largest image images.max_bytes lets through fits the body as a data: URL, with the conversation.
    inline = len(data_url(b"\0" * ImageSettings().max_bytes))
    assert inline + (1 << 20) <= BalancerSettings().max_request_bytes


@pytest.mark.parametrize("part, param, why", [
    ({"type": "image_url", "image_url": {"url": "data:,", "detail": "max"}}, "messages.0.content.0.image_url.detail",
     "'auto', 'low' or 'high'"),
    ({"type": "image_url", "uuid": "sku-1"}, "messages.0.content.0.image_url", "a uuid alone names no image"),
    ({"type": "image_url", "image_url": {"url": ""}}, "messages.0.content.0.image_url.url", "at least 1 character"),
    ({"type": "image_url", "image_url": {"url": "data:,", "format": "png"}}, "messages.0.content.0.image_url.format",
     "not supported"),
    ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "messages.0.content.0",
     "does not match any of the expected tags: 'text', 'image_url'"),
    ({"type": "image_url", "image_url": {"url": "data:,"}, "uuid": "x" * 257}, "messages.0.content.0.uuid",
     "at most 256 characters"),
])
def test_malformed_image_parts_name_the_field(vl: App, part: dict[str, Any], param: str, why: str) -> None:
    refused(vl.chat(part), param, why)


def test_placeholders_that_disagree_with_the_images_are_a_400(vl: App) -> None:
    """Text spelling the placeholder adds one the images do not fill: refused, not guessed."""
    response = vl.chat(text("Look <|vision_start|><|image_pad|><|vision_end|> at "), image(data_url(encode(RED))))
    refused(response, "messages", "2 image placeholder(s) for 1 image(s)")


def test_tokenize_counts_each_image_at_its_tokens_as_chat_prompts_it(vl: App, image_server: ImageServer) -> None:
    """/tokenize's count of a conversation with images is the chat's usage.prompt_tokens:
    each image's placeholder repeated once per merged patch (20x10 and 8x12 pixels grow to
    the minimum area: 6 tokens each; a 64x64 noise image is 4x4 patches: 4 tokens)."""
    messages = [{"role": "user", "content": [text("Compare "), image(data_url(encode(RED))), text(" with "),
                                             image(image_server.url("/blue.png"))]},
                {"role": "assistant", "content": "They differ."},
                {"role": "user", "content": [image(data_url(encode(noise(64, 64, seed=8)))), text("?")]}]  # fmt: skip
    chat = vl.chat(messages=messages)
    assert chat.status_code == 200, chat.text
    prompt = vl.generator.requests[-1].prompt_token_ids
    tokenized = vl.http.post("/tokenize", json={"model": MODEL, "messages": messages})
    assert tokenized.status_code == 200, tokenized.text
    body = tokenized.json()
    assert body["tokens"] == list(prompt)
    assert body["count"] == chat.json()["usage"]["prompt_tokens"] == len(prompt)
    pad = vl.recipe.backend.token_to_id("<|image_pad|>")
    assert body["tokens"].count(pad) == 6 + 6 + 4
    # A bad image is /tokenize's 400 as it is chat's.
    bad = [{"role": "user", "content": [image("data:image/png;base64,iVBORw0K!!!")]}]
    refused(vl.http.post("/tokenize", json={"model": MODEL, "messages": bad}), "messages.0.content.0",
            "not valid base64")
