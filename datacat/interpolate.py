"""``${VAR}`` and ``${VAR:-default}`` in catalog strings, and nothing else.

Catalog files are data: no expressions, no commands, only environment
variables with an optional default, so a bucket or a token can differ per
user without a second copy of the entry.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["interpolate", "interpolate_all", "unset_variables"]

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def interpolate(value: str, env: Mapping[str, str] | None = None) -> str:
    """``value`` with every ``${VAR}`` replaced; raises ``KeyError(VAR)`` for an unset one without default."""
    env = os.environ if env is None else env

    def replace(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        if name in env:
            return env[name]
        if default is not None:
            return default
        raise KeyError(name)

    return _VAR.sub(replace, value)


def interpolate_all(value: Any, env: Mapping[str, str] | None = None) -> Any:
    """A copy of a nested dict/list/str structure with every string interpolated."""
    if isinstance(value, str):
        return interpolate(value, env)
    if isinstance(value, Mapping):
        return {k: interpolate_all(v, env) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(interpolate_all(v, env) for v in value)
    return value


def unset_variables(value: Any, env: Mapping[str, str] | None = None) -> Iterator[tuple[tuple[str | int, ...], str]]:
    """The (key path, variable) pairs in a nested structure that ``interpolate`` would refuse."""
    env = os.environ if env is None else env
    if isinstance(value, str):
        for match in _VAR.finditer(value):
            if match.group(1) not in env and match.group(2) is None:
                yield (), match.group(1)
    elif isinstance(value, Mapping):
        for k, v in value.items():
            for path, name in unset_variables(v, env):
                yield (k, *path), name
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            for path, name in unset_variables(v, env):
                yield (i, *path), name
