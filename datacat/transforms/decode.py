"""Encoded image bytes to RGB uint8 pixels, the same way for every format and framework."""

from __future__ import annotations

import io
import logging
import warnings

import numpy as np
import simplejpeg
from PIL import Image, UnidentifiedImageError

__all__ = ["check_jpeg_markers", "decode_image", "stored_size"]

log = logging.getLogger(__name__)

_JPEG_MAGIC = b"\xff\xd8\xff"
_SIMPLEJPEG_COLORSPACES = ("YCbCr", "Gray", "RGB")  # CMYK and YCCK go through Pillow
# libjpeg warnings about bytes outside the picture: the pixels are all there.
_TOLERATED_WARNINGS = ("extraneous bytes before marker", "Unknown APP", "JFIF revision", "ICC profile", "Adobe")
# What libjpeg-turbo's TurboJPEG layer refuses of a valid file (a layout it has no fast path for, such as CMYK
# with its channels sampled unevenly): such a file goes to Pillow, which judges it, after a check of its markers.
_FAST_PATH_LIMITS = (
    "Could not determine subsampling",
    "Unsupported JPEG process",
    "Unsupported color conversion",
    "Unsupported JPEG data precision",
)


def decode_image(
    encoded: bytes | memoryview, *, at_least: int | None = None, max_pixels: int | None = None
) -> np.ndarray:
    """An encoded image (bytes, or a view of them) as RGB uint8 [H, W, 3], in the orientation its pixels are stored.

    Grey is replicated, a 16-bit sample kept to its high byte, CMYK converted,
    and transparency composited onto white (as img2dataset does). EXIF
    orientation is ignored, as ``PIL.Image.open`` ignores it.

    With ``at_least``, a JPEG is decoded at the largest of libjpeg-turbo's
    1/2, 1/4 and 1/8 reductions that keeps both sides >= at_least, so most
    of the decode is skipped and the resize after it shrinks by less than 2.

    The header is read first and an image over ``max_pixels`` (default
    Pillow's ``MAX_IMAGE_PIXELS``) is refused before any pixel is decoded.
    A JPEG with extraneous bytes between segments (web-scraped files often
    have them, in a damaged EXIF block or before the end marker) is decoded,
    with a logged warning; one that ends early or whose entropy-coded data is
    corrupt is refused, since part of its picture would be grey. A CMYK or
    YCCK JPEG is judged by libjpeg's strict decode and converted by Pillow;
    one whose layout TurboJPEG cannot read (CMYK sampled unevenly) is
    decoded by Pillow after :func:`check_jpeg_markers`. Every failure is a
    ``ValueError`` saying what is wrong.
    """
    if not encoded:
        raise ValueError("empty image: 0 bytes")
    limit = Image.MAX_IMAGE_PIXELS if max_pixels is None else max_pixels
    if encoded[:3] == _JPEG_MAGIC:
        try:
            height, width, colorspace, _ = simplejpeg.decode_jpeg_header(encoded)
        except ValueError as exc:
            _judge_refusal(exc, encoded)  # a damaged segment before the frame, or a layout only Pillow reads
        else:
            _check_size(width, height, limit)
            try:
                if colorspace in _SIMPLEJPEG_COLORSPACES:
                    return _decode_jpeg(encoded, height, width, at_least)
                # CMYK and YCCK: libjpeg's strict decode judges the data, Pillow converts the colours.
                simplejpeg.decode_jpeg(encoded, colorspace="CMYK", strict=True)
            except ValueError as exc:
                _judge_refusal(exc, encoded)
    return _decode_with_pillow(encoded, at_least, limit)


def stored_size(encoded: bytes | memoryview) -> tuple[int, int]:
    """(height, width) of an encoded image as stored, from its header (a JPEG's is read without Pillow)."""
    if encoded[:3] == _JPEG_MAGIC:
        try:
            height, width, _, _ = simplejpeg.decode_jpeg_header(encoded)
            return int(height), int(width)
        except ValueError:
            pass  # a layout only Pillow reads
    try:
        with Image.open(io.BytesIO(encoded)) as image:
            width, height = image.size
    except (OSError, SyntaxError, UnidentifiedImageError, Image.DecompressionBombError) as exc:
        raise ValueError(f"not a readable image header ({len(encoded)} bytes): {exc}") from None
    return int(height), int(width)


def _judge_refusal(exc: ValueError, encoded: bytes | memoryview) -> None:
    """Returns when the fast decoder's refusal leaves the image to Pillow; raises when it shows the image damaged."""
    if any(text in str(exc) for text in _FAST_PATH_LIMITS):
        check_jpeg_markers(encoded)
    else:
        _refuse_unless_tolerated(exc, encoded)


