"""``datacat verify --deep --runner ...``: the deep check of every record as a Beam job.

``datacat verify`` lists and counts the shards on the machine that runs it
(one request per shard) and writes the manifest there, as without Beam; the
deep part, reading and decoding every record, is the job: one shard per unit
of work (:func:`datacat.verify.bad_records`), each writing its bad records
to a results folder that the starting machine reads back. The folder is
``--temp_location`` when given (a bucket, for Dataflow), else a local
temporary folder.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

import apache_beam as beam
from apache_beam.options.pipeline_options import GoogleCloudOptions

from datacat.beam import commit, counter, run, text_file
from datacat.plan import Plan
from datacat.storage import filesystem, read_bytes
from datacat.transforms.ledger import BadSample

__all__ = ["bad_records_job"]


class _CheckShard(beam.DoFn):  # type: ignore[misc]
    """Reads and decodes every record of one shard; writes its bad ones to ``results/NNNNNN.json``."""

    def __init__(self, plan: Plan, results: str) -> None:
        self.plan, self.results = plan, results
        self.read, self.bad = counter("records_read"), counter("records_bad")

    def setup(self) -> None:
        from datacat.pipeline import SampleSource

        self.source = SampleSource(self.plan)

    def process(self, shard: int) -> Iterator[int]:
        from datacat.verify import bad_records

        bad = bad_records(self.source, shard)
        self.read.inc(self.plan.shards[shard].samples or 0)
        self.bad.inc(len(bad))
        text = json.dumps([dataclasses.asdict(b) for b in bad])
        commit(f"{self.results}/{shard:06d}.json", text_file(text), self.plan.storage_options)
        yield shard


def bad_records_job(plan: Plan, options: Any) -> list[BadSample]:
    """Every bad record of ``plan``'s shards, found by a Beam job on ``options``' runner, in shard order."""
    temp = options.view_as(GoogleCloudOptions).temp_location
    base = temp.rstrip("/") if temp else tempfile.mkdtemp(prefix="datacat-verify-")
    results = f"{base}/datacat-verify-{uuid.uuid4().hex[:12]}"
    pipeline = beam.Pipeline(options=options)
    _ = (
        pipeline
        | "shards" >> beam.Create(range(len(plan.shards)))
        | "spread" >> beam.Reshuffle()
        | "check" >> beam.ParDo(_CheckShard(plan, results))
    )
    run(pipeline)
    bad: list[BadSample] = []
    for shard in range(len(plan.shards)):
        found = json.loads(read_bytes(f"{results}/{shard:06d}.json", plan.storage_options))
        bad += [BadSample(**b) for b in found]
    fs, path = filesystem(results, plan.storage_options)
    fs.rm(path, recursive=True)
    return bad
