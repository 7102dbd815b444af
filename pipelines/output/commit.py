"""Publishing staged sets (shard sets and the tokenized set alike) so readers see old or new, fenced.

A set is a folder whose manifest.json names its files; a run stages the new files under
the folder's .staging-<run>/ and publishes them here, in this order (docs/manifest.md,
"Publishing and readers"):

1. `look`, right after the lock is taken: each set's manifest (bytes and version), the
   version of every file in its folder, and the run record's version. Every later write
   and delete is conditioned on these, never on what is there at the time of the write.
2. The new files go from staging in beside the old ones. Their names carry their sha256,
   so a new file never replaces an old file of other content.
3. Each set's manifest.json is switched in one atomic step, on condition that it is still
   the version seen in step 1 (without --overwrite: that there is none): on gs:// an
   upload with ifGenerationMatch, locally a link or a rename checked under the OS lock.
4. The run record (published.json) names every manifest with its sha256: this run's and,
   without --overwrite, the lengths published before it (prepack/published.py's rule,
   checked in `look` against their manifests), conditioned on the record's version seen in 1.
5. Only then are old files deleted: exactly the ones the replaced manifest named, at the
   version seen in step 1 (gs:// ifGenerationMatch), and never a name the manifest now
   published names (a later run may republish a content-addressed name).

Before every step the lock is checked (`OutputLock.check`, a conditional renewal on
gs://); a run that lost it raises LockLost naming the owner and changes nothing more.
Failpoints (pipelines/faults/failpoints.py) mark each step.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

from pipelines.output.lock import LockLost, OutputLock
from prepack.storage import SwitchRefused, Version, Versioned, storage_for
from pipelines.faults import failpoints
from prepack.format import layout
from prepack.format.run_record import PublishedManifest, RunRecord
from prepack.published import kept_lengths
from prepack.hostile_input.untrusted import MAX_METADATA_FILE_BYTES


@dataclasses.dataclass(frozen=True)
class SetPlace:
    """Where a set lives: its folder, the name used in failpoints and messages (L64, tokens),
    and which file names may be one of its files (only those are ever deleted)."""

    name: str
    folder: str
    is_set_file: Callable[[str], bool]

    @property
    def manifest_path(self) -> str:
        return layout.join(self.folder, layout.MANIFEST_NAME)


@dataclasses.dataclass(frozen=True)
class StagedSet:
    place: SetPlace
    staged: str  # the run's staging folder for this set
    manifest: bytes  # the new manifest.json
    files: tuple[str, ...]  # the file names it names (moved in from staging)
    dead_letter: str | None = None  # a staged file replaced in place after the switch (not content-addressed)


@dataclasses.dataclass(frozen=True)
class SeenSet:
    manifest: Versioned | None
    files: dict[str, Version]


@dataclasses.dataclass(frozen=True)
class Seen:
    """What the output held when this run took the lock: the basis of every conditional step."""

    sets: dict[str, SeenSet]
    run_record: Version
    kept: dict[int, PublishedManifest] = dataclasses.field(default_factory=dict)  # lengths published before, kept


def length_place(output: str, max_length: int) -> SetPlace:
    def is_set_file(name: str) -> bool:
        return bool(layout.SHARD_FILE.match(name)) or name in (layout.DEAD_LETTER_NAME, layout.FAILED_DEAD_LETTER_NAME)

    return SetPlace(f"L{max_length}", layout.length_dir(output, max_length), is_set_file)


def tokens_place(output: str) -> SetPlace:
    from prepack.format.tokenset import is_set_file

    return SetPlace("tokens", layout.tokens_dir(output), is_set_file)


def look(output: str, places: list[SetPlace], lock: OutputLock, keep_published: bool = False) -> Seen:
    """Step 1, called holding the lock. On gs://, after taking over a stale lease, each
    published manifest and the run record are rewritten with their own bytes first: a new
    generation that any write still in flight from the stale run was not conditioned on.
    `keep_published` (a run without --overwrite): the lengths the record names now, each
    checked against its manifest, are kept in the record this run writes; NotAddable (one
    line) when they cannot be (prepack/published.py)."""
    store = storage_for(output)
    record_path = layout.run_record_path(output)
    if lock.took_over is not None and not store.os_locks:  # a lease: a stale owner may still be writing
        for path in [p.manifest_path for p in places] + [record_path]:
            found = store.read(path, MAX_METADATA_FILE_BYTES)
            if found is not None:
                store.write_if(path, found.data, found.version, tmp="")
    sets = {}
    for place in places:
        manifest = store.read(place.manifest_path, MAX_METADATA_FILE_BYTES)  # a stranger's may be huge: refused, unread
        files = store.versions(place.folder)
        sets[place.name] = SeenSet(manifest, files)
    record = store.read(record_path, MAX_METADATA_FILE_BYTES)
    kept = {}
    if keep_published:
        def read_manifest(path: str) -> bytes | None:
            found = store.read(path, MAX_METADATA_FILE_BYTES)
            return None if found is None else found.data

        adding = [int(p.name[1:]) for p in places if p.name.startswith("L")]
        kept = kept_lengths(output, record.data if record else None, adding, read_manifest)
    return Seen(sets, record.version if record else store.absent, kept)


def _named(manifest: bytes | None) -> set[str]:
    """The file names a manifest names (its shards, dead letter or dropped file): read as a
    stranger's file, so anything unreadable names nothing."""
    if manifest is None:
        return set()
    try:
        d = json.loads(manifest.decode("utf-8"))
        names = {s["path"] for s in d.get("shards", []) if isinstance(s.get("path"), str)}
        names |= {d[k] for k in ("dead_letter", "dropped") if isinstance(d.get(k), str)}
    except Exception:
        return set()
    return {n for n in names if "/" not in n and n not in ("", ".", "..")}