def check_jpeg_markers(encoded: bytes | memoryview) -> None:
    """Raises a ValueError for a JPEG whose segments run past its end, or that ends before its end-of-image marker.

    The check libjpeg's own strict decode does not get to make for a file
    only Pillow reads (Pillow decodes a JPEG cut short after its last
    marker, or with an end marker written over its scan, into grey
    without an error): every segment's length fits, and the entropy-coded
    data of each scan ends at a marker, the last being EOI; restart
    markers in it come in order.
    """
    data = bytes(encoded)
    at, end = 2, len(data)
    while at < end:
        if data[at] != 0xFF:
            raise ValueError(f"JPEG damaged: byte {at} is not a marker (0x{data[at]:02x})")
        while at < end and data[at] == 0xFF:  # fill bytes before a marker
            at += 1
        if at >= end:
            break
        marker = data[at]
        at += 1
        if marker == 0xD9:
            return
        if 0xD0 <= marker <= 0xD7 or marker == 0x01:
            continue
        if at + 2 > end:
            break
        length = int.from_bytes(data[at : at + 2], "big")
        if length < 2 or at + length > end:
            raise ValueError(f"JPEG damaged: segment 0x{marker:02x} at byte {at - 2} runs past the file's end")
        at += length
        if marker == 0xDA:
            at = _end_of_scan(data, at)
    raise ValueError(f"JPEG cut short: {end} bytes and no end-of-image marker after its last scan")


def _end_of_scan(data: bytes, at: int) -> int:
    """Where the entropy-coded data from ``at`` ends (the next marker); raises if restart markers are out of order."""
    expected = 0
    while True:
        at = data.find(b"\xff", at)
        if at < 0 or at + 1 >= len(data):
            raise ValueError(f"JPEG cut short: its scan runs to the end of the file ({len(data)} bytes)")
        following = data[at + 1]
        if following == 0x00 or following == 0xFF:
            at += 1
        elif 0xD0 <= following <= 0xD7:
            if following - 0xD0 != expected:
                raise ValueError(
                    f"JPEG damaged: restart marker {following - 0xD0} at byte {at} where {expected} belongs"
                )
            expected = (expected + 1) % 8
            at += 2
        else:
            return at


def _refuse_unless_tolerated(exc: ValueError, encoded: bytes | memoryview) -> None:
    message = str(exc)
    if not any(text in message for text in _TOLERATED_WARNINGS):
        raise ValueError(f"JPEG ({len(encoded)} bytes) cannot be decoded: {message}") from None
    log.warning("JPEG decoded despite a libjpeg warning (its picture is intact): %s", message)


def _check_size(width: int, height: int, limit: int | None) -> None:
    if limit and width * height > limit:
        raise ValueError(
            f"image refused before decoding: {width}x{height} is over the {limit}-pixel limit (a decompression bomb?)"
        )
    if width <= 0 or height <= 0:
        raise ValueError(f"image header gives an empty size {width}x{height}")


def _decode_with_pillow(encoded: bytes | memoryview, at_least: int | None, limit: int | None) -> np.ndarray:
    with warnings.catch_warnings(record=True) as caught:
        # Pillow warns about damaged metadata (EXIF) it read past: logged, not raised in a worker.
        warnings.simplefilter("always")
        # The size check is ours; Pillow's own bomb warning would only repeat it.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            return _open_and_decode(encoded, at_least, limit)
        finally:
            for warning in caught:
                log.warning("image decoded despite a warning: %s", warning.message)


def _open_and_decode(encoded: bytes | memoryview, at_least: int | None, limit: int | None) -> np.ndarray:
    try:
        image = Image.open(io.BytesIO(encoded))
    except Image.DecompressionBombError as exc:
        raise ValueError(f"image refused before decoding: {exc}") from None
    except UnidentifiedImageError:
        raise ValueError(
            f"not a readable image: no decoder recognises its header ({len(encoded)} bytes, starts {bytes(encoded[:8])!r})"
        ) from None
    except (OSError, SyntaxError) as exc:
        raise ValueError(f"not a readable image ({len(encoded)} bytes, starts {bytes(encoded[:8])!r}): {exc}") from None
    width, height = image.size
    try:
        _check_size(width, height, limit)
        return _decode_pillow(image, at_least)
    except (OSError, SyntaxError, ValueError) as exc:
        raise ValueError(f"{image.format or 'image'} {width}x{height} {image.mode} cannot be decoded: {exc}") from None
    finally:
        image.close()


def _decode_jpeg(encoded: bytes | memoryview, height: int, width: int, at_least: int | None) -> np.ndarray:
    # libjpeg-turbo through simplejpeg: several times faster than PIL. It decodes at any M/8
    # scale, but only 8/8, 4/8 and 2/8 have SIMD inverse DCTs (1/8 keeps the DC term alone):
    # at 3/8 and 5/8-7/8 its plain C transforms make a smaller picture take longer than the
    # next power of two up (1.4-1.9x here at 5/8-7/8, then a linear resize). So the reduction
    # is a power of two, and simplejpeg, asked for at least the reduced size, picks exactly
    # that scale. strict=True turns libjpeg's warnings into errors, which decode_image sorts
    # into tolerated and refused.
    factor = _reduction(height, width, at_least)
    pixels: np.ndarray = simplejpeg.decode_jpeg(
        encoded, colorspace="RGB", min_height=-(-height // factor), min_width=-(-width // factor), strict=True
    )
    return pixels


def _reduction(height: int, width: int, at_least: int | None) -> int:
    """The largest of 8, 4 and 2 that libjpeg can divide both sides by and keep them >= at_least; else 1."""
    for factor in (8, 4, 2):
        if at_least and -(-min(height, width) // factor) >= at_least:  # libjpeg rounds a scaled side up
            return factor
    return 1


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
