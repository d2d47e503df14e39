"""A contact sheet of one batch: each image with its caption, so a person can see what the model sees."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

__all__ = ["contact_sheet"]


def contact_sheet(
    images: np.ndarray, captions: Sequence[str], path: str | Path, *, columns: int = 8, cell: int = 160
) -> Path:
    """Writes a PNG grid of ``images`` (uint8 [B, H, W, 3]) captioned below, and returns its path."""
    count = len(images)
    if count == 0:
        raise ValueError("no images to draw: the batch is empty")
    columns = min(columns, count)
    rows = math.ceil(count / columns)
    text_lines, line_height = 3, 12
    height = cell + text_lines * line_height + 6
    sheet = Image.new("RGB", (columns * cell, rows * height), "white")
    draw = ImageDraw.Draw(sheet)
    font = ImageFont.load_default()
    for i, (pixels, caption) in enumerate(zip(images, captions, strict=False)):
        x, y = (i % columns) * cell, (i // columns) * height
        thumb = Image.fromarray(np.ascontiguousarray(pixels)).resize((cell - 4, cell - 4), Image.Resampling.BILINEAR)
        sheet.paste(thumb, (x + 2, y + 2))
        for j, line in enumerate(textwrap.wrap(caption, width=max(10, cell // 6))[:text_lines]):
            draw.text((x + 3, y + cell + j * line_height), line, fill="black", font=font)
    out = Path(path)
    sheet.save(out)
    return out
