"""The catalog file reference, written at build time from the schema's own models and field docstrings.

mkdocs runs this module as a hook (``hooks:`` in mkdocs.yml). ``on_files`` adds a generated page,
``catalog-reference.md``, that walks :class:`datacat.schema.Entry` and every model nested in it: one section
per model (its docstring, then a table of its keys with type, default and the field's own docstring). Nothing
is written into ``docs/``, so the page cannot drift from ``datacat/schema.py``. ``formats.md`` is generated
the same way from each registered format's declaration (its doc, layouts, batch keys and options model).
"""

from __future__ import annotations

import enum
import types
import typing
from collections.abc import Iterator
from typing import Any

import annotated_types
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from pydantic import BaseModel, ByteSize
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

PAGE = "catalog-reference.md"
FORMATS_PAGE = "formats.md"

INTRO = """\
# Catalog file reference

A catalog file is a YAML mapping of entry name to entry. Files are read with `yaml.safe_load` semantics
(no `!!python` tags); a repeated key is an error, and so is a key that no model below names (a misspelt key
is refused, not ignored). Every problem in every file is reported at once, one line each, with the file,
line, key path and rule:

```
tests/catalogs/invalid/five_mistakes.yaml:18 three.location.missing.0: 50 is outside 0..49
```

`datacat validate FILE...` checks files; `datacat schema` prints the JSON Schema of a catalog file for editor
completion (e.g. `# yaml-language-server: $schema=datacat-schema.json`). Structure and types are checked by
the models below; rules that relate fields to each other (missing shards inside the pattern, declared counts
against the pattern, mixture references, a format's required sections) are checked after them.

This page is generated from `datacat/schema.py` when the site is built: each section is one model, its text
the model's docstring, each row one key with the field's own docstring. A key whose meaning is empty has no
docstring in the schema yet.
"""


def _models(root: type[BaseModel]) -> Iterator[tuple[str, type[BaseModel]]]:
    """Yields (key path, model) for the root and every model nested in it, breadth first, each model once."""
    seen: set[type[BaseModel]] = set()
    queue: list[tuple[str, type[BaseModel]]] = [("", root)]
    while queue:
        path, model = queue.pop(0)
        if model in seen:
            continue
        seen.add(model)
        yield path, model
        for name, field in model.model_fields.items():
            for nested, suffix in _nested_models(field.annotation):
                queue.append((f"{path}.{name}{suffix}".lstrip("."), nested))


def _nested_models(annotation: Any) -> Iterator[tuple[type[BaseModel], str]]:
    """Yields the models an annotation holds, with the key-path suffix that reaches them (`.<name>`, `[]`)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation, ""
        return
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        yield from _nested_models(args[0])
    elif origin is dict and len(args) == 2:
        for model, suffix in _nested_models(args[1]):
            yield model, ".<name>" + suffix
    elif origin in (tuple, list):
        for arg in args:
            if arg is not Ellipsis:
                for model, suffix in _nested_models(arg):
                    yield model, "[]" + suffix
    elif origin in (typing.Union, types.UnionType):
        for arg in args:
            yield from _nested_models(arg)


def _anchor(model: type[BaseModel]) -> str:
    return model.__name__.lower()


_BOUNDS = (
    (annotated_types.Gt, "gt", "> {}"),
    (annotated_types.Ge, "ge", ">= {}"),
    (annotated_types.Lt, "lt", "< {}"),
    (annotated_types.Le, "le", "<= {}"),
    (annotated_types.MinLen, "min_length", "at least {} item(s)"),
)


def _constraints(metadata: list[Any]) -> str:
    """The bounds a field declares (`Field(gt=0)`, `annotated_types.Ge(0)`), as `> 0`, `>= 0` ..."""
    parts = []
    for item in metadata:
        if isinstance(item, FieldInfo):
            parts.append(_constraints(list(item.metadata)))
            continue
        for kind, attr, shown in _BOUNDS:
            if isinstance(item, kind):
                parts.append(shown.format(getattr(item, attr)))
    return ", ".join(part for part in parts if part)


def _type(annotation: Any) -> str:
    """Markdown for a field's type: models link to their section, literals list their values."""
    if annotation is None or annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{_anchor(annotation)})"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " \\| ".join(f"`{member.value!r}`" for member in annotation)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        bound = _constraints(list(args[1:]))
        return _type(args[0]) + (f" ({bound})" if bound else "")
    if origin is typing.Literal:
        return " \\| ".join(f"`{arg}`" for arg in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type(arg) for arg in args)
    if origin is dict:
        return f"mapping of {_type(args[0])} to {_type(args[1])}"
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {_type(args[0])}"
        return "[" + ", ".join(_type(arg) for arg in args) + "]"
    if origin is list:
        return f"list of {_type(args[0])}"
    if annotation is ByteSize:
        return "size (`37 GiB`, `550GB` or bytes)"
    names = {str: "string", int: "integer", float: "number", bool: "boolean"}
    if annotation in names:
        return names[annotation]
    if annotation is Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "**required**"
    value = field.get_default(call_default_factory=True) if field.default is PydanticUndefined else field.default
    if value is None:
        return "null"
    if isinstance(value, BaseModel):
        return "(each key's default)"
    if isinstance(value, tuple | list | dict) and not value:
        return "`[]`" if not isinstance(value, dict) else "`{}`"
    if isinstance(value, ByteSize):
        return f"`{value.human_readable(separator=' ')}`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`' if value == "" else f"`{value}`"
    return f"`{value}`"


