"""The exceptions datacat raises.

::

    DatacatError                      every error datacat raises itself
    ├── CatalogError(ValueError)      catalog files that do not validate; .problems lists them
    ├── EntryNotFound(KeyError)       no entry of that name or alias; .suggestions
    ├── OptionError(ValueError)       a loading option or split that the entry cannot take
    ├── PlanMismatch(ValueError)      a loader state saved for another Plan
    ├── ShardError                    a shard that cannot be read; names the shard
    │   └── RecordError(ValueError)   one record that cannot be parsed; names shard and index/key
    ├── BadSampleBudgetExceeded       the skip policy met more bad samples than it may drop
    └── BackendUnavailable(ImportError)  a framework extra that is not installed

A missing file stays the built-in ``FileNotFoundError`` with the URL as its
filename, so ``except FileNotFoundError`` works as it does for ``open``.
Other failures of storage (the network, credentials, a storage client's own
exceptions) become a ``ShardError`` naming the URL, mapped once by type at
the storage boundary (:mod:`datacat.storage.errors`); any other exception is
a bug and propagates as it is.
"""

from __future__ import annotations

import dataclasses

__all__ = [
    "BackendUnavailable",
    "BadSampleBudgetExceeded",
    "CatalogError",
    "DatacatError",
    "EntryNotFound",
    "OptionError",
    "PlanMismatch",
    "Problem",
    "RecordError",
    "ShardError",
]


class DatacatError(Exception):
    """Base class of every error datacat raises itself."""


@dataclasses.dataclass(frozen=True, order=True)
class Problem:
    """One validation problem: where it is, which key, and what is wrong."""

    file: str
    line: int | None
    path: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        return f"{where} {self.path}: {self.message}" if self.path else f"{where} {self.message}"


class CatalogError(DatacatError, ValueError):
    """Catalog files that do not validate; ``problems`` lists every one."""

    def __init__(self, problems: list[Problem] | tuple[Problem, ...]) -> None:
        self.problems = tuple(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


class EntryNotFound(DatacatError, KeyError):
    """No catalog entry has that name or alias."""

    def __init__(self, name: str, suggestions: list[str] | tuple[str, ...] = ()) -> None:
        self.name = name
        self.suggestions = tuple(suggestions)
        hint = f" Did you mean {' or '.join(repr(s) for s in self.suggestions)}?" if self.suggestions else ""
        super().__init__(f"No catalog entry {name!r}.{hint} Run `datacat list` to see them all.")

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class OptionError(DatacatError, ValueError):
    """A loading option, split or root that the entry cannot take."""


class PlanMismatch(DatacatError, ValueError):
    """A saved loader state belongs to a different Plan than the loader's."""


class ShardError(DatacatError):
    """A shard that cannot be opened or read; the message names the shard, ``url`` holds it where known."""

    def __init__(self, message: str, *, url: str | None = None, key: str | None = None) -> None:
        super().__init__(message)
        self.url = url
        self.key = key


class RecordError(ShardError, ValueError):
    """One record that cannot be parsed; the message names shard and record."""


class BadSampleBudgetExceeded(DatacatError):
    """The ``skip`` policy met more bad samples than its budget allows."""


class FunctionError(DatacatError):
    """A user's function (``--fn module:name``) raised: the message names it, the record and its error."""


class BackendUnavailable(DatacatError, ImportError):
    """A framework extra that is not installed; the message says what to install."""
