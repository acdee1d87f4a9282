"""What a request asks for (``ImageRef``) and what loading it gives (``LoadedImage``)."""

from dataclasses import dataclass
from typing import Literal

import numpy as np

Detail = Literal["auto", "low", "high"]
"""OpenAI's ``image_url.detail``; carried for the models that have a notion of it."""


@dataclass(frozen=True, slots=True)
class ImageRef:
    """One image content part of a request, before loading."""

    url: str
    """A ``data:`` URL (base64) or an http(s) URL."""
    param: str
    """Where in the request it is (``messages.0.content.1``): every error names it."""
    detail: Detail = "auto"
    uuid: str | None = None
    """The client's own name for the image (vLLM's ``uuid`` on the part): where given,
    the image's identity is this name, not its pixels."""


@dataclass(frozen=True, slots=True, eq=False)  # eq=False: arrays do not compare to one bool
class LoadedImage:
    """A decoded image and its identity."""

    pixels: np.ndarray
    """uint8, height x width x 3 (RGB), C-contiguous and read-only: its hash stays true."""
    source: str
    """Where it came from: the http(s) URL, or a data: URL's header (``data:image/png;base64``)
    without its payload, so logs and traces never carry the image."""
    hash: bytes
    """32 bytes: identity.image_hash over the model, the processor settings and the pixels (or the uuid)."""
    detail: Detail = "auto"
    uuid: str | None = None
    param: str = "messages"
    """Where in the request it came from (``messages.0.content.1``, the ImageRef's): a
    refusal after loading (too large for the mesh's messages) names it."""

    @property
    def size(self) -> tuple[int, int]:
        """(width, height), as Pillow names an image's size."""
        return int(self.pixels.shape[1]), int(self.pixels.shape[0])