class Commit:
    """One run's publishing of its staged sets (steps 2-5); `switched` says how far it got."""

    def __init__(self, output: str, run_id: str, lock: OutputLock, seen: Seen, overwrite: bool):
        self.output, self.run_id, self.lock, self.seen, self.overwrite = output, run_id, lock, seen, overwrite
        self.store = storage_for(output)
        self.switched: dict[str, str] = {}  # set name -> manifest path, as each is switched

    def publish(self, lengths: dict[int, StagedSet], tokens: StagedSet | None) -> None:
        """Steps 2-5 for a run's shard sets and, when it wrote one, its tokenized set. Raises
        LockLost (another run owns the output now), SwitchRefused (a writer that ignored the
        lock) or storage errors; `switched` then says what this run published."""
        sets = [lengths[L] for L in sorted(lengths)] + ([tokens] if tokens else [])
        self.move_in(sets)
        for L in sorted(lengths):
            self.switch(lengths[L])
        if tokens is not None:
            failpoints.hit("before_tokens_switch")
            self.switch(tokens)
            failpoints.hit("after_tokens_switch")
        # A run that publishes no tokenized set names the one already in the output (what
        # --from-tokens OUTPUT/tokens then checks); this run's lock keeps it from changing meanwhile.
        found = None if tokens else self.store.read(layout.tokens_manifest_path(self.output), MAX_METADATA_FILE_BYTES)
        self.write_record(RunRecord.of(self.run_id, {L: s.manifest for L, s in lengths.items()},
                                       tokens.manifest if tokens else (found.data if found else None), self.seen.kept))
        for s in sets:
            self.delete_replaced(s)
        self.lock.check()
        failpoints.hit("after_publish")

    def _refused(self, error: SwitchRefused) -> SwitchRefused:
        self.lock.check()  # lost the lock: that is the message (it names the owner)
        done = ", ".join(self.switched) or "none"
        return SwitchRefused(f"{error}; refusing to replace it (sets already switched by this run: {done}). "
                             f"Make sure one run at a time writes {self.output}", error.current)

    def move_in(self, sets: list[StagedSet]) -> None:
        """Step 2: the staged files beside the old ones. Locally a file already there under the
        same (content-addressed) name is kept: the OS lock keeps every other run out. On gs://
        it is written again, so it gets a new generation: a run that lost its lease and still
        means to delete that name (at the generation it saw) then finds another one, and
        deletes nothing this run published."""
        for s in sets:
            self.lock.check()
            present = self.store.versions(s.place.folder) if self.store.os_locks else {}
            names = [n for n in s.files if n not in present]
            self.store.move([layout.join(s.staged, n) for n in names], [layout.join(s.place.folder, n) for n in names])
        failpoints.hit("shards_in_place")

    def switch(self, s: StagedSet) -> None:
        """Step 3 for one set (and its dead letter, replaced in place right after)."""
        seen = self.seen.sets[s.place.name]
        expected = seen.manifest.version if (seen.manifest is not None and self.overwrite) else self.store.absent
        self.lock.check()
        try:
            self.store.write_if(s.place.manifest_path, s.manifest, expected,
                                tmp=layout.join(layout.run_staging_dir(self.output, self.run_id), f"manifest.{s.place.name}"))
        except SwitchRefused as e:
            raise self._refused(e) from e
        self.switched[s.place.name] = s.place.manifest_path
        if s.dead_letter:  # replaced like the manifest: conditioned on the version this run saw
            target, staged_path = layout.join(s.place.folder, s.dead_letter), layout.join(s.staged, s.dead_letter)
            staged = self.store.read(staged_path)
            self.lock.check()
            try:
                self.store.write_if(target, staged.data if staged else b"", seen.files.get(s.dead_letter, self.store.absent),
                                    tmp=layout.join(layout.run_staging_dir(self.output, self.run_id), f"dead_letter.{s.place.name}"))
            except SwitchRefused as e:
                raise self._refused(e) from e
            self.store.delete([staged_path])  # this run's own staged copy: moved in, as the shards are
        failpoints.hit("after_manifest_switch", s.place.name)

    def write_record(self, record: RunRecord) -> None:
        """Step 4."""
        path = layout.run_record_path(self.output)
        self.lock.check()
        try:
            self.store.write_if(path, record.to_json().encode("utf-8"), self.seen.run_record,
                                tmp=layout.join(layout.run_staging_dir(self.output, self.run_id), layout.RUN_RECORD_NAME))
        except SwitchRefused as e:
            self.lock.check()
            raise SwitchRefused(f"{e}; the sets are switched, but the run record is another run's. Make sure one run at "
                                f"a time writes {self.output}", e.current) from e
        failpoints.hit("after_run_record")

    def delete_replaced(self, s: StagedSet) -> None:
        """Step 5 for one set: the files of the manifest it replaced, at the versions seen."""
        failpoints.hit("before_delete", s.place.name)
        seen = self.seen.sets[s.place.name]
        self.lock.check()
        now = self.store.read(s.place.manifest_path, MAX_METADATA_FILE_BYTES)
        if now is None or now.data != s.manifest:
            self.lock.check()
            raise SwitchRefused(f"{s.place.manifest_path} changed after this run switched it; deleting nothing")
        keep = _named(now.data) | set(s.files)
        old = _named(seen.manifest.data if seen.manifest else None)
        if seen.manifest is not None and s.dead_letter is None:
            old.add(layout.DEAD_LETTER_NAME)  # the old set's dead letter, when the new set has none
        old.add(layout.FAILED_DEAD_LETTER_NAME)
        for name in sorted(old - keep):
            if s.place.is_set_file(name) and name in seen.files:
                self.store.delete_if(layout.join(s.place.folder, name), seen.files[name])
