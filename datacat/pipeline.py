"""Former home of the sources, views and batches, now in :mod:`datacat.loading`; kept until imports are repointed.

Import from :mod:`datacat.loading.sources`, :mod:`datacat.loading.batches`
and :mod:`datacat.loading.collate` instead.
"""

from datacat.loading.batches import Allocate, BatchView
from datacat.loading.collate import collate_numpy
from datacat.loading.sources import EpochView, Fetched, SampleSource, finish, selected_range

__all__ = ["Allocate", "BatchView", "EpochView", "Fetched", "SampleSource", "collate_numpy", "finish", "selected_range"]
