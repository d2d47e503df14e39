"""Every validation rule has one invalid file in catalogs/invalid, whose first line says what must be reported."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import datacat
from datacat import CatalogError, load_catalog
from datacat.catalog import builtin_catalog_dir

INVALID = sorted((Path(__file__).parent / "catalogs" / "invalid").glob("*.yaml"))
EXPECT = re.compile(r"^# expect: (\d+) (?:(\S+): )?(.*)$")


def _problems(path: Path) -> list[str]:
    with pytest.raises(CatalogError) as info:
        load_catalog([path])
    return [str(p) for p in info.value.problems]


@pytest.mark.parametrize("path", [p for p in INVALID if p.name != "five_mistakes.yaml"], ids=lambda p: p.stem)
def test_each_invalid_file_reports_exactly_its_problem(path: Path) -> None:
    match = EXPECT.match(path.read_text().splitlines()[0])
    assert match, f"{path.name} must start with '# expect: LINE TEXT'"
    line, key_path, text = match.groups()
    problems = _problems(path)
    assert len(problems) == 1, problems
    shown = f"tests/catalogs/invalid/{path.name}:{line} "
    assert problems[0].startswith(shown) or problems[0].startswith(f"{path}:{line} "), problems[0]
    if key_path:
        assert f" {key_path}: " in problems[0], problems[0]
    assert text in problems[0]


def test_five_mistakes_give_five_lines_with_file_and_line() -> None:
    path = Path(__file__).parent / "catalogs" / "invalid" / "five_mistakes.yaml"
    problems = _problems(path)
    assert len(problems) == 5, problems
    lines = sorted(int(re.search(r"five_mistakes\.yaml:(\d+) ", p).group(1)) for p in problems)  # type: ignore[union-attr]
    assert lines == [6, 11, 18, 19, 24]


def test_rules_see_every_shipped_catalog_valid() -> None:
    catalog = load_catalog()
    assert {
        "CC3M",
        "CC12M",
        "Laion12mCoco",
        "Laion2bAesthetic",
        "DiffusionDB",
        "CombinedMsml612",
        "Combined30M",
    } <= set(catalog)
    assert "sample" in catalog and "sample-embeddings" in catalog


def test_unset_variable_with_default_is_fine(write_catalog) -> None:
    path = write_catalog(
        "ok:\n  description: d\n  format: webdataset\n"
        "  location: {root: '${DATACAT_TEST_UNSET:-/data}', shards: '{0..1}.tar', storage_options: {token: '${DATACAT_TEST_UNSET:-anon}'}}\n"
    )
    assert "ok" in load_catalog([path], builtin=False)


def test_override_of_builtin_is_recorded(write_catalog) -> None:
    path = write_catalog(
        "cc3m:\n  description: my copy\n  format: array_record\n  location: {root: /mnt/cc3m, shards: '{0..9}.array_record'}\n  record: {layout: packed}\n"
    )
    catalog = load_catalog([path])
    assert catalog["CC3M"].description == "my copy"
    assert catalog.canonical("CC3M") == "cc3m"  # the override's name, found in any case
    # The override replaces the whole entry, its aliases too: the built-in's alias names nothing now.
    assert "conceptual-captions-3m" not in catalog and "CC3M" in catalog
    # The built-in file it replaces, as datacat shows paths (catalog/ in a checkout, site-packages when installed).
    builtin = (builtin_catalog_dir() / "cc3m.yaml").resolve()
    (overridden,) = catalog.sources["cc3m"].overrides
    assert Path(overridden).resolve() == builtin


def test_same_name_twice_in_one_layer_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(
        "x:\n  description: a\n  format: webdataset\n  location: {root: /d, shards: a.tar}\n"
    )
    (tmp_path / "b.yaml").write_text(
        "X:\n  description: b\n  format: webdataset\n  location: {root: /d, shards: b.tar}\n"
    )
    with pytest.raises(CatalogError, match="entry defined twice"):
        load_catalog([tmp_path], builtin=False)


def test_catalog_env_variable_adds_entries(write_catalog, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_catalog(
        "mine:\n  description: d\n  format: webdataset\n  location: {root: /d, shards: '{0..1}.tar'}\n"
    )
    monkeypatch.setenv("DATACAT_CATALOG", str(path))
    assert "mine" in load_catalog() and "cc3m" in load_catalog()


def test_missing_catalog_path_is_reported(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="no such catalog file or folder"):
        load_catalog([tmp_path / "nope.yaml"])


def test_yaml_alias_bomb_is_refused_before_it_expands(tmp_path) -> None:
    # 9 levels of 9 aliases: 387M values if expanded. Refused from the document's own size.
    levels = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        name, previous = chr(97 + i), chr(96 + i)
        levels.append(f"{name}: &{name} [{', '.join(['*' + previous] * 9)}]")
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(levels) + "\n")
    assert len(bomb.read_bytes()) < 700
    with pytest.raises(CatalogError, match="aliases add more than 100,000 values") as info:
        load_catalog([bomb], builtin=False)
    assert len(str(info.value)) < 300  # the offending value is not in the message
    shared = tmp_path / "shared.yaml"
    shared.write_text(
        "base: &loading {image_size: 32, val_batches: 0}\n"
        "one: {description: d, format: webdataset, location: {root: ., shards: a.tar}, loading: *loading}\n"
    )
    with pytest.raises(CatalogError, match="base"):  # an alias is fine; 'base' is just not an entry
        load_catalog([shared], builtin=False)


def test_a_large_catalog_file_is_kept_parsed_and_parsed_again_when_edited(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DATACAT_CACHE", str(tmp_path / "cache"))
    counts = ", ".join(f"{i:05d}.tar: {100 + i % 7}" for i in range(6000))  # ~96 KB: past the size kept parsed
    path = tmp_path / "big.yaml"

    def write(first: int) -> None:
        path.write_text(
            "big:\n  description: d\n  format: webdataset\n"
            "  location: {root: '/data', shards: '{00000..05999}.tar'}\n"
            f"  totals: {{per_shard: {{{counts.replace('00000.tar: 100', f'00000.tar: {first}')}}}}}\n"
        )

    write(100)
    first = datacat.load_catalog([path], builtin=False)["big"]
    assert len(list((tmp_path / "cache" / "parsed").iterdir())) == 1
    again = datacat.load_catalog([path], builtin=False)["big"]  # from the cache this time
    assert again == first and again.totals.per_shard["00000.tar"] == 100
    write(55)
    assert datacat.load_catalog([path], builtin=False)["big"].totals.per_shard["00000.tar"] == 55
    write(-1)  # a problem is reported with its line, from the YAML itself, however often it is loaded
    for _ in range(2):
        with pytest.raises(datacat.CatalogError, match=r"big\.yaml:5 big\.totals\.per_shard\.00000\.tar"):
            datacat.load_catalog([path], builtin=False)
