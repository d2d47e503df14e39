"""The loading layer: a Plan's samples as sources, cut into epochs and batches that both backends read.

- :mod:`~datacat.loading.contracts`: what a source, an epoch's records and a loader are (Protocols).
- :mod:`~datacat.loading.options`: the frozen options a loader is opened with.
- :mod:`~datacat.loading.sources`: a Plan's samples by position, and one rank's records of an epoch.
- :mod:`~datacat.loading.mixture`: a mixture, the composite source of several.
- :mod:`~datacat.loading.shuffle` and :mod:`~datacat.loading.epochs`: an epoch's order and its schedule.
- :mod:`~datacat.loading.batches` and :mod:`~datacat.loading.collate`: batches, read ahead and collated.
- :mod:`~datacat.loading.runs`: epochs of batches as workers read them; :mod:`~datacat.loading.state`: resuming.

Importing this package imports nothing else; its modules need numpy, except ``contracts`` and ``options``.
"""
