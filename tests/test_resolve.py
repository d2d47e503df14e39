from __future__ import annotations

import json
from pathlib import Path

import pytest

import datacat
from datacat import EntryNotFound, OptionError, load_catalog, resolve


def test_cc3m_excludes_missing_shard_and_counts_agree() -> None:
    plan = resolve("cc3m")
    names = [s.name for s in plan.shards]
    assert len(names) == 49 == load_catalog()["CC3M"].totals.shards
    assert "00039.array_record" not in names
    assert plan.missing == ("gs://msml612/arrayrecord2/cc3m/00039.array_record",)
    assert names == sorted(names) and names[0] == "00000.array_record" and names[-1] == "00049.array_record"
    assert plan.samples == 3_300_000 and not plan.samples_exact
    assert plan.bytes == 37 * 2**30


def test_root_from_environment_and_from_call(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DATACAT_ROOT", "gs://elsewhere")
    assert resolve("cc3m").shards[0].url == "gs://elsewhere/arrayrecord2/cc3m/00000.array_record"
    plan = resolve("cc3m", root=str(tmp_path))
    assert plan.shards[0].url == str(tmp_path / "arrayrecord2" / "cc3m" / "00000.array_record")


def test_mixture_weights_are_normalised_and_components_resolved() -> None:
    plan = resolve("combined30m", list_shards=False)
    assert [c.plan.name for c in plan.components] == [
        "laion-aesthetics-12m+mscoco-2017",
        "CC12M",
        "aestheticCoyo_0.26_clip_5.5aesthetic_256plus",
        "playground+leonardo_x4+cc3m.parquet",
    ]
    assert [c.weight for c in plan.components] == [0.25] * 4
    msml = resolve("CombinedMsml612")
    assert sum(c.weight for c in msml.components) == pytest.approx(1.0)
    assert msml.components[1].weight == pytest.approx(550 / 883)


def test_unweighted_components_follow_declared_samples(write_catalog) -> None:
    path = write_catalog(
        "a: {description: a, format: webdataset, location: {root: /d, shards: a.tar}, totals: {samples: 30}}\n"
        "b: {description: b, format: webdataset, location: {root: /d, shards: b.tar}, totals: {samples: 10}}\n"
        "ab: {description: ab, format: mixture, mixture: {components: [{name: a}, {name: B}]}}\n"
    )
    plan = resolve("AB", catalog=load_catalog([path], builtin=False))
    assert [c.weight for c in plan.components] == [0.75, 0.25]
    assert plan.samples == 40


def test_user_entry_on_local_folder_resolves_relative_to_its_file(write_catalog, tmp_path: Path) -> None:
    path = write_catalog(
        "mine:\n  description: d\n  format: webdataset\n"
        "  location: {root: shards, shards: '{000..002}.tar', missing: [1]}\n"
        "  totals: {per_shard: {000.tar: 5, 002.tar: 7}}\n"
    )
    plan = resolve("mine", catalog=load_catalog([path]))
    assert [s.url for s in plan.shards] == [str(tmp_path / "shards" / "000.tar"), str(tmp_path / "shards" / "002.tar")]
    assert plan.samples == 12 and plan.samples_exact


def test_glob_is_listed_on_memory_filesystem(write_catalog) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    for name in ("b.tar", "a.tar", "c.txt"):
        fs.pipe(f"/globtest/{name}", b"x")
    path = write_catalog(
        "g:\n  description: d\n  format: webdataset\n  location: {root: 'memory://globtest', shards: '*.tar'}\n"
    )
    catalog = load_catalog([path], builtin=False)
    assert resolve("g", catalog=catalog, list_shards=False).glob == "memory://globtest/*.tar"
    assert [s.url for s in resolve("g", catalog=catalog).shards] == [
        "memory://globtest/a.tar",
        "memory://globtest/b.tar",
    ]


def test_plan_is_frozen_json_and_fingerprinted() -> None:
    plan = resolve("cc3m", seed=3)
    again = datacat.Plan.model_validate(json.loads(json.dumps(plan.to_json())))
    assert again.fingerprint() == plan.fingerprint()
    assert resolve("cc3m", seed=4).fingerprint() != plan.fingerprint()
    with pytest.raises(Exception, match="frozen"):
        plan.seed = 5  # type: ignore[misc]


def test_loading_overrides_are_validated() -> None:
    assert resolve("cc3m", image_size=256, augmentation="none").loading.image_size == 256
    with pytest.raises(OptionError, match="augmentation"):
        resolve("cc3m", augmentation="flip")
    with pytest.raises(OptionError, match="unknown loading option"):
        resolve("cc3m", imagesize=256)
    with pytest.raises(OptionError, match="no split 'test'"):
        resolve("cc3m", split="test")
    with pytest.raises(OptionError, match="no split 'validation'"):
        resolve("cc3m", split="validation", val_batches=0)


def test_holdout_needs_batch_size() -> None:
    assert resolve("cc3m").holdout_records == 0
    assert resolve("cc3m", batch_size=256).holdout_records == 4 * 256
    validation = resolve("cc3m", split="validation", batch_size=256)
    assert validation.from_holdout and validation.holdout_records == 4 * 256


def test_secrets_stay_out_of_json(write_catalog, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATACAT_TEST_TOKEN", "s3cr3t-value")
    path = write_catalog(
        "s:\n  description: d\n  format: webdataset\n"
        "  location: {root: gs://b, shards: a.tar, storage_options: {token: '${DATACAT_TEST_TOKEN}', password: hunter2, project: p}}\n"
    )
    plan = resolve("s", catalog=load_catalog([path], builtin=False))
    assert plan.storage_options["token"] == "s3cr3t-value"
    text = json.dumps(plan.to_json()) + repr(plan)
    assert "s3cr3t-value" not in text and "hunter2" not in text
    assert plan.storage_options_shown == {"token": "${DATACAT_TEST_TOKEN}", "password": "<redacted>", "project": "p"}


def test_unknown_name_suggests() -> None:
    with pytest.raises(EntryNotFound, match="Did you mean 'CC12M'") as info:
        resolve("cc12N")
    assert "datacat list" in str(info.value)


def _mixture_over_manifest(write_catalog, tmp_path: Path):
    (tmp_path / "d").mkdir()
    path = write_catalog(
        f"a: {{description: a, format: webdataset, location: {{root: '{tmp_path}/d', shards: '{{0..1}}.tar'}}, totals: {{samples: 30}}}}\n"
        f"b: {{description: b, format: webdataset, location: {{root: '{tmp_path}/d', shards: b.tar}}, totals: {{samples: 10}}}}\n"
        "ab: {description: ab, format: mixture, mixture: {components: [{name: a}, {name: b}]}}\n"
    )
    return load_catalog([path], builtin=False)


def test_resolving_reads_no_manifest_and_completing_does(write_catalog, tmp_path: Path) -> None:
    from datacat.resolve import resolve_entry
    from datacat.storage import complete_plan
    from datacat.storage.manifests import Manifest, ShardFacts, save_manifest

    catalog = _mixture_over_manifest(write_catalog, tmp_path)
    a = resolve_entry("a", catalog=catalog)
    facts = {n: ShardFacts(name=n, records=5, url=f"{a.root}/{n}") for n in ("0.tar", "1.tar")}
    save_manifest(Manifest(a.manifest, "a", a.root, facts))
    pure = resolve_entry("ab", catalog=catalog)
    assert [c.weight for c in pure.components] == [0.75, 0.25]  # by the declared totals: no manifest read
    assert pure.components[0].plan.samples == 30 and not pure.components[0].plan.samples_exact
    assert [c.declared_weight for c in pure.components] == [None, None]
    done = complete_plan(pure)
    assert [s.samples for s in done.components[0].plan.shards] == [5, 5]
    assert done.components[0].plan.samples_exact and done.components[0].plan.samples_counted
    assert [c.weight for c in done.components] == [0.5, 0.5] and done.samples == 20
    assert resolve("ab", catalog=catalog) == done  # the public resolve is the two steps
    assert complete_plan(a).fingerprint() == a.fingerprint()  # counts do not change what the stream is


def test_a_glob_stays_unlisted_until_completed(write_catalog, tmp_path: Path) -> None:
    from datacat.resolve import resolve_entry
    from datacat.storage import complete_plan

    (tmp_path / "g").mkdir()
    for name in ("b.tar", "a.tar"):
        (tmp_path / "g" / name).write_bytes(b"x")
    path = write_catalog(
        f"g: {{description: d, format: webdataset, location: {{root: '{tmp_path}/g', shards: '*.tar'}}}}\n"
    )
    catalog = load_catalog([path], builtin=False)
    pure = resolve_entry("g", catalog=catalog)
    assert pure.glob == f"{tmp_path}/g/*.tar" and pure.shards == ()
    assert complete_plan(pure, list_shards=False) == pure
    assert [s.name for s in complete_plan(pure).shards] == ["a.tar", "b.tar"]
    (tmp_path / "g" / "a.tar").unlink()
    (tmp_path / "g" / "b.tar").unlink()
    with pytest.raises(datacat.ShardError, match="no shards match") as raised:
        complete_plan(pure)
    assert raised.value.url == pure.glob


def test_the_typed_loading_overrides_name_every_loading_field() -> None:
    from datacat.resolve import LoadingOverrides
    from datacat.schema import Loading

    assert set(LoadingOverrides.__annotations__) == set(Loading.model_fields)
