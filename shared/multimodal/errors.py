"""Why an image was refused: one exception per reason, each naming the request field
the image came from (``param``) and saying why in words a client can act on. The
front door turns any of them into an OpenAI 400 with that param and ``code``."""

from typing import ClassVar


class ImageError(Exception):
    """An image the request cannot use; the client's fault, never the server's."""

    code: ClassVar[str] = "invalid_image"
    """OpenAI's error ``code`` for the response body."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


class UnsupportedURL(ImageError):
    """Neither a base64 ``data:`` URL nor an http(s) URL."""

    code = "invalid_image_url"


class BadBase64(ImageError):
    code = "invalid_base64"


class NotAnImage(ImageError):
    """Bytes no allowed decoder recognises (or an image without pixels)."""

    code = "invalid_image_format"


class TruncatedImage(ImageError):
    """The header was read, the pixel data is cut short or damaged."""

    code = "invalid_image_format"


class TooManyPixels(ImageError):
    """More pixels than the limit: refused before the pixel data is decoded."""

    code = "image_too_large"


class TooManyImages(ImageError):
    code = "too_many_images"


class ImageTooLarge(ImageError):
    """More encoded bytes than the limit (a download or a data: URL)."""

    code = "image_too_large"


class FetchTimeout(ImageError):
    code = "image_fetch_timeout"


class RefusedAddress(ImageError):
    """The URL's host (or a redirect's) resolves to an address the policy refuses."""

    code = "image_url_refused"


class FetchFailed(ImageError):
    """The download did not succeed: no connection, a non-200 answer, a redirect loop."""

    code = "image_fetch_failed"
