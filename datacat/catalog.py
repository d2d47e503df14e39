"""Finding, loading and validating catalog files, and looking entries up by name.

The built-in catalog ships inside the package; user catalogs add to it or
override its entries, from ``DATACAT_CATALOG`` (paths separated by
``os.pathsep``) and from ``paths=`` (the CLI's ``--catalog``), later ones
winning. A file is a mapping of entry name to entry; a folder means every
``*.yaml``/``*.yml`` file in it.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from datacat._yaml import KeyPath, load_yaml
from datacat.cache import cache_dir
from datacat.errors import CatalogError, EntryNotFound, Problem
from datacat.rules import check_catalog, check_entry
from datacat.schema import Entry

__all__ = ["Catalog", "CatalogPaths", "EntrySource", "builtin_catalog_dir", "catalog_paths", "load_catalog"]

ENV_VAR = "DATACAT_CATALOG"


@dataclasses.dataclass(frozen=True)
class EntrySource:
    """Where an entry was read from, and which earlier definitions it overrides."""

    file: str
    line: int | None
    overrides: tuple[str, ...] = ()

    @property
    def folder(self) -> Path:
        """The folder relative roots of the entry are taken from."""
        return Path(self.file).resolve().parent


class Catalog(Mapping[str, Entry]):
    """Validated entries by name, with case-insensitive lookup through names and aliases."""

    def __init__(self, entries: Mapping[str, Entry], sources: Mapping[str, EntrySource]) -> None:
        self._entries = dict(sorted(entries.items(), key=lambda kv: kv[0].casefold()))
        self.sources = dict(sources)
        self._names: dict[str, str] = {}
        for name, entry in self._entries.items():
            for alias in (name, *entry.aliases):
                self._names[alias.casefold()] = name

    def __getitem__(self, name: str) -> Entry:
        return self._entries[self.canonical(name)]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.casefold() in self._names

    def canonical(self, name: str) -> str:
        """The entry name that ``name`` (any case, or an alias) refers to."""
        try:
            return self._names[name.casefold()]
        except KeyError:
            close = difflib.get_close_matches(name.casefold(), self._names, n=3, cutoff=0.6)
            suggestions = list(dict.fromkeys(self._names[c] for c in close))
            raise EntryNotFound(name, suggestions) from None


def builtin_catalog_dir() -> Path:
    """The folder of the built-in catalog: inside the installed package, or the repo's ``catalog/``."""
    packaged = Path(str(resources.files("datacat"))) / "_catalog"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "catalog"


CatalogPaths = str | os.PathLike[str] | Iterable[str | os.PathLike[str]]
"""One catalog file or folder, or several: a single ``str`` is one path, never its characters."""


def _as_paths(paths: CatalogPaths) -> list[Path]:
    if isinstance(paths, str | os.PathLike):
        return [Path(paths)]
    return [Path(p) for p in paths]


def catalog_paths(paths: CatalogPaths = (), *, builtin: bool = True) -> list[Path]:
    """The catalog paths in the order they apply: built-in, ``DATACAT_CATALOG``, then ``paths``."""
    return [path for path, _ in _sourced_paths(paths, builtin=builtin, named_by="paths")]


def _sourced_paths(paths: CatalogPaths, *, builtin: bool, named_by: str) -> list[tuple[Path, str]]:
    """Each catalog path with what named it (for the error when it does not exist)."""
    found = [(builtin_catalog_dir(), "the built-in catalog")] if builtin else []
    env = os.environ.get(ENV_VAR, "")
    found += [(Path(p), ENV_VAR) for p in env.split(os.pathsep) if p]
    found += [(p, named_by) for p in _as_paths(paths)]
    return found


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())
    return [path]


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def load_catalog(
    paths: CatalogPaths = (),
    *,
    builtin: bool = True,
    env: Mapping[str, str] | None = None,
    named_by: str = "load_catalog(paths=...)",
) -> Catalog:
    """The validated catalog from the built-in entries, ``DATACAT_CATALOG`` and ``paths``.

    ``paths`` is one catalog file or folder (a ``str`` or path), or a list
    of them. ``named_by`` is how the caller's paths are named when one does
    not exist (the CLI passes ``--catalog``).

    Raises ``CatalogError`` listing every problem in every file, one line
    each with file, line, key path and rule.
    """
    problems: list[Problem] = []
    entries: dict[str, Entry] = {}
    sources: dict[str, EntrySource] = {}
    lines: dict[str, tuple[str, dict[KeyPath, int]]] = {}
    folded: dict[str, str] = {}
    for layer, origin in _sourced_paths(paths, builtin=builtin, named_by=named_by):
        layer_names: dict[str, str] = {}
        if not layer.exists():
            problems.append(Problem(_display(layer), None, "", f"no such catalog file or folder (from {origin})"))
            continue
        for file in _files(layer):
            shown = _display(file)
            for name, entry, entry_lines, line in _read_file(file, shown, problems):
                key = name.casefold()
                if key in layer_names:
                    problems.append(
                        Problem(shown, line, name, f"entry defined twice in one catalog (also in {layer_names[key]})")
                    )
                    continue
                layer_names[key] = shown
                overrides: tuple[str, ...] = ()
                if key in folded:
                    previous = folded.pop(key)
                    overrides = (*sources[previous].overrides, sources[previous].file)
                    del entries[previous], sources[previous]
                folded[key] = name
                entries[name] = entry
                sources[name] = EntrySource(shown, line, overrides)
                lines[name] = (shown, entry_lines)
    for name, entry in entries.items():
        problems += _located(check_entry(name, entry, env), lines)
    # Entries that failed their schema still exist for references to them.
    unparsed = {p.path.split(".")[0] for p in problems if p.path}
    problems += _located(check_catalog(entries, also_known=unparsed), lines)
    if problems:
        raise CatalogError(sorted(set(problems), key=lambda p: (p.file, p.line or 0, p.path)))
    return Catalog(entries, sources)


