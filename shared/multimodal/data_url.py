"""A ``data:`` URL's bytes (RFC 2397), base64 only: that is how OpenAI clients send
an image inline (``data:image/png;base64,iVBOR...``)."""

import base64
import binascii

from shared.multimodal.errors import BadBase64, ImageTooLarge, UnsupportedURL


def data_url_header(url: str) -> str:
    """What precedes the payload (``data:image/png;base64``): names the source without the image."""
    return url.split(",", 1)[0]


def decode_data_url(url: str, param: str, max_bytes: int) -> bytes:
    """The decoded payload of a base64 data: URL, at most max_bytes of it."""
    header, comma, payload = url.partition(",")
    if not comma:
        raise UnsupportedURL(param, "a data: URL needs a comma between its header and its data")
    if header.split(";")[-1].strip().lower() != "base64":
        # A percent-encoded data: URL can spell binary too, but no OpenAI client sends one.
        raise UnsupportedURL(param, f"only base64 data: URLs are read (data:<type>;base64,<data>), got {header!r}")
    # Refused before decoding: the decoded size is known from the length alone.
    if len(payload) // 4 * 3 > max_bytes + 2:
        raise ImageTooLarge(param, f"the data: URL holds about {len(payload) // 4 * 3} bytes, more than the "
                            f"{max_bytes} allowed (images.max_bytes)")
    try:
        # validate=True: a stray character is an error, not silently dropped (which would
        # decode to other bytes and surface later as a confusing "not an image").
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadBase64(param, f"the data: URL's data is not valid base64 ({exc})") from None
    if len(data) > max_bytes:
        raise ImageTooLarge(param, f"the data: URL holds {len(data)} bytes, more than the {max_bytes} allowed "
                            "(images.max_bytes)")
    if not data:
        raise BadBase64(param, "the data: URL's data is empty")
    return data