def _meaning(field: FieldInfo) -> str:
    """The field's docstring; for an undocumented section, the first line of its model's docstring."""
    if field.description:
        return _one_line(field.description)
    for model, _ in _nested_models(field.annotation):
        first = (model.__doc__ or "").strip().split("\n")[0]
        return _one_line(f"{first.rstrip('.')}: see [{model.__name__}](#{_anchor(model)}).")
    return ""


def _one_line(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


def _section(path: str, model: type[BaseModel]) -> str:
    title = f"`{path}`: {model.__name__}" if path else f"An entry: {model.__name__}"
    doc = typing.cast(str, model.__doc__ or "")
    lines = [f"## {title} {{#{_anchor(model)}}}", "", _paragraphs(doc), ""]
    lines += ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for name, field in model.model_fields.items():
        shown = field.alias or name
        kind = _type(field.annotation)
        bounds = _constraints(list(field.metadata))
        kind += f" ({bounds})" if bounds else ""
        lines.append(f"| `{shown}` | {kind} | {_default(field)} | {_meaning(field)} |")
    return "\n".join(lines) + "\n"


def _paragraphs(doc: str) -> str:
    blocks = [" ".join(block.split()) for block in doc.strip().split("\n\n")]
    return "\n\n".join(block for block in blocks if block)


def catalog_reference() -> str:
    """The whole page: the introduction, then one section per model of the schema."""
    from datacat.schema import Entry

    sections = [_section(path, model) for path, model in _models(Entry)]
    return INTRO + "\n" + "\n".join(sections)


FORMATS_INTRO = """\
# Formats and layouts

Every `format:` value the registry knows in the environment that built this page, each from its own
declaration (`datacat.Format`, at the end of the format's module): its documentation, how it is read, its
layouts (`record.layout`; the first is the default), the batch keys it adds, and its own YAML section, if
any. A package adds a format through the `datacat.formats` entry point (see [Architecture](architecture.md)).
`format: mixture` is not a format but an entry mixing others: see `mixture` in the
[catalog file reference](catalog-reference.md).
"""


def formats_page() -> str:
    """The formats page: one section per registered format, from its declaration."""
    from datacat.registry import format_names, format_of

    parts = [FORMATS_INTRO]
    for name in format_names():
        declared = format_of(name)
        lines = [f"## `{name}`", "", _paragraphs(declared.doc or ""), ""]
        facts = [
            f"read: {declared.access}",
            f"layouts: {', '.join(f'`{layout}`' for layout in declared.layouts) or 'none'}",
        ]
        if declared.arrays:
            facts.append(f"batch arrays: {', '.join(f'`{key}`' for key in declared.arrays)}")
        if declared.rows:
            facts.append("rows without an image")
        facts.append("checked by `datacat verify`" if declared.shard_facts is not None else "not checked by verify")
        lines += ["; ".join(facts) + ".", ""]
        if declared.options is not None and declared.section is not None:
            lines.append(_section(declared.section, declared.options).replace("## ", "### ", 1))
        parts.append("\n".join(lines))
    return "\n".join(parts)


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Adds the generated pages to the site's files (replacing a stray file of the same name)."""
    for page, content in ((PAGE, catalog_reference()), (FORMATS_PAGE, formats_page())):
        existing = files.get_file_from_path(page)
        if existing is not None:
            files.remove(existing)
        files.append(File.generated(config, page, content=content))
    return files