def _read_file(
    file: Path, shown: str, problems: list[Problem]
) -> Iterator[tuple[str, Entry, dict[KeyPath, int], int | None]]:
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        problems.append(Problem(shown, None, "", f"cannot read: {exc}"))
        return
    data, lines, found = _parse(text, shown)
    problems += found
    if found or data is None:
        return
    if not isinstance(data, dict):
        problems.append(Problem(shown, lines.get((), 1), "", "a catalog file is a mapping of entry name to entry"))
        return
    for name, body in data.items():
        line = lines.get((name,))
        if not isinstance(name, str) or not name.strip():
            problems.append(Problem(shown, line, str(name), "an entry name is a non-empty string"))
            continue
        try:
            entry = Entry.model_validate(body)
        except ValidationError as exc:
            errors = exc.errors()
            # A failing item also fails its container's length check; report the item only.
            locs = [tuple(e["loc"]) for e in errors]
            deepest = [
                e
                for e in errors
                if not any(len(o) > len(e["loc"]) and o[: len(e["loc"])] == tuple(e["loc"]) for o in locs)
            ]
            problems += _problems_of(shown, lines, name, deepest)
            continue
        yield name, entry, lines, line


_KEEP_PARSED = 64 * 1024
"""Files at least this long (a 10k-shard ``per_shard``) are kept parsed in the cache, by their text's hash."""


def _parse(text: str, shown: str) -> tuple[Any, dict[KeyPath, int], list[Problem]]:
    # Parsing a 10k-shard entry costs ~0.1 s of a `describe`; its JSON, ~0.01 s. Keyed by the text itself,
    # so an edited file is parsed again; JSON is data only, like the YAML it stands for.
    if len(text) < _KEEP_PARSED:
        return load_yaml(text, shown)
    path = cache_dir() / "parsed" / f"{hashlib.sha256(f'1:{text}'.encode()).hexdigest()[:32]}.json"
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        return saved["data"], {tuple(k): v for k, v in saved["lines"]}, []
    except (OSError, ValueError, KeyError, TypeError):
        pass
    data, lines, found = load_yaml(text, shown)
    if not found:
        try:
            payload = json.dumps({"data": data, "lines": [[list(k), v] for k, v in lines.items()]})
            if json.loads(payload)["data"] == data:  # dates or integer keys do not survive JSON: not kept
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f".{path.name}.{os.getpid()}")
                tmp.write_text(payload, encoding="utf-8")
                os.replace(tmp, path)
        except (TypeError, ValueError, OSError):
            pass  # a read-only cache costs the parse again next time
    return data, lines, found


def _problems_of(file: str, lines: Mapping[KeyPath, int], name: str, errors: list[Any]) -> list[Problem]:
    # A misspelt key is both unknown and, for the key it meant, missing: say it once, with the fix.
    missing = {tuple(e["loc"]) for e in errors if e["type"] == "missing"}
    hints: dict[int, str] = {}
    for i, err in enumerate(errors):
        if err["type"] == "extra_forbidden":
            parent, key = tuple(err["loc"][:-1]), str(err["loc"][-1])
            meant = [loc for loc in missing if loc[:-1] == parent and difflib.get_close_matches(key, [str(loc[-1])])]
            if meant:
                missing.discard(meant[0])
                hints[i] = f"unknown key; did you mean {meant[0][-1]!r}?"
    return [
        _problem(file, lines, name, err, hint=hints.get(i, ""))
        for i, err in enumerate(errors)
        if err["type"] != "missing" or tuple(err["loc"]) in missing
    ]


def _problem(file: str, lines: Mapping[KeyPath, int], name: str, err: Mapping[str, Any], hint: str = "") -> Problem:
    loc = tuple(str(p) if not isinstance(p, int) else p for p in err["loc"])
    # pydantic puts the tried member of a union in the path ("str", "tuple[...]"); drop it.
    loc = tuple(p for p in loc if not (isinstance(p, str) and ("[" in p or p in {"str", "int", "float", "bool"})))
    path = (name, *loc)
    line = _line(lines, path)
    kind = err["type"]
    if hint:
        message = hint
    elif kind == "extra_forbidden":
        message = "unknown key; see `datacat schema` for the keys an entry may have"
    elif kind == "missing":
        message = "required key is missing"
    else:
        message = f"{err['msg']} (got {err.get('input')!r})"
    return Problem(file, line, ".".join(str(p) for p in path), message)


def _line(lines: Mapping[KeyPath, int], path: Sequence[str | int]) -> int | None:
    for end in range(len(path), 0, -1):
        if (found := lines.get(tuple(path[:end]))) is not None:
            return found
    return None


def _located(
    findings: Iterable[tuple[str, KeyPath, str]], lines: Mapping[str, tuple[str, dict[KeyPath, int]]]
) -> list[Problem]:
    out = []
    for name, path, message in findings:
        file, entry_lines = lines[name]
        full = (name, *path)
        out.append(Problem(file, _line(entry_lines, full), ".".join(str(p) for p in full), message))
    return out
