"""The commit's delete rule, on local disk and gs://: a run deletes exactly the files the manifest
it replaced named, at the versions it saw under its lock, and never a name that the manifest now
published names. Driven directly (no pipeline) with a lock that always says "still yours", so
these are the storage's own guarantees, beneath the lock check."""

from __future__ import annotations

import json
import os
import time

import pytest

from pipelines.output import commit as output_commit
from prepack.storage import SwitchRefused, storage_for
from prepack.format import layout
from testkit.gcs_emulator import gcs_emulator, gcs_prefix  # noqa: F401  (pytest fixtures)

OLD = ["rows-00000-of-00002-aaaaaaaaaaaa.array_record", "rows-00001-of-00002-bbbbbbbbbbbb.array_record"]
NEW = ["rows-00000-of-00001-cccccccccccc.array_record"]


class StillYours:
    took_over = None

    def check(self) -> None:
        pass


@pytest.fixture(params=["local", "gcs"])
def output(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "out")
    return f"{request.getfixturevalue('gcs_prefix')}/out"


def manifest(names: list[str]) -> bytes:
    return json.dumps({"shards": [{"path": n} for n in names], "dead_letter": None}).encode()


def put(path: str, data: bytes) -> None:
    if not path.startswith("gs://"):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    storage_for(path).write(path, data)


def stage_and_look(output):
    """OUTPUT/L64 holds the old set, run-b has staged a new one and looked, holding its lock:
    (the set's folder, its place, the staging folder, what look saw)."""
    folder = layout.length_dir(output, 64)
    for n in OLD:
        put(f"{folder}/{n}", n.encode())
    put(f"{folder}/manifest.json", manifest(OLD))
    staging = layout.staging_dir(output, 64, "run-b")
    for n in NEW:
        put(f"{staging}/{n}", n.encode())
    place = output_commit.length_place(output, 64)
    return folder, place, staging, output_commit.look(output, [place], StillYours())


@pytest.fixture
def staged(output):
    """OUTPUT/L64 holds the old set; the run has staged a new one and looked, holding its lock."""
    folder, place, staging, seen = stage_and_look(output)
    staged_set = output_commit.StagedSet(place, staging, manifest(NEW), tuple(NEW))
    commit = output_commit.Commit(output, "run-b", StillYours(), seen, overwrite=True)
    commit.move_in([staged_set])
    commit.switch(staged_set)
    return folder, commit, staged_set


def names_in(folder: str) -> set[str]:
    return set(storage_for(folder).versions(folder))


def test_deletes_exactly_what_the_replaced_manifest_named(staged):
    folder, commit, s = staged
    put(f"{folder}/rows-00000-of-00009-dddddddddddd.array_record", b"a killed run's leftover")
    commit.delete_replaced(s)
    assert names_in(folder) == {"manifest.json", *NEW, "rows-00000-of-00009-dddddddddddd.array_record"}


def test_a_republished_name_is_not_deleted(staged):
    """Another writer published a file under an old name (content-addressed names come back):
    its version is not the one this run saw, so it stays. Shown to fail with delete_if's version
    check removed (the file is deleted)."""
    folder, commit, s = staged
    time.sleep(0.01)
    put(f"{folder}/{OLD[0]}", OLD[0].encode() + b" republished")
    commit.delete_replaced(s)
    assert names_in(folder) == {"manifest.json", *NEW, OLD[0]}


def test_nothing_is_deleted_when_the_published_manifest_is_not_this_runs(staged):
    """The manifest now published names an old file again: checked right before deleting, the run
    deletes nothing. Shown to fail without the re-read (OLD[1], named by it, was deleted)."""
    folder, commit, s = staged
    storage_for(folder).write(f"{folder}/manifest.json", manifest(OLD))
    with pytest.raises(SwitchRefused, match=r"L64/manifest.json changed after this run switched it; deleting nothing"):
        commit.delete_replaced(s)
    assert names_in(folder) >= set(OLD)


