"""A request's images loaded (shared/multimodal/loader.py) from real image files:
base64 data: URLs, and http URLs from a real local server. Every way an image can
be bad is refused with the reason and the request field it came from; the default
settings never reach a loopback address."""

import asyncio
import io
import time
from collections.abc import Iterator

import numpy as np
import pytest
from PIL import Image

from shared.multimodal import address
from shared.multimodal.errors import (
    BadBase64,
    FetchFailed,
    FetchTimeout,
    ImageError,
    ImageTooLarge,
    NotAnImage,
    RefusedAddress,
    TooManyImages,
    TooManyPixels,
    TruncatedImage,
    UnsupportedURL,
)
from shared.multimodal.identity import image_hash
from shared.multimodal.image import ImageRef
from shared.multimodal.loader import ImageLoader
from shared.runtime.settings import ImageSettings
from tests.helpers.image_files import ImageServer, Route, data_url, encode, noise, png_header_only

MODEL = "vl-test"
PROCESSOR = {"patch_size": 14}
PARAM = "messages.0.content.1"
PIXELS = noise(24, 16, seed=3)
PNG = encode(PIXELS)


def loader(**settings: object) -> ImageLoader:
    return ImageLoader(ImageSettings(**settings), MODEL, PROCESSOR)  # type: ignore[arg-type]


LOCAL = {"fetch_private": True}
"""The local server is on loopback: only a loader allowed private addresses reaches it."""


async def refused(image_loader: ImageLoader, url: str, kind: type[ImageError], match: str) -> ImageError:
    with pytest.raises(kind) as caught:
        await image_loader.load([ImageRef(url, PARAM)])
    assert caught.value.param == PARAM
    assert match in caught.value.message, caught.value.message
    return caught.value


@pytest.fixture(scope="module")
def server() -> Iterator[ImageServer]:
    served = ImageServer()
    served.routes.update({
        "/image.png": Route(PNG, headers={"Content-Type": "image/png"}),
        "/hop": Route(status=302, headers={"Location": "/image.png"}),
        "/loop": Route(status=302, headers={"Location": "/loop"}),
        "/missing.png": Route(status=404),
        "/slow.png": Route(PNG, delay_s=10.0),  # far past any timeout below: giving up early shows
        "/lazy.png": Route(PNG, delay_s=0.6),
        "/big.png": Route(PNG),
        "/streamed.png": Route(PNG, declare_length=False),
        "/text": Route(b"<html>no image here</html>", headers={"Content-Type": "text/html"}),
    })
    with served.running():
        yield served


# -- what loads ------------------------------------------------------------------------


async def test_a_data_url_loads_as_rgb_pixels_with_its_identity() -> None:
    [image] = await loader().load([ImageRef(data_url(PNG), PARAM, detail="high")])
    assert image.pixels.dtype == np.uint8 and image.pixels.shape == (16, 24, 3)
    assert np.array_equal(image.pixels, PIXELS) and not image.pixels.flags.writeable
    assert image.size == (24, 16)
    assert image.source == "data:image/png;base64"  # never the payload
    assert image.hash == image_hash(MODEL, PROCESSOR, PIXELS)
    assert image.detail == "high" and image.uuid is None


async def test_a_transparent_image_is_laid_over_white() -> None:
    rgba = np.zeros((2, 2, 4), dtype=np.uint8)
    rgba[0, 0] = (200, 10, 10, 255)  # opaque red; the rest fully transparent black
    [image] = await loader().load([ImageRef(data_url(encode(rgba)), PARAM)])
    assert image.pixels[0, 0].tolist() == [200, 10, 10]
    assert image.pixels[1, 1].tolist() == [255, 255, 255]


async def test_a_clients_uuid_is_the_identity() -> None:
    [image] = await loader().load([ImageRef(data_url(PNG), PARAM, uuid="sku-1")])
    assert image.uuid == "sku-1" and image.hash == image_hash(MODEL, PROCESSOR, PIXELS, uuid="sku-1")


async def test_an_http_url_loads_from_a_local_server(server: ImageServer) -> None:
    url = server.url("/image.png")
    [image] = await loader(**LOCAL).load([ImageRef(url, PARAM)])
    assert np.array_equal(image.pixels, PIXELS) and image.source == url
    assert image.hash == image_hash(MODEL, PROCESSOR, PIXELS)  # as from a data: URL: the pixels name it


async def test_a_streamed_body_without_length_loads(server: ImageServer) -> None:
    [image] = await loader(**LOCAL).load([ImageRef(server.url("/streamed.png"), PARAM)])
    assert np.array_equal(image.pixels, PIXELS)


