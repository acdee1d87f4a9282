"""An image's bytes as RGB pixels, with Pillow, refusing what is not safe or not whole.

The pixel limit is this module's own check, made after Pillow has read the header and
before it decodes any pixel data: a few kilobytes can declare a gigapixel image (a
decompression bomb). Pillow keeps a process-wide limit of its own
(Image.MAX_IMAGE_PIXELS, a warning past it and DecompressionBombError past twice it),
which we leave as it is: setting it would change every other user of Pillow in the
process. Both of its signals are caught and read as "too many pixels". Only the
formats clients send are decoded: every other Pillow decoder is attack surface
with no use here."""

import io

import numpy as np
from PIL import Image, UnidentifiedImageError

from shared.multimodal.errors import NotAnImage, TooManyPixels, TruncatedImage

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
"""The decoders tried, by Pillow's format name."""
_WHITE = (255, 255, 255)


def decode_image(data: bytes, param: str, max_pixels: int) -> np.ndarray:
    """The first frame of the image in data as uint8 RGB, height x width x 3, read-only."""
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise TooManyPixels(param, f"the image declares more pixels than can be decoded safely ({exc})") from None
    except UnidentifiedImageError:
        names = ", ".join(FORMATS)
        raise NotAnImage(param, f"the {len(data)} bytes are not an image in a format read here ({names})") from None
    with image:
        width, height = image.size
        if width * height > max_pixels:
            raise TooManyPixels(param, f"the image is {width}x{height}, {width * height} pixels, more than the "
                                f"{max_pixels} allowed (images.max_pixels)")
        if width == 0 or height == 0:
            raise NotAnImage(param, f"the image is {width}x{height}: it has no pixels")
        try:
            # A full load: a file cut short fails here (Pillow's LOAD_TRUNCATED_IMAGES is
            # left off), not later, half grey, in the vision tower.
            image.load()
            rgb = _rgb(image)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise TooManyPixels(param, f"the image holds more pixels than can be decoded safely ({exc})") from None
        except (OSError, SyntaxError, ValueError, EOFError) as exc:
            raise TruncatedImage(param, f"the {image.format} image is truncated or damaged: {exc}") from None
    pixels = np.asarray(rgb, dtype=np.uint8)
    if pixels.shape != (height, width, 3):  # a decoder that changed its mind about the size
        raise NotAnImage(param, f"the image decoded to {pixels.shape}, not the {height}x{width} it declared")
    pixels = np.ascontiguousarray(pixels)
    pixels.flags.writeable = False
    return pixels


def _rgb(image: Image.Image) -> Image.Image:
    """RGB as transformers' image processors make it (convert_rgb): a transparent image
    is laid over white, not stripped of its alpha, which would show what the
    transparent pixels happen to hold."""
    # has_transparency_data: an alpha band, or a palette's or PNG's transparent colour (tRNS).
    if not image.has_transparency_data:
        return image if image.mode == "RGB" else image.convert("RGB")
    rgba = image.convert("RGBA")
    background = Image.new("RGBA", rgba.size, _WHITE + (255,))
    background.alpha_composite(rgba)
    return background.convert("RGB")