def test_a_stale_run_cannot_delete_a_name_the_new_owner_published_again(output):
    """Run A looked at the old set, then lost its lease (paused). Run B publishes a set that
    reuses one of the old content-addressed names. When A resumes and deletes what it replaced,
    B's file stays: on gs:// B moved it in again (a new generation), locally the OS lock kept A
    out. Shown to fail on gs:// with move_in skipping names already present (B's manifest then
    named a deleted shard)."""
    folder = layout.length_dir(output, 64)
    for n in OLD:
        put(f"{folder}/{n}", n.encode())
    put(f"{folder}/manifest.json", manifest(OLD))
    place = output_commit.length_place(output, 64)
    seen_by_a = output_commit.look(output, [place], StillYours())
    # B: the same first shard as the old set (same content, same name), and a new one.
    b_files = [OLD[0], NEW[0]]
    staging = layout.staging_dir(output, 64, "run-b")
    for n in b_files:
        put(f"{staging}/{n}", n.encode())
    b_set = output_commit.StagedSet(place, staging, manifest(b_files), tuple(b_files))
    time.sleep(0.01)
    b = output_commit.Commit(output, "run-b", StillYours(), output_commit.look(output, [place], StillYours()), overwrite=True)
    b.move_in([b_set])
    b.switch(b_set)
    b.delete_replaced(b_set)
    assert names_in(folder) == {"manifest.json", *b_files}
    # A resumes with what it saw before B ran; its own manifest check would refuse, so drive the
    # deletes the way a stale run that passed that check would: at the versions it saw.
    store = storage_for(folder)
    for name in OLD:
        store.delete_if(f"{folder}/{name}", seen_by_a.sets[place.name].files[name])
    if output.startswith("gs://"):
        assert names_in(folder) == {"manifest.json", *b_files}  # B's republished shard survived
    else:  # locally no second run gets in while A lives (flock); the version check alone is no fence
        assert OLD[0] not in names_in(folder)


def test_the_dead_letter_is_replaced_only_at_the_version_seen(output):
    """The dead letter is switched like the manifest: conditioned on the version the run saw
    under its lock. Another writer's dead letter since then refuses the switch (it used to be
    deleted and replaced unconditioned on gs://). Shown to fail with the old delete + move."""
    folder = layout.length_dir(output, 64)
    for n in OLD:
        put(f"{folder}/{n}", n.encode())
    put(f"{folder}/manifest.json", manifest(OLD))
    put(f"{folder}/{layout.DEAD_LETTER_NAME}", b'{"old": 1}\n')
    staging = layout.staging_dir(output, 64, "run-b")
    for n in NEW:
        put(f"{staging}/{n}", n.encode())
    put(f"{staging}/{layout.DEAD_LETTER_NAME}", b'{"new": 1}\n')
    place = output_commit.length_place(output, 64)
    seen = output_commit.look(output, [place], StillYours())
    time.sleep(0.01)
    put(f"{folder}/{layout.DEAD_LETTER_NAME}", b'{"another writer": 1}\n')
    s = output_commit.StagedSet(place, staging, manifest(NEW), tuple(NEW), layout.DEAD_LETTER_NAME)
    commit = output_commit.Commit(output, "run-b", StillYours(), seen, overwrite=True)
    commit.move_in([s])
    with pytest.raises(SwitchRefused, match=r"dead_letter.jsonl was changed by another run since this one started"):
        commit.switch(s)
    assert storage_for(folder).read(f"{folder}/{layout.DEAD_LETTER_NAME}").data == b'{"another writer": 1}\n'


def test_the_switch_is_conditioned_on_the_version_seen_under_the_lock(output):
    """Another writer (one ignoring the lock) replaced the manifest after this run looked: the
    switch is refused and that writer's manifest stays. Shown to fail, local and gs://, with the
    switch conditioned on the version read at the switch (store.version(manifest_path)) instead
    of the one `look` saw: the other writer's manifest was replaced."""
    folder, place, staging, seen = stage_and_look(output)
    time.sleep(0.01)
    storage_for(folder).write(f"{folder}/manifest.json", manifest(OLD[:1]))  # behind the lock
    staged_set = output_commit.StagedSet(place, staging, manifest(NEW), tuple(NEW))
    commit = output_commit.Commit(output, "run-b", StillYours(), seen, overwrite=True)
    commit.move_in([staged_set])
    with pytest.raises(SwitchRefused, match=r"L64/manifest.json was changed by another run since this one started"):
        commit.switch(staged_set)
    assert storage_for(folder).read(f"{folder}/manifest.json").data == manifest(OLD[:1])
    assert commit.switched == {}
