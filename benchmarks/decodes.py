"""The per-image work the loaders are held to: decode + centre crop + resize to 256 px by each method, and its quality."""

from __future__ import annotations

import io
from collections.abc import Callable

import numpy as np
from PIL import Image

SIZE = 256


def _square(image: np.ndarray) -> np.ndarray:
    h, w = image.shape[:2]
    side = min(h, w)
    return image[(h - side) // 2 : (h - side) // 2 + side, (w - side) // 2 : (w - side) // 2 + side]


def fast_decode(data: bytes) -> np.ndarray:
    """The fast decode the issue and the referee name: libjpeg-turbo at the tightest M/8 scale >= 256 px, centre crop, linear resize."""
    import cv2
    import simplejpeg

    image = _square(simplejpeg.decode_jpeg(data, "RGB", min_height=SIZE, min_width=SIZE))
    return image if image.shape[0] == SIZE else cv2.resize(image, (SIZE, SIZE), interpolation=cv2.INTER_LINEAR)


def pil_decode(data: bytes) -> np.ndarray:
    """What a usual pipeline does: PIL decode, then torchvision's Resize(256, BICUBIC) + CenterCrop(256) on PIL.

    The whole image is resized so its shorter side is 256, then cropped
    (torchvision's PIL path, which this torch build cannot import beside it).
    """
    image = Image.open(io.BytesIO(data)).convert("RGB")
    scale = SIZE / min(image.size)
    width, height = (
        (SIZE, int(image.height * scale)) if image.width <= image.height else (int(image.width * scale), SIZE)
    )
    image = image.resize((width, height), Image.Resampling.BICUBIC)
    left, top = round((width - SIZE) / 2), round((height - SIZE) / 2)
    return np.asarray(image.crop((left, top, left + SIZE, top + SIZE)))


def to_tensor(image: np.ndarray) -> object:
    """torchvision's ToTensor: float32 [3, H, W] in [0, 1], as a usual torch pipeline hands its images on."""
    import torch

    return torch.from_numpy(image).permute(2, 0, 1).contiguous().to(torch.float32).div(255)


def datacat_decode(data: bytes, into: np.ndarray | None = None) -> np.ndarray:
    """datacat's transform: power-of-two DCT reduction, centre crop, linear resize (into ``into`` when given)."""
    from datacat.transforms.decode import decode_image
    from datacat.transforms.resize import resize_image

    return resize_image(decode_image(data, at_least=SIZE), SIZE, into=into)


METHODS: dict[str, Callable[[bytes], np.ndarray]] = {
    "fast": fast_decode,
    "datacat": datacat_decode,
    "pil": pil_decode,
}


def reference(data: bytes) -> np.ndarray:
    import cv2
    import simplejpeg

    full = _square(simplejpeg.decode_jpeg(data, "RGB").astype(np.float32))
    return cv2.resize(full, (SIZE, SIZE), interpolation=cv2.INTER_AREA)  # type: ignore[no-any-return]


def psnr(image: np.ndarray, truth: np.ndarray) -> float:
    mse = float(np.mean((image.astype(np.float32) - truth) ** 2))
    return 99.0 if mse == 0 else 10 * float(np.log10(255.0**2 / mse))
