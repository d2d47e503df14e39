"""decode_image against Pillow, for every image in tests/data/images."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image

from datacat.transforms.decode import decode_image
from datacat.transforms.resize import resize_image

BROKEN = {
    "broken.png": "no decoder recognises",
    "truncated_image.png": "truncated",
    "truncated_jpeg.jpg": "Premature end",
}


def _images(shared: Path) -> list[Path]:
    return sorted(p for p in (shared / "images").rglob("*") if p.is_file())


def test_every_shared_image_decodes_or_raises_value_error(licensed_data: Path) -> None:
    seen = 0
    for path in _images(licensed_data):
        data = path.read_bytes()
        if path.name in BROKEN:
            with pytest.raises(ValueError, match=BROKEN[path.name]):
                decode_image(data)
            continue
        pixels = decode_image(data)
        seen += 1
        with Image.open(path) as ref:
            assert pixels.shape == (ref.height, ref.width, 3), path.name
            assert pixels.dtype == np.uint8
            if ref.mode in ("RGB", "CMYK", "L") and "transparency" not in ref.info:
                # Pillow defines the answer: its own RGB conversion (grey replicated, CMYK converted).
                np.testing.assert_array_equal(pixels, np.asarray(ref.convert("RGB")), err_msg=path.name)
    assert seen == 23


def test_exif_orientation_is_ignored(licensed_data: Path) -> None:
    for name in ("hopper_orientation_3.jpg", "hopper_orientation_6.jpg"):
        path = licensed_data / "images" / "pillow" / name
        with Image.open(path) as ref:
            np.testing.assert_array_equal(decode_image(path.read_bytes()), np.asarray(ref.convert("RGB")))


def test_transparency_is_composited_onto_white(licensed_data: Path) -> None:
    for name in ("transparent.png", "uncompressed_la.png", "p_trns_single.png", "pil123p.png"):
        path = licensed_data / "images" / "pillow" / name
        with Image.open(path) as ref:
            rgba = np.asarray(ref.convert("RGBA")).astype(np.float64)
        expected = np.rint(rgba[..., :3] * rgba[..., 3:] / 255 + 255 * (1 - rgba[..., 3:] / 255))
        got = decode_image(path.read_bytes()).astype(np.float64)
        assert np.abs(got - expected).max() <= 1, name
        assert (got[rgba[..., 3] == 0] == 255).all(), name  # fully transparent is white


def test_sixteen_bit_grey_keeps_high_byte_and_transparency(licensed_data: Path) -> None:
    path = licensed_data / "images" / "pillow" / "i_trns.png"
    with Image.open(path) as ref:
        values = np.asarray(ref).astype(np.uint32)
        transparent = ref.info["transparency"]
    got = decode_image(path.read_bytes())
    opaque = values != transparent
    assert (got[..., 0][opaque] == (values[opaque] >> 8)).all()
    assert (got[~opaque] == 255).all() and (~opaque).any()
    assert (got[..., 0] == got[..., 2]).all()


def test_at_least_decodes_at_the_largest_power_of_two_reduction_that_keeps_it(licensed_data: Path) -> None:
    data = (licensed_data / "images" / "skimage" / "retina.jpg").read_bytes()  # 1411 x 1411
    assert decode_image(data, at_least=256).shape == (353, 353, 3)  # 1/4; 1/8 would be 177 < 256
    assert decode_image(data, at_least=700).shape == (706, 706, 3)  # 1/2
    # 1/2 would be 706 < 800; libjpeg's 5/8 (882) takes longer than the whole picture at 8/8.
    assert decode_image(data, at_least=800).shape == (1411, 1411, 3)
    assert decode_image(data, at_least=2000).shape == (1411, 1411, 3)  # never upscaled by the decoder
    rocket = (licensed_data / "images" / "skimage" / "rocket.jpg").read_bytes()  # 640 x 427: each side its own
    assert decode_image(rocket, at_least=200).shape == (214, 320, 3)
    cmyk = (licensed_data / "images" / "pillow" / "pil_sample_cmyk.jpg").read_bytes()  # 100 x 100, via Pillow's draft
    assert decode_image(cmyk, at_least=40).shape == (50, 50, 3)


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims width x height but carries almost no pixel data."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", ihdr)
        + _chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + _chunk(b"IEND", b"")
    )


def test_scaled_decode_and_resize_keep_35_db_against_a_float_reference(licensed_data: Path) -> None:
    # The reference: full decode in float, centre crop, area resize (what bench_decode calls the truth).
    # At 256 px the decode is 1/4 of retina.jpg and all of rocket.jpg here, each then shrunk by under 2
    # (a 1/8 decode, DC only, would lose ~5 dB).
    for name in ("retina.jpg", "rocket.jpg"):
        data = (licensed_data / "images" / "skimage" / name).read_bytes()
        full = decode_image(data).astype(np.float32)
        side = min(full.shape[:2])
        top, left = (full.shape[0] - side) // 2, (full.shape[1] - side) // 2
        reference = cv2.resize(full[top : top + side, left : left + side], (256, 256), interpolation=cv2.INTER_AREA)
        got = resize_image(decode_image(data, at_least=256), 256).astype(np.float32)
        psnr = 10 * np.log10(255.0**2 / float(np.mean((got - reference) ** 2)))
        assert psnr >= 35, (name, psnr)


def _jpeg(pixels: np.ndarray, **options: object) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=90, **options)
    return out.getvalue()


def test_extraneous_bytes_are_tolerated_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    pixels = np.random.default_rng(0).integers(0, 255, (48, 64, 3), dtype=np.uint8)
    clean = _jpeg(pixels)
    junk_before_eoi = clean[:-2] + b"\x00junk" + clean[-2:]
    exif = Image.Exif()
    exif[0x010E] = "a description long enough to damage"  # ImageDescription
    grey = _jpeg(pixels[..., 0], exif=exif.tobytes())
    app1 = grey.index(b"\xff\xe1")
    length = int.from_bytes(grey[app1 + 2 : app1 + 4], "big")
    # An APP1 (EXIF) segment whose length field is 10 short: its tail is left as stray bytes.
    damaged_exif = grey[: app1 + 2] + (length - 10).to_bytes(2, "big") + grey[app1 + 4 :]
    for data, original in ((junk_before_eoi, clean), (damaged_exif, grey)):
        with Image.open(io.BytesIO(original)) as ref:
            expected = np.asarray(ref.convert("RGB"))
        with caplog.at_level("WARNING", logger="datacat.transforms.decode"):
            np.testing.assert_array_equal(decode_image(data), expected)
        assert "extraneous bytes" in caplog.text
        caplog.clear()


def test_a_jpeg_that_ends_early_or_has_corrupt_scans_is_refused() -> None:
    pixels = np.random.default_rng(1).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    clean = _jpeg(pixels)
    with pytest.raises(ValueError, match="Premature end"):
        decode_image(clean[: len(clean) // 2])
    with pytest.raises(ValueError, match=r"(?i)premature|truncated"):
        decode_image(clean[: len(clean) // 2][:-2] + b"\x00junk" + b"\xff\xd9")  # stray bytes do not hide it
    scan = clean.index(b"\xff\xda")
    corrupt = bytearray(clean)
    corrupt[scan + 40 : scan + 60] = b"\xff\xd3" * 10  # restart markers where none belong
    with pytest.raises(ValueError, match="JPEG"):
        decode_image(bytes(corrupt))


def test_decompression_bomb_is_refused_from_the_header() -> None:
    with pytest.raises(ValueError, match="refused before decoding"):
        decode_image(_png_header_only(100_000, 100_000))
    with pytest.raises(ValueError, match="over the 1000-pixel limit"):
        decode_image(_png_header_only(100, 100), max_pixels=1000)


@pytest.mark.parametrize("data", [b"", b"not an image at all", b"\xff\xd8\xff\xe0" + b"\x00" * 20])
def test_garbage_is_a_value_error(data: bytes) -> None:
    with pytest.raises(ValueError):
        decode_image(data)


def test_a_view_of_the_bytes_decodes_as_the_bytes_do(licensed_data: Path) -> None:
    # Tar members and packed entries reach the decoder as views of the span read (not copied out).
    for path in _images(licensed_data):
        data = path.read_bytes()
        view = memoryview(b"ab" + data)[2:]
        if path.name in BROKEN:
            with pytest.raises(ValueError, match=BROKEN[path.name]):
                decode_image(view)
            continue
        np.testing.assert_array_equal(decode_image(view, at_least=32), decode_image(data, at_least=32), path.name)


def _odd_jpeg(mode: str, **options: object) -> bytes:
    yy, xx = np.mgrid[0:96, 0:128]
    channels = [xx * 2, yy * 2, (xx + yy), 255 - xx * 2][: len(mode) if mode != "L" else 1]
    pixels = np.stack(channels, -1).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels[..., 0] if mode == "L" else pixels, mode).save(out, "JPEG", quality=90, **options)
    return out.getvalue()


def _scan_start(data: bytes) -> int:
    return data.index(b"\xff\xda")


ODD_INTACT = {
    # Adobe APP14 (transform 0) CMYK with its first channel sampled 2x1 and 2x2: TurboJPEG cannot name the
    # subsampling and refuses the header; Pillow (libjpeg) decodes it.
    "cmyk_422": _odd_jpeg("CMYK", subsampling=1),
    "cmyk_420": _odd_jpeg("CMYK", subsampling=2),
    "cmyk_444": _odd_jpeg("CMYK", subsampling=0),
    "grey": _odd_jpeg("L"),
    "progressive": _odd_jpeg("RGB", progressive=True),
    "rgb_420_restarts": _odd_jpeg("RGB", subsampling=2, restart_marker_blocks=4),
    "trailing_garbage": _odd_jpeg("RGB") + b"garbage after the end marker",
}


@pytest.mark.parametrize("name", sorted(ODD_INTACT))
def test_an_image_pillow_decodes_intact_decodes(name: str) -> None:
    data = ODD_INTACT[name]
    with Image.open(io.BytesIO(data)) as ref:
        expected = np.asarray(ref.convert("RGB"))
    assert data[2:4] == b"\xff\xee" or not name.startswith("cmyk")  # the Adobe marker comes first
    np.testing.assert_array_equal(decode_image(data), expected)


def _corrupt_scan(data: bytes) -> bytes:
    damaged = bytearray(data)
    start = _scan_start(data) + 60
    damaged[start : start + 24] = bytes(b ^ 0x5A for b in damaged[start : start + 24])
    return bytes(damaged)


ODD_DAMAGED = {
    "cmyk_444_corrupt_scan": (_corrupt_scan(ODD_INTACT["cmyk_444"]), "Corrupt JPEG data"),
    "cmyk_420_cut_in_its_scan": (ODD_INTACT["cmyk_420"][:-200], "cut short"),
    "cmyk_420_cut_before_its_end_marker": (ODD_INTACT["cmyk_420"][:-2], "cut short"),
    "cmyk_420_segment_past_the_end": (ODD_INTACT["cmyk_420"][: _scan_start(ODD_INTACT["cmyk_420"]) + 5], "past"),
    "rgb_corrupt_scan": (_corrupt_scan(ODD_INTACT["progressive"]), "cannot be decoded"),
    "rgb_cut_short": (ODD_INTACT["grey"][: len(ODD_INTACT["grey"]) // 2], "cannot be decoded"),
}


@pytest.mark.parametrize("name", sorted(ODD_DAMAGED))
def test_a_damaged_jpeg_is_a_value_error_saying_what_is_wrong(name: str) -> None:
    data, says = ODD_DAMAGED[name]
    with pytest.raises(ValueError, match=says):
        decode_image(data)


def test_restart_markers_out_of_order_are_damage() -> None:
    cmyk = _odd_jpeg("CMYK", subsampling=2, restart_marker_blocks=2)  # only Pillow reads it: the marker check judges
    first = cmyk.index(b"\xff\xd0", _scan_start(cmyk))
    swapped = cmyk[:first] + b"\xff\xd3" + cmyk[first + 2 :]
    assert decode_image(cmyk).shape == (96, 128, 3)
    with pytest.raises(ValueError, match="restart marker 3"):
        decode_image(swapped)
