"""A format is one module and one registry line: a new one reads, describes, counts and validates like the built-in ones."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from helpers import jpeg

import datacat
from datacat import registry
from datacat.cli import main

# A format a user might add: JSON-lines shards, one image (base64) and its caption per line.
JSONL_FORMAT = """
from __future__ import annotations

import base64
import json
from typing import Any, Literal

from datacat.formats import RawItem
from datacat.storage import read_bytes
from datacat.registry import Format


class JsonLinesReader:
    random_access: Literal[True] = True

    def __init__(self, plan: Any) -> None:
        self.lines = []
        for shard in plan.shards:
            rows = read_bytes(shard.url).decode().splitlines()
            self.lines += [(shard.url, i, row) for i, row in enumerate(rows)]
        self.counts = [sum(1 for url, _, _ in self.lines if url == s.url) for s in plan.shards]

    def __len__(self) -> int:
        return len(self.lines)

    def items(self, indices):
        return [RawItem(f"{i}", self.lines[i][0], i, self.lines[i][2]) for i in indices]

    def parse(self, item: RawItem) -> dict[str, Any]:
        row = json.loads(item.payload)
        image = base64.b64decode(row["jpeg"])
        return {"__key__": row["key"], "__shard__": item.shard, "__uid__": item.uid, "image": image, "caption": row["caption"]}


def _contract(plan: Any) -> list[str]:
    return ["Each line is a JSON object with key, caption and jpeg (base64)."]


FORMAT = Format(
    JsonLinesReader,
    "random",
    ("lines",),
    _contract,
    names_a_shard=lambda name: name.endswith(".jsonl"),
    shards_are="its shards are .jsonl files",
)
"""


@pytest.fixture
def jsonl_format(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The format's module on the path and its one registry line."""
    (tmp_path / "jsonl_format.py").write_text(JSONL_FORMAT)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(registry.FORMATS, "jsonl", "jsonl_format")
    monkeypatch.setattr(registry, "_LOADED", {})
    yield tmp_path
    sys.modules.pop("jsonl_format", None)


def _shards(folder: Path) -> None:
    for shard, keys in (("0.jsonl", "abc"), ("1.jsonl", "de")):
        rows = [
            json.dumps({"key": k, "caption": f"caption {k}", "jpeg": base64.b64encode(jpeg(ord(k))).decode()})
            for k in keys
        ]
        (folder / shard).write_text("\n".join(rows) + "\n")


def test_a_new_format_is_one_module_and_one_registry_line(jsonl_format: Path) -> None:
    _shards(jsonl_format)
    (jsonl_format / "c.yaml").write_text(
        "lines:\n  description: d\n  format: jsonl\n  location: {root: ., shards: ['0.jsonl', '1.jsonl']}\n"
    )
    catalog = datacat.load_catalog([jsonl_format / "c.yaml"])
    plan = datacat.resolve("lines", catalog=catalog, image_size=16)
    assert plan.record.layout == "lines"  # the format's first layout is the default
    assert (
        "Each line is a JSON object with key, caption and jpeg (base64)."
        in datacat.describe("lines", catalog=catalog)["contract"]
    )

    loader = datacat.open(
        "lines", framework="torch", batch_size=5, catalog=catalog, image_size=16, shuffle=False, val_batches=0
    )
    (batch,) = list(loader)
    assert batch["key"] == ["a", "b", "c", "d", "e"] and batch["caption"][3] == "caption d"
    assert np.asarray(batch["image"]).shape == (5, 16, 16, 3)

    counted = CliRunner().invoke(main, ["--catalog", str(jsonl_format / "c.yaml"), "count", "lines"])
    assert counted.exit_code == 0, counted.output
    assert "per_shard: {0.jsonl: 3, 1.jsonl: 2}" in counted.output


def test_a_new_format_validates_its_layouts_and_shard_names(jsonl_format: Path) -> None:
    (jsonl_format / "c.yaml").write_text(
        "lines:\n  description: d\n  format: jsonl\n  location: {root: ., shards: ['0.tar']}\n  record: {layout: packed}\n"
    )
    with pytest.raises(datacat.CatalogError) as raised:
        datacat.load_catalog([jsonl_format / "c.yaml"])
    message = str(raised.value)
    assert "'packed' is not a layout of format 'jsonl' (use one of lines)" in message
    assert "'0.tar' is not a shard of format 'jsonl': its shards are .jsonl files" in message
