"""A request's images, loaded: counted against the per-request cap first, then every
one fetched or decoded from its data: URL concurrently, decoded and hashed off the
event loop (a large image takes tens of milliseconds to decode and hash). The first
image to fail fails the request and cancels the others' downloads."""

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

from shared.multimodal.data_url import data_url_header, decode_data_url
from shared.multimodal.decode import decode_image
from shared.multimodal.errors import ImageError, TooManyImages, UnsupportedURL
from shared.multimodal.fetch import Fetcher
from shared.multimodal.identity import image_hash
from shared.multimodal.image import ImageRef, LoadedImage
from shared.runtime.settings import ImageSettings


class ImageLoader:
    """Loads images for one model: its name and its processor's settings go into each image's hash."""

    def __init__(self, settings: ImageSettings, model: str, processor_settings: Mapping[str, Any]) -> None:
        self.settings = settings
        self.model = model
        self.processor_settings = dict(processor_settings)

    def check_count(self, refs: Sequence[ImageRef]) -> None:
        """Refuse more images than images.max_per_request, naming the first one past it."""
        cap = self.settings.max_per_request
        if len(refs) > cap:
            raise TooManyImages(refs[cap].param, f"the request has {len(refs)} images, more than the {cap} "
                                "allowed per request (images.max_per_request)")

    async def load(self, refs: Sequence[ImageRef]) -> list[LoadedImage]:
        """Every image of refs, in order; raises the ImageError of the earliest that failed."""
        self.check_count(refs)
        if not refs:
            return []
        async with contextlib.AsyncExitStack() as stack:
            fetcher = None
            if any(not _is_data_url(ref.url) for ref in refs):
                fetcher = await stack.enter_async_context(Fetcher(self.settings))
            try:
                async with asyncio.TaskGroup() as group:
                    tasks = [group.create_task(self._load(ref, fetcher)) for ref in refs]
            except* ImageError as failed:
                errors = [e for e in failed.exceptions if isinstance(e, ImageError)]
                order = {ref.param: i for i, ref in enumerate(refs)}
                raise min(errors, key=lambda e: order.get(e.param, len(refs))) from None
        return [task.result() for task in tasks]

    async def _load(self, ref: ImageRef, fetcher: Fetcher | None) -> LoadedImage:
        if _is_data_url(ref.url):  # base64 of megabytes is work too: in the thread with the decoding
            return await asyncio.to_thread(self._from_data_url, ref)
        if fetcher is None:  # unreachable: load opens a fetcher whenever a URL is not data:
            raise UnsupportedURL(ref.param, "no fetcher for an http(s) URL")
        data = await fetcher.fetch(ref.url, ref.param)
        return await asyncio.to_thread(self._decode, data, ref, ref.url)

    def _from_data_url(self, ref: ImageRef) -> LoadedImage:
        data = decode_data_url(ref.url, ref.param, self.settings.max_bytes)
        return self._decode(data, ref, data_url_header(ref.url))

    def _decode(self, data: bytes, ref: ImageRef, source: str) -> LoadedImage:
        pixels = decode_image(data, ref.param, self.settings.max_pixels)
        identity = image_hash(self.model, self.processor_settings, pixels, ref.uuid)
        return LoadedImage(pixels, source, identity, ref.detail, ref.uuid, ref.param)


def _is_data_url(url: str) -> bool:
    return url[:5].lower() == "data:"
