"""Encoded image bytes to RGB uint8 pixels, the same way for every format and framework."""

from __future__ import annotations

import io
import warnings

import numpy as np
import simplejpeg
from PIL import Image, UnidentifiedImageError

__all__ = ["decode_image"]

_JPEG_MAGIC = b"\xff\xd8\xff"


def decode_image(encoded: bytes, *, at_least: int | None = None, max_pixels: int | None = None) -> np.ndarray:
    """An encoded image as RGB uint8 [H, W, 3], in the orientation its pixels are stored.

    Grey is replicated, a 16-bit sample kept to its high byte, CMYK converted,
    and transparency composited onto white (as img2dataset does). EXIF
    orientation is ignored, as ``PIL.Image.open`` ignores it.

    With ``at_least``, a JPEG is decoded at the largest 1/2, 1/4 or 1/8 DCT
    reduction that keeps both sides >= at_least, so most of the decode is
    skipped and the resize after it still only shrinks.

    The header is read first and an image over ``max_pixels`` (default
    Pillow's ``MAX_IMAGE_PIXELS``) is refused before any pixel is decoded.
    Every failure is a ``ValueError`` saying what is wrong.
    """
    if not encoded:
        raise ValueError("empty image: 0 bytes")
    limit = Image.MAX_IMAGE_PIXELS if max_pixels is None else max_pixels
    try:
        with warnings.catch_warnings():
            # The size check below is ours; Pillow's own bomb warning would only repeat it.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(encoded))
    except Image.DecompressionBombError as exc:
        raise ValueError(f"image refused before decoding: {exc}") from None
    except UnidentifiedImageError:
        raise ValueError(
            f"not a readable image: no decoder recognises its header ({len(encoded)} bytes, starts {encoded[:8]!r})"
        ) from None
    except (OSError, SyntaxError) as exc:
        raise ValueError(f"not a readable image ({len(encoded)} bytes, starts {encoded[:8]!r}): {exc}") from None
    width, height = image.size
    if limit and width * height > limit:
        raise ValueError(
            f"image refused before decoding: {width}x{height} is over the {limit}-pixel limit (a decompression bomb?)"
        )
    if width <= 0 or height <= 0:
        raise ValueError(f"image header gives an empty size {width}x{height}")
    try:
        if image.format == "JPEG" and encoded.startswith(_JPEG_MAGIC) and image.mode in ("RGB", "L"):
            return _decode_jpeg(encoded, height, width, at_least)
        return _decode_pillow(image, at_least)
    except (OSError, SyntaxError, ValueError) as exc:
        raise ValueError(f"{image.format or 'image'} {width}x{height} {image.mode} cannot be decoded: {exc}") from None
    finally:
        image.close()


def _decode_jpeg(encoded: bytes, height: int, width: int, at_least: int | None) -> np.ndarray:
    # libjpeg-turbo through simplejpeg: several times faster than PIL, with DCT scaling;
    # strict=True turns libjpeg's warnings (a truncated file) into errors.
    factor = 1
    if at_least:
        factor = next((f for f in (8, 4, 2) if -(-min(height, width) // f) >= at_least), 1)
    # Asking for exactly the 1/factor size makes libjpeg pick that scale, not an M/8 one between.
    pixels: np.ndarray = simplejpeg.decode_jpeg(
        encoded, colorspace="RGB", min_height=-(-height // factor), min_width=-(-width // factor), strict=True
    )
    return pixels


def _decode_pillow(image: Image.Image, at_least: int | None) -> np.ndarray:
    if at_least and image.format == "JPEG":
        # draft() picks the largest DCT reduction that keeps the requested size (CMYK JPEGs land here).
        image.draft(image.mode, (at_least, at_least))
    image.load()
    mode = image.mode
    if mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        return _sixteen_bit(image)
    if mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
    elif mode == "PA":
        image = image.convert("RGBA")
    elif mode in ("L", "1") and "transparency" in image.info:
        image = image.convert("LA")
    elif mode == "RGB" and "transparency" in image.info:
        image = image.convert("RGBA")
    mode = image.mode
    if mode in ("RGBA", "LA", "La", "RGBa"):
        rgba = np.asarray(image.convert("RGBA"))
        return _over_white(rgba[..., :3], rgba[..., 3])
    return np.asarray(image.convert("RGB"))


def _sixteen_bit(image: Image.Image) -> np.ndarray:
    values = np.asarray(image).astype(np.uint32)
    grey = (np.clip(values, 0, 65535) >> 8).astype(np.uint8)
    rgb = np.repeat(grey[..., None], 3, axis=2)
    transparent = image.info.get("transparency")
    if isinstance(transparent, int):
        alpha = np.where(values == transparent, 0, 255).astype(np.uint8)
        return _over_white(rgb, alpha)
    return rgb


def _over_white(rgb: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    a = alpha.astype(np.uint32)[..., None]
    out = (rgb.astype(np.uint32) * a + 255 * (255 - a) + 127) // 255
    return out.astype(np.uint8)
