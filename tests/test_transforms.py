from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from datacat.transforms.augment import augment_image, image_augmentations, record_rng
from datacat.transforms.captions import PROMPT_TEMPLATES, caption_from_label, record_caption
from datacat.transforms.resize import resize_image


def _halves(height: int, width: int) -> np.ndarray:
    image = np.zeros((height, width, 3), dtype=np.uint8)
    image[:, : width // 2] = (255, 0, 0)
    image[:, width // 2 :] = (0, 0, 255)
    return image


def test_resize_modes() -> None:
    wide = _halves(100, 300)
    crop = resize_image(wide, 50)
    assert crop.shape == (50, 50, 3)
    # The central square of a red|blue image straddles the boundary: both colours, in order.
    assert crop[25, 5, 0] > 200 and crop[25, 44, 2] > 200
    squash = resize_image(wide, 50, mode="squash")
    assert squash[25, 2, 0] == 255 and squash[25, 47, 2] == 255
    pad = resize_image(wide, 60, mode="pad")
    assert pad.shape == (60, 60, 3) and (pad[0] == 255).all() and (pad[-1] == 255).all()
    assert pad[30, 2, 0] == 255 and pad[30, 2, 1] == 0
    up = resize_image(_halves(10, 10), 40)
    assert up.shape == (40, 40, 3)
    with pytest.raises(ValueError, match="unknown resize mode"):
        resize_image(wide, 10, mode="stretch")  # type: ignore[arg-type]


def test_area_down_keeps_mean_colour() -> None:
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, size=(256, 256, 3), dtype=np.uint8)
    small = resize_image(image, 64)
    assert abs(small.mean() - image.mean()) < 1.0


def test_flip_jitter_changes_pixels_and_is_reproducible() -> None:
    image = resize_image(_halves(64, 64), 64)
    image[:, :, 1] = np.arange(64, dtype=np.uint8)[None, :] * 3
    augment = image_augmentations("flip_jitter")
    outs = [augment_image(augment, image, record_rng(7, uid)) for uid in range(8)]
    assert all(out.dtype == np.uint8 and out.shape == image.shape for out in outs)
    assert sum(not np.array_equal(out, image) for out in outs) == 8  # jitter always moves pixels
    again = augment_image(augment, image, record_rng(7, 3))
    np.testing.assert_array_equal(again, outs[3])
    assert not np.array_equal(augment_image(augment, image, record_rng(8, 3)), outs[3])


def test_flip_only_flips_and_none_is_identity() -> None:
    image = _halves(8, 8)
    flip = image_augmentations("flip_only")
    outs = [augment_image(flip, image, record_rng(0, uid)) for uid in range(16)]
    flipped = [np.array_equal(out, image[:, ::-1]) for out in outs]
    kept = [np.array_equal(out, image) for out in outs]
    assert all(f or k for f, k in zip(flipped, kept, strict=True)) and any(flipped) and any(kept)
    assert augment_image(image_augmentations("none"), image, record_rng(0, 0)) is image


def test_captions() -> None:
    assert record_caption({"txt": b" a cat \n"}) == "a cat"
    assert record_caption({"text": "a dog"}) == "a dog"
    assert record_caption({"jpg": b""}) is None
    with pytest.raises(ValueError, match="not utf-8"):
        record_caption({"caption": b"\xff\xfe"})
    caption = caption_from_label(1, ("rose", "tulip"), PROMPT_TEMPLATES, record_rng(0, 5))
    assert "tulip" in caption and caption in {t.format("tulip") for t in PROMPT_TEMPLATES}
    with pytest.raises(ValueError, match="outside the 2 class names"):
        caption_from_label(2, ("rose", "tulip"), PROMPT_TEMPLATES, record_rng(0, 5))


def test_read_ahead_threads_are_for_remote_shards_only() -> None:
    from pathlib import Path

    import datacat
    from datacat.loading.sources import SampleSource, reads_remote

    def moved(plan: datacat.Plan, root: str) -> datacat.Plan:
        return plan.model_copy(
            update={"shards": tuple(s.model_copy(update={"url": root + s.name}) for s in plan.shards)}
        )

    local = datacat.resolve("sample")
    assert not reads_remote(moved(local, "/data/"))
    assert reads_remote(moved(local, "gs://bucket/"))
    mixture = datacat.resolve(
        "mix", catalog=datacat.load_catalog([Path(__file__).parent / "catalogs/valid/mixtures.yaml"])
    )
    remote_part = mixture.components[1].model_copy(update={"plan": moved(mixture.components[1].plan, "gs://bucket/")})
    assert not reads_remote(mixture)
    assert reads_remote(
        mixture.model_copy(update={"components": (mixture.components[0], remote_part)})
    )  # one remote component
    source = SampleSource(datacat.resolve("sample-arrayrecord"))
    assert not source.remote


def test_read_ahead_runs_on_one_thread_kept_across_epochs(monkeypatch: pytest.MonkeyPatch) -> None:
    # A thread started for each epoch's view got a fresh malloc arena, its pages faulted in afresh.
    import threading

    import datacat
    from datacat.loading.batches import BatchView
    from datacat.loading.options import LoadOptions
    from datacat.loading.runs import EpochRun, Epochs
    from datacat.loading.sources import SampleSource

    threads: list[str] = []
    fetch = BatchView._fetch

    def recorded(self: BatchView, batch: int) -> Any:
        threads.append(threading.current_thread().name)
        return fetch(self, batch)

    monkeypatch.setattr(BatchView, "_fetch", recorded)
    source = SampleSource(datacat.resolve("sample", image_size=16))
    epochs = Epochs(source, LoadOptions(batch_size=8, rank=0, world_size=1), name="s", seed=0)
    run = EpochRun(epochs, 0, 0, 3)  # epochs 0, 1 and 2, read as a torch worker reads them
    run.stride(0, 1)
    keys = [key for i in range(len(run)) for key in run[i]["batch"]["key"]]
    run.close()
    assert len(keys) == 3 * 55 and len(set(keys)) == 55
    ahead = [name for name in threads if name != threading.current_thread().name]
    assert len(ahead) >= 3 * 5  # 7 batches an epoch: all but the first of each read ahead
    assert len(set(ahead)) == 1, set(ahead)
