"""YAML as data only: safe tags, no duplicate keys, bounded aliases, and the line of every key.

``yaml.safe_load`` semantics (a ``!!python/...`` tag is refused), plus what
validation messages need and PyYAML does not keep: the line each key path
starts on, and a refusal of repeated keys (PyYAML silently keeps the last).
Aliases may share a value, but a document whose aliases add more than
``MAX_ALIASED`` values to it (a "billion laughs" bomb) is refused before
anything is expanded. libyaml's parser is used where PyYAML has it (5x faster, same marks), and
the document is built in the same walk that records the lines, with the common scalars (strings,
plain decimal integers) made directly; every other node goes through PyYAML's safe constructor.
"""

from __future__ import annotations

from typing import Any

import yaml

from datacat.errors import Problem

__all__ = ["MAX_ALIASED", "KeyPath", "load_yaml"]

KeyPath = tuple[str | int, ...]
MAX_ALIASED = 100_000
"""Values that aliases may add to a catalog file beyond those it spells out."""
_ENDLESS = 1 << 62
_STR = "tag:yaml.org,2002:str"
_INT = "tag:yaml.org,2002:int"
_MAP = "tag:yaml.org,2002:map"
_SEQ = "tag:yaml.org,2002:seq"


class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """The safe loader, with the two commonest plain scalars tagged without trying every pattern."""

    def resolve(self, kind: Any, value: Any, implicit: Any) -> Any:
        if kind is yaml.ScalarNode and implicit[0] and value:
            if value[0] not in self.yaml_implicit_resolvers and None not in self.yaml_implicit_resolvers:
                # no pattern starts so: a string
                return _STR
            if value.isdigit() and (value[0] != "0" or value == "0"):
                return _INT
        return super().resolve(kind, value, implicit)


def load_yaml(text: str, file: str) -> tuple[Any, dict[KeyPath, int], list[Problem]]:
    """The document in ``text``, the 1-based line of each key path, and its problems.

    A document with problems yields ``None`` as its data; every problem found
    is reported, not only the first.
    """
    loader = _Loader(text)
    lines: dict[KeyPath, int] = {}
    problems: list[Problem] = []
    try:
        node = loader.get_single_node()
        if node is None:
            return None, lines, problems
        sizes: dict[int, int] = {}
        built: dict[int, Any] = {}
        data = _build(node, (), lines, problems, file, sizes, built, loader)
        if sizes[id(node)] - len(sizes) > MAX_ALIASED:
            problems.append(
                Problem(
                    file,
                    None,
                    "",
                    f"its aliases add more than {MAX_ALIASED:,} values (a YAML alias bomb?); write the values out",
                )
            )
            return None, lines, problems
        if problems:
            return None, lines, problems
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else None
        reason = exc.problem or str(exc)
        if isinstance(exc, yaml.constructor.ConstructorError) and "tag" in reason:
            reason = f"{reason}; catalog files are data only, remove the tag"
        problems.append(Problem(file, line, "", f"invalid YAML: {reason}"))
        return None, lines, problems
    except yaml.YAMLError as exc:
        problems.append(Problem(file, None, "", f"invalid YAML: {exc}"))
        return None, lines, problems
    finally:
        loader.dispose()
    return data, lines, problems


def _build(
    node: yaml.Node,
    path: KeyPath,
    lines: dict[KeyPath, int],
    problems: list[Problem],
    file: str,
    sizes: dict[int, int],
    built: dict[int, Any],
    loader: Any,
) -> Any:
    """The value of ``node``, recording the line of each key path under it and how many values it expands to.

    Each node is walked once (an alias is the same node object again, and
    gets the same value), so this costs the document as written, not its
    expansion; ``sizes`` then tells what the expansion would be. Plain
    sequences and mappings of plain keys are built here; merge keys, complex
    keys and explicit tags are walked for their lines, then built by PyYAML.
    """
    lines.setdefault(path, node.start_mark.line + 1)
    if id(node) in sizes:  # an alias: its keys were indexed where the anchor is
        return built.get(id(node))
    sizes[id(node)] = _ENDLESS  # a node inside itself (a recursive alias) expands without end
    total, plain = 1, node.tag in (_MAP, _SEQ) and (not isinstance(node, yaml.MappingNode) or _plain_keys(node))
    value: Any = None
    if isinstance(node, yaml.ScalarNode):
        value = _scalar(node, loader)
    elif isinstance(node, yaml.SequenceNode):
        value = built[id(node)] = []
        for i, item in enumerate(node.value):
            value.append(_build(item, (*path, i), lines, problems, file, sizes, built, loader))
            total += sizes[id(item)]
    elif isinstance(node, yaml.MappingNode):
        value = built[id(node)] = {}
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value)
            line = key_node.start_mark.line + 1
            if key in seen:
                dotted = ".".join(str(p) for p in (*path, key))
                problems.append(Problem(file, line, dotted, f"duplicate key (first at line {seen[key]}); keep one"))
                continue
            seen[key] = line
            lines[(*path, key)] = line
            item = _build(value_node, (*path, key), lines, problems, file, sizes, built, loader)
            if plain:
                value[_scalar(key_node, loader)] = item
            total += sizes[id(value_node)]
    if not plain and not isinstance(node, yaml.ScalarNode):
        value = loader.construct_object(node, deep=True)  # expands nothing: PyYAML shares aliased values too
    built[id(node)] = value
    sizes[id(node)] = min(total, _ENDLESS)
    return value


def _scalar(node: yaml.Node, loader: Any) -> Any:
    if node.tag == _STR:
        return node.value
    if node.tag == _INT and node.value.isdigit() and (node.value[0] != "0" or node.value == "0"):
        return int(node.value)
    return loader.construct_object(node)


def _plain_keys(node: yaml.MappingNode) -> bool:
    return all(isinstance(k, yaml.ScalarNode) and k.tag in (_STR, _INT) for k, _ in node.value)