async def test_redirects_are_followed_up_to_the_limit(server: ImageServer) -> None:
    [image] = await loader(**LOCAL).load([ImageRef(server.url("/hop"), PARAM)])
    assert np.array_equal(image.pixels, PIXELS)
    await refused(loader(**LOCAL, max_redirects=0), server.url("/hop"), FetchFailed, "redirected more than 0 times")
    await refused(loader(**LOCAL), server.url("/loop"), FetchFailed, "redirected more than 3 times")


async def test_a_requests_images_load_concurrently_in_order(server: ImageServer) -> None:
    other = noise(5, 7, seed=9)
    refs = [ImageRef(server.url("/lazy.png"), f"messages.0.content.{i}") for i in range(4)]
    refs.insert(2, ImageRef(data_url(encode(other)), "messages.1.content.0"))
    images = await loader(**LOCAL).load(refs)
    # Concurrent: downloads overlapped inside the server's 0.6 s delay (one at a time would
    # never exceed 1). Counted by the server, not timed: a loaded machine cannot fail it.
    assert server.max_in_flight >= 2, "4 downloads of 0.6 s each, one at a time: not concurrent"
    assert [image.size for image in images] == [(24, 16), (24, 16), (5, 7), (24, 16), (24, 16)]


# -- closed by default -----------------------------------------------------------------


async def test_the_default_settings_refuse_loopback_and_never_connect(server: ImageServer) -> None:
    before = len(server.hits)
    default = loader()
    await refused(default, server.url("/image.png"), RefusedAddress, "127.0.0.1 is not a public address")
    await refused(default, server.url("/image.png", host="localhost"), RefusedAddress, "is not a public address")
    await refused(default, f"http://[::1]:{server.port}/image.png", RefusedAddress, "::1 is not a public address")
    await refused(default, "http://169.254.169.254/latest/meta-data/", RefusedAddress, "not a public address")
    await refused(default, "http://10.1.2.3/image.png", RefusedAddress, "not a public address")
    assert len(server.hits) == before  # not one request reached the server


