"""A write of a folder's own files killed midway (prepack/storage/own_files.py) is finished or
cleared by the next one: the folder then holds the old set or the new set whole, and no staging
folder stays. The kills are made at named failpoints (PREPACK_FAILPOINTS, `exit`: os._exit, no
clean-up), never by timing."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys

import pytest

from prepack.storage import own_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

OLD = {"a.bin": b"old a", "b.json": b"old b", "stale.bin": b"stale"}  # sorted: a.bin, b.json, stale.bin
NEW = {"a.bin": b"new a", "b.json": b"new b", "c.bin": b"new c"}
THIRD = {"a.bin": b"third a", "b.json": b"third b"}
NOTES = {"notes.txt": b"mine"}  # not the command's own: every write leaves it

WRITER = (
    "import sys\n"
    "from prepack.storage import own_files\n"
    f"own_files.write_own_files(sys.argv[1], {NEW!r}, lambda n: n.endswith(('.bin', '.json')))\n"
)


def owns(name: str) -> bool:
    return name.endswith((".bin", ".json"))


def _folder(path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in path.iterdir() if p.is_file()}


def _killed_write(tmp_path, point: str):
    target = tmp_path / "out"
    target.mkdir()
    for name, data in {**OLD, **NOTES}.items():
        (target / name).write_bytes(data)
    (tmp_path / ".other").mkdir()  # a hidden folder not of this module's making
    (tmp_path / ".other" / "x").write_bytes(b"x")
    (tmp_path / ".out.staging-keep").mkdir()  # the prefix, not the exact name pattern
    env = dict(os.environ, PYTHONPATH=ROOT, PREPACK_FAILPOINTS=f"{point}=exit(9)")
    done = subprocess.run([sys.executable, "-c", WRITER, str(target)], env=env, capture_output=True, text=True)
    assert done.returncode == 9, done.stderr
    return target


def _staging_folders(tmp_path) -> list[str]:
    return sorted(n for n in os.listdir(tmp_path) if n.startswith(".out.staging-") and n != ".out.staging-keep")


@pytest.mark.parametrize("point, whole", [
    ("own_files_staged", OLD),          # the new files staged, no journal yet: the swap had not begun
    ("own_files_journal", NEW),         # the journal written, nothing moved yet
    ("own_files_aside:1", NEW),         # 1 of 3 old files moved aside
    ("own_files_aside:2", NEW),         # 2 of 3
    ("own_files_aside:3", NEW),         # all old aside, no new one in: the folder held none of its own files
    ("own_files_placed:1", NEW),        # 1 of 3 new files in (a new adapter beside no config)
    ("own_files_placed:2", NEW),        # 2 of 3
])
def test_a_killed_swap_is_finished_or_cleared_by_recover(tmp_path, point, whole):
    target = _killed_write(tmp_path, point)
    assert len(_staging_folders(tmp_path)) == 1  # the kill left it: nothing else would have cleared it
    said = own_files.recover(str(target), owns, say=lambda line: None)
    assert _folder(target) == {**whole, **NOTES}
    assert _staging_folders(tmp_path) == []
    assert len(said) == 1 and "\n" not in said[0]
    if whole is OLD:
        assert said[0].startswith(f"{target}: removed .out.staging-") and "killed before it changed anything" in said[0]
    else:
        assert said[0].startswith(f"{target}: finished the swap of a write killed midway")
    # what is not this module's stays as it was
    assert (tmp_path / ".other" / "x").read_bytes() == b"x" and (tmp_path / ".out.staging-keep").is_dir()


@pytest.mark.parametrize("point", ["own_files_staged", "own_files_aside:2", "own_files_placed:1"])
def test_the_next_write_recovers_first_and_says_so(tmp_path, point):
    target = _killed_write(tmp_path, point)
    said: list[str] = []
    assert own_files.write_own_files(str(target), THIRD, owns, say=said.append) == ["a.bin", "b.json"]
    assert _folder(target) == {**THIRD, **NOTES}
    assert _staging_folders(tmp_path) == []
    assert len(said) == 1 and said[0].startswith(f"{target}: ")


def test_without_failpoints_nothing_is_said_and_nothing_stays(tmp_path):
    target = tmp_path / "out"
    said: list[str] = []
    own_files.write_own_files(str(target), NEW, owns, say=said.append)
    own_files.write_own_files(str(target), THIRD, owns, say=said.append)
    assert said == [] and _folder(target) == THIRD and os.listdir(tmp_path) == ["out"]


def _planted(tmp_path, journal: bytes | None, previous: dict[str, bytes] | None = None):
    target = tmp_path / "out"
    target.mkdir()
    (target / "a.bin").write_bytes(b"old a")
    staging = tmp_path / ".out.staging-abcd1234"
    staging.mkdir()
    (staging / "a.bin").write_bytes(b"new a")
    if journal is not None:
        (staging / ".swap.json").write_bytes(journal)
    if previous is not None:
        (staging / ".previous").mkdir()
        for name, data in previous.items():
            (staging / ".previous" / name).write_bytes(data)
    return target, staging


@pytest.mark.parametrize("journal, why", [
    (b"\xff\xfe", "its .swap.json is not JSON"),
    (b"[]", "its .swap.json is not a journal of this version (prepack-own-files-swap/1)"),
    (json.dumps({"format": "prepack-own-files-swap/1", "new": ["a.bin"], "old": [], "x": 1}).encode(),
     "its .swap.json is not a journal of this version"),
    (json.dumps({"format": "prepack-own-files-swap/1", "new": "a.bin", "old": []}).encode(),
     "its .swap.json does not hold two lists of names"),
    (json.dumps({"format": "prepack-own-files-swap/1", "new": ["../escape.bin"], "old": []}).encode(),
     "its .swap.json names files this command does not write ('../escape.bin')"),
    (json.dumps({"format": "prepack-own-files-swap/1", "new": ["notes.txt"], "old": []}).encode(),
     "its .swap.json names files this command does not write ('notes.txt')"),
    (json.dumps({"format": "prepack-own-files-swap/1", "new": ["a.bin"], "old": [], "pad": "x" * 70000}).encode(),
     "its .swap.json is over 65536 bytes"),
    (json.dumps({"format": "prepack-own-files-swap/1", "new": ["z.bin"], "old": ["a.bin"]}).encode(),
     "its journal names files that are neither staged nor in the folder (z.bin)"),
])
def test_a_journal_it_cannot_vouch_for_leaves_the_folder_as_it_is(tmp_path, journal, why):
    target, staging = _planted(tmp_path, journal, previous={})
    said = own_files.recover(str(target), owns, say=lambda line: None)
    assert len(said) == 1 and why in said[0] and "\n" not in said[0]
    assert said[0].startswith(f"{target}: left ") and said[0].endswith("look at its files, then remove it") \
        or said[0].endswith("look at them, then remove it")
    assert (staging / "a.bin").read_bytes() == b"new a" and (target / "a.bin").read_bytes() == b"old a"


def test_an_older_versions_leftover_with_replaced_files_and_no_journal_is_kept(tmp_path):
    """Before the journal, a killed swap left the old files in .previous/ only: they are not removed."""
    target, staging = _planted(tmp_path, None, previous={"b.json": b"old b"})
    said = own_files.recover(str(target), owns, say=lambda line: None)
    assert said == [f"{target}: left {staging} as it is: it holds a killed write's replaced files (.previous/) and no "
                    "journal to finish it by; look at them, then remove it"]
    assert (staging / ".previous" / "b.json").read_bytes() == b"old b"


def test_a_staging_folder_a_live_writer_holds_is_left(tmp_path):
    target, staging = _planted(tmp_path, None)
    fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert own_files.recover(str(target), owns, say=lambda line: None) == []
        assert staging.is_dir()
    finally:
        os.close(fd)
    assert len(own_files.recover(str(target), owns, say=lambda line: None)) == 1
    assert not staging.exists() and (target / "a.bin").read_bytes() == b"old a"


def test_a_link_in_the_staging_name_is_not_followed(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.bin").write_bytes(b"keep")
    os.symlink(elsewhere, tmp_path / ".out.staging-abcd1234")
    assert own_files.recover(str(target), owns, say=lambda line: None) == []
    assert (elsewhere / "keep.bin").read_bytes() == b"keep" and os.path.islink(tmp_path / ".out.staging-abcd1234")


def test_reading_a_peft_folder_finishes_a_killed_save_lora_first(tmp_path, capsys):
    """generate and export read --lora through read_peft: a folder a killed --save-lora left with a
    new config beside the old weights is finished before it is read, not read as a mix."""
    from train.adapter_files import peft_export
    from train.adapter_files.lora_file import LoraFileError

    target = tmp_path / "adapter"
    target.mkdir()
    (target / "adapter_config.json").write_bytes(b'{"peft_type": "LORA", "r": 1}')
    (target / "adapter_model.safetensors").write_bytes(b"old weights")
    new = {"adapter_config.json": b'{"peft_type": "LORA", "r": 2}', "adapter_model.safetensors": b"new weights"}
    writer = ("import sys\nfrom train.adapter_files import peft_export\n"
              f"peft_export.write_folder(sys.argv[1], {new!r}, overwrite=True)\n")
    env = dict(os.environ, PYTHONPATH=ROOT, PREPACK_FAILPOINTS="own_files_placed:1=exit(9)")
    assert subprocess.run([sys.executable, "-c", writer, str(target)], env=env).returncode == 9
    assert _folder(target) == {"adapter_config.json": new["adapter_config.json"]}  # the kill's mix
    with pytest.raises(LoraFileError, match="adapter_model.safetensors: not a safetensors file"):
        peft_export.read_peft(str(target))  # the bytes here are no real adapter: what matters is which ones it read
    assert _folder(target) == new and os.listdir(tmp_path) == ["adapter"]
    assert capsys.readouterr().err.startswith(f"{target}: finished the swap of a write killed midway")


def test_another_users_staging_folder_is_left(tmp_path, monkeypatch):
    target, staging = _planted(tmp_path, None)
    real = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: real + 1)  # as another user sees this user's folder
    assert own_files.recover(str(target), owns, say=lambda line: None) == []
    assert (staging / "a.bin").read_bytes() == b"new a"
