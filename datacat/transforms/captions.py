"""Captions: the record's own text, or a class label put into a prompt template."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from datacat.formats import record_caption

__all__ = ["PROMPT_TEMPLATES", "Tokenize", "caption_from_label", "class_names", "record_caption"]

Tokenize = Callable[[str], Any]

PROMPT_TEMPLATES = (
    "a photo of a {}",
    "a photo of a {} flower",
    "This is a photo of a {}",
    "This is a photo of a {} flower",
    "A photo of a {} flower",
)


@functools.lru_cache(maxsize=16)
def class_names(path: str) -> tuple[str, ...]:
    """The class names of a labels file (path or fsspec URL), one per line, read once per process."""
    import fsspec  # only datasets captioned from labels read a names file

    with fsspec.open(path, "rt", encoding="utf-8") as f:
        names = tuple(line.strip() for line in f if line.strip())
    if not names:
        raise ValueError(f"class names file {path} is empty")
    return names


def caption_from_label(label: int, names: Sequence[str], templates: Sequence[str], rng: np.random.Generator) -> str:
    """A caption for class ``label``: one of ``templates`` drawn by the record's rng, filled with its name."""
    if not 0 <= label < len(names):
        raise ValueError(f"label {label} is outside the {len(names)} class names")
    template = templates[int(rng.integers(len(templates)))] if templates else "{}"
    return template.format(names[label])
