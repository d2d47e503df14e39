"""Former home of the mixture, now :mod:`datacat.loading.mixture`; kept until imports are repointed."""

from datacat.loading.mixture import Draws, MixtureSource, MixtureView, open_source

__all__ = ["Draws", "MixtureSource", "MixtureView", "open_source"]
