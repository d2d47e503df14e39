"""Shard name patterns: webdataset's brace notation, expanded in a stable order.

``{00000..00049}.array_record`` is fifty names, zero-padded to the width of
the written bounds; ``{a,b}`` is an alternation; several groups multiply.
"""

from __future__ import annotations

import itertools
import re

__all__ = ["beside", "brace_numbers", "expand_braces"]

_GROUP = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(\d+)\.\.(\d+)$")


def expand_braces(pattern: str) -> list[str]:
    """Every name ``pattern`` denotes, in the order its groups enumerate.

    Raises ``ValueError`` for a malformed group (unbalanced or reversed range).
    """
    parts: list[list[str]] = []
    pos = 0
    for match in _GROUP.finditer(pattern):
        parts.append([pattern[pos : match.start()]])
        parts.append(_expand_group(match.group(1), pattern))
        pos = match.end()
    tail = pattern[pos:]
    if "{" in tail or "}" in tail:
        raise ValueError(f"unbalanced brace in shard pattern {pattern!r}")
    parts.append([tail])
    return ["".join(combo) for combo in itertools.product(*parts)]


def brace_numbers(pattern: str) -> range | None:
    """The numeric range of a pattern with exactly one ``{lo..hi}`` group, else None."""
    groups = _GROUP.findall(pattern)
    ranges = [m for g in groups if (m := _RANGE.match(g))]
    if len(groups) != 1 or len(ranges) != 1:
        return None
    return range(int(ranges[0].group(1)), int(ranges[0].group(2)) + 1)


def _expand_group(body: str, pattern: str) -> list[str]:
    if match := _RANGE.match(body):
        lo, hi = match.group(1), match.group(2)
        if int(hi) < int(lo):
            raise ValueError(f"reversed range {{{body}}} in shard pattern {pattern!r}")
        # braceexpand's rule: a leading zero on either bound pads every number to the wider one
        padded = (lo.startswith("0") and len(lo) > 1) or (hi.startswith("0") and len(hi) > 1)
        width = max(len(lo), len(hi)) if padded else 0
        return [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
    if "," in body:
        return body.split(",")
    raise ValueError(f"brace group {{{body}}} in shard pattern {pattern!r} is neither lo..hi nor a,b")


def beside(shard_url: str, suffix: str) -> str:
    """The file img2dataset writes beside a tar shard: ``.../00012.tar`` (or ``.tar.gz``, ``.tgz``) and ``.parquet``
    give ``.../00012.parquet``; ``_stats.json`` gives ``.../00012_stats.json``."""
    for ending in (".tar.gz", ".tgz", ".tar"):
        if shard_url.endswith(ending):
            return shard_url[: -len(ending)] + suffix
    return shard_url.rsplit(".", 1)[0] + suffix