async def test_a_redirect_to_a_private_address_is_refused(server: ImageServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every hop is checked, not the first alone. The server is on loopback, so for this
    test 127.0.0.1 counts as public; its redirect goes to 127.0.0.2, which does not."""
    real = address.is_public
    monkeypatch.setattr(address, "is_public", lambda ip: ip == "127.0.0.1" or real(ip))
    server.routes["/to-private"] = Route(status=302, headers={"Location": f"http://127.0.0.2:{server.port}/image.png"})
    before = len(server.hits)
    await refused(loader(), server.url("/to-private"), RefusedAddress, "the redirect to http://127.0.0.2")
    assert server.hits[before:] == ["/to-private"]


def test_the_address_policy() -> None:
    public = ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111"]
    private = ["127.0.0.1", "10.0.0.1", "172.16.5.4", "192.168.1.1", "169.254.169.254", "100.64.0.1", "0.0.0.0",
               "224.0.0.1", "::1", "fe80::1", "fc00::1", "::ffff:127.0.0.1", "::ffff:10.0.0.1", "255.255.255.255"]
    assert [ip for ip in public if not address.is_public(ip)] == []
    assert [ip for ip in private if address.is_public(ip)] == []


# -- every bad image, with its reason --------------------------------------------------


async def test_bad_base64_is_refused() -> None:
    await refused(loader(), "data:image/png;base64,iVBOR*w0K", BadBase64, "not valid base64")
    await refused(loader(), "data:image/png;base64,iVBORw0", BadBase64, "not valid base64")  # padding
    await refused(loader(), "data:image/png;base64,", BadBase64, "empty")


async def test_what_is_not_an_image_is_refused(server: ImageServer) -> None:
    await refused(loader(), data_url(b"GIF89a but not really"), NotAnImage, "not an image")
    await refused(loader(**LOCAL), server.url("/text"), NotAnImage, "not an image")
    # A real image in a format we do not decode (TIFF) is not one here either.
    await refused(loader(), data_url(encode(PIXELS, "TIFF")), NotAnImage, "PNG, JPEG, WEBP, GIF, BMP")


async def test_a_truncated_image_is_refused() -> None:
    big = encode(noise(200, 200, seed=4))
    await refused(loader(), data_url(big[: len(big) // 2]), TruncatedImage, "truncated or damaged")
    jpeg = encode(noise(200, 200, seed=4), "JPEG")
    await refused(loader(), data_url(jpeg[: len(jpeg) // 2], "image/jpeg"), TruncatedImage, "JPEG image is truncated")


async def test_too_many_pixels_is_refused_before_decoding() -> None:
    # 5000 x 4000 declared in 100 bytes: past our limit (2**24), under Pillow's own.
    bomb = png_header_only(5000, 4000)
    assert len(bomb) < 200
    await refused(loader(), data_url(bomb), TooManyPixels, "5000x4000, 20000000 pixels, more than the 16777216")
    # Past Pillow's own limit too: its DecompressionBombError, caught and named alike.
    await refused(loader(), data_url(png_header_only(100_000, 100_000)), TooManyPixels, "pixels")
    # The limit is the setting.
    await refused(loader(max_pixels=100), data_url(PNG), TooManyPixels, "24x16, 384 pixels, more than the 100")


async def test_too_many_images_are_refused_before_any_loads(server: ImageServer) -> None:
    before = len(server.hits)
    refs = [ImageRef(server.url("/image.png"), f"messages.{i}.content.0") for i in range(3)]
    with pytest.raises(TooManyImages) as caught:
        await loader(**LOCAL, max_per_request=2).load(refs)
    assert caught.value.param == "messages.2.content.0"  # the first one past the cap
    assert "3 images, more than the 2 allowed" in caught.value.message
    assert len(server.hits) == before


async def test_too_large_an_image_is_refused(server: ImageServer) -> None:
    small = {"max_bytes": len(PNG) - 1}
    await refused(loader(**LOCAL, **small), server.url("/big.png"), ImageTooLarge, f"is {len(PNG)} bytes, more than")
    await refused(loader(**LOCAL, **small), server.url("/streamed.png"), ImageTooLarge, "cut off")
    await refused(loader(max_bytes=1000), data_url(encode(noise(100, 100))), ImageTooLarge, "more than the 1000")


async def test_a_slow_host_times_out(server: ImageServer) -> None:
    start = time.monotonic()
    await refused(loader(**LOCAL, fetch_timeout_s=0.3), server.url("/slow.png"), FetchTimeout, "within 0.3 s")
    assert time.monotonic() - start < 5.0  # at the 0.3 s timeout, not when the host answers (10 s)


async def test_a_failed_download_and_an_unsupported_url_are_refused(server: ImageServer) -> None:
    await refused(loader(**LOCAL), server.url("/missing.png"), FetchFailed, "answered 404")
    await refused(loader(), "file:///etc/passwd", UnsupportedURL, "a base64 data: URL or an http(s) URL")
    await refused(loader(), "data:image/png,rawbytes", UnsupportedURL, "only base64 data: URLs")


async def test_the_earliest_bad_image_is_the_one_reported() -> None:
    refs = [ImageRef(data_url(PNG), "messages.0.content.0"), ImageRef("data:image/png;base64,@", "messages.0.content.1"),
            ImageRef(data_url(b"not an image"), "messages.0.content.2")]
    with pytest.raises(BadBase64) as caught:
        await loader().load(refs)
    assert caught.value.param == "messages.0.content.1"


async def test_loading_is_off_the_event_loop() -> None:
    """A large image decodes in a thread: the loop keeps ticking meanwhile."""
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.001)

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0)
    big = data_url(encode(noise(1500, 1500, seed=5)))
    await loader().load([ImageRef(big, PARAM)])
    ticker.cancel()
    assert ticks > 3


async def test_every_kind_of_transparency_is_laid_over_white() -> None:
    """An alpha band (RGBA, LA), a palette's transparent entry and PNG's transparent colour key alike."""
    red = np.zeros((1, 2, 3), dtype=np.uint8)
    red[0, 0] = (200, 10, 10)  # pixel 1 is black, declared transparent below
    keyed = encode(red, transparency=(0, 0, 0))  # an RGB PNG with a tRNS colour key
    paletted = Image.new("P", (2, 1))
    paletted.putpalette([200, 10, 10, 0, 0, 0])
    paletted.putdata([0, 1])
    out = io.BytesIO()
    paletted.save(out, "PNG", transparency=1)  # palette entry 1 is transparent
    gray = np.array([[[90, 255], [90, 0]]], dtype=np.uint8)  # L with alpha: opaque, then transparent
    out_la = io.BytesIO()
    Image.fromarray(gray, "LA").save(out_la, "PNG")
    for data, opaque in ((keyed, [200, 10, 10]), (out.getvalue(), [200, 10, 10]), (out_la.getvalue(), [90, 90, 90])):
        [image] = await loader().load([ImageRef(data_url(data), PARAM)])
        assert image.pixels[0, 0].tolist() == opaque and image.pixels[0, 1].tolist() == [255, 255, 255]
