"""What a run reads from its compilation cache folder is bounded (train/compilation/cache_files.py), and a
folder others can write is not used (train/compilation/compile_cache.py).

Planted files are real: a FIFO (os.mkfifo), a link to /dev/zero, a link out of the folder, a file over
the cap; for the remat verdicts, the preload records and JAX's own entry at the run's key. Anything
that could block runs on a thread or in a subprocess with a time limit, so a hang fails the test
instead of holding the suite.
"""

from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train.compilation import unfit_steps
from train.compilation import cache_files, compile_cache, executable_preload

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "ab" * 32


def within(seconds: float, fn, *args):
    """fn(*args) on a daemon thread; fails the test if it has not returned in `seconds` (a blocked open)."""
    done: dict = {}

    def go() -> None:
        try:
            done["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001
            done["error"] = e

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{getattr(fn, '__name__', fn)} still blocked after {seconds} s"
    if "error" in done:
        raise done["error"]
    return done["value"]


def plant(path: str, kind: str, outside: str) -> None:
    """One hostile file at `path`: a FIFO, a link to /dev/zero, a link out of the folder (to `outside`,
    a good file), or a sparse file one byte over the biggest cap it may be read with."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.lexists(path):
        os.remove(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "zero":
        os.symlink("/dev/zero", path)
    elif kind == "out":
        os.symlink(outside, path)
    elif kind == "huge":
        with open(path, "wb") as f:
            f.truncate(cache_files.MAX_ENTRY_BYTES + 1)  # sparse: no disk, no time
    else:
        raise AssertionError(kind)


KINDS = ["fifo", "zero", "out", "huge"]
REASONS = {"fifo": "not a regular file", "zero": "a symbolic link, not a file the cache wrote",
           "out": "a symbolic link, not a file the cache wrote", "huge": "larger than"}


@pytest.mark.parametrize("kind", KINDS)
def test_the_one_reader_reads_only_a_regular_file_inside_the_folder(tmp_path, kind) -> None:
    folder, good = tmp_path / "xla", tmp_path / "good.json"
    good.write_text("{}")
    plant(str(folder / "sub" / "f.json"), kind, str(good))
    with pytest.raises(cache_files.NotRead, match=f"^{REASONS[kind]}"):
        within(10, cache_files.read, str(folder), "sub/f.json", 4096)
    assert within(10, cache_files.read, str(folder), "sub/missing.json", 4096) is None
    (folder / "sub" / "ok.json").write_text("{}")
    assert cache_files.read(str(folder), "sub/ok.json", 2) == b"{}"
    with pytest.raises(cache_files.NotRead, match="^larger than 1 bytes"):
        cache_files.read(str(folder), "sub/ok.json", 1)


def test_a_subfolder_that_is_a_link_out_of_the_folder_is_not_followed(tmp_path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "f.json").write_text("{}")
    (tmp_path / "xla").mkdir()
    os.symlink(elsewhere, tmp_path / "xla" / "sub")
    with pytest.raises(cache_files.NotRead, match="^a symbolic link"):
        cache_files.read(str(tmp_path / "xla"), "sub/f.json", 4096)
    with pytest.raises(cache_files.NotRead, match="is not a name inside the folder"):
        cache_files.read(str(tmp_path / "xla"), "../elsewhere/f.json", 4096)


@pytest.mark.parametrize("kind", KINDS)
def test_a_planted_remat_verdict_is_no_verdict_and_never_blocks(tmp_path, kind) -> None:
    folder = str(tmp_path / "xla")
    verdict = unfit_steps.UnfitStep(KEY, 10 << 30, "21.40 GiB")
    good = unfit_steps.remember(folder, verdict)
    assert unfit_steps.recall(folder, KEY, 1 << 30) == verdict
    outside = str(tmp_path / "outside.json")
    os.replace(good, outside)  # a valid verdict, but out of the folder: only reachable through the link
    plant(unfit_steps.path_of(folder, KEY), kind, outside)
    assert within(10, unfit_steps.recall, folder, KEY, 1 << 30) is None


@pytest.mark.parametrize("kind", KINDS)
def test_a_planted_preload_record_is_named_in_one_line_and_ignored(tmp_path, kind) -> None:
    folder, hint = str(tmp_path / "xla"), executable_preload.hint_of({"test": kind})
    path = executable_preload.record_path(folder, hint)
    outside = str(tmp_path / "outside.json")
    with open(outside, "w") as f:
        json.dump({"format": executable_preload.FORMAT, "runtime": {}, "entries": []}, f)
    plant(path, kind, outside)
    with pytest.raises(executable_preload.PreloadRecordError) as e:
        within(10, executable_preload.read_record, path)
    reason = REASONS[kind] if kind != "huge" else "larger than 262,144 bytes"
    assert str(e.value).startswith(f"{path}: {reason}") and str(e.value).endswith("; not read")


# JAX's own lookup of the run's key, and the preload's load of it, with the entry replaced by each
# planted kind: a miss (one line naming it), then a compile; never a hang, never a traceback.
PLANTED_ENTRY = """
import io, os, shutil, sys, numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, {root!r})
from train.compilation import cache_files, compile_cache, executable_preload as ep
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
cache = {cache!r}
assert compile_cache.enable(cache, sys.stdout) == cache
hint, x = ep.hint_of({{"test": "planted"}}), jnp.arange(4.0)
fn = lambda v: jnp.sin(v) * 2.0 + 1.0
preload = ep.begin(cache, hint, sys.stdout); jax.jit(fn)(x); ep.end(preload, io.StringIO())
(entry,) = ep.read_record(ep.record_path(cache, hint)).entries
path = os.path.join(cache, entry.key + "-cache")
outside = os.path.join(os.path.dirname(cache), "outside-entry")
shutil.copy(path, outside)  # a real entry of this very program, reachable only through a link
for kind in {kinds!r}:
    os.remove(path)
    if kind == "fifo": os.mkfifo(path)
    elif kind == "zero": os.symlink("/dev/zero", path)
    elif kind == "out": os.symlink(outside, path)
    elif kind == "huge":
        with open(path, "wb") as f: f.truncate(cache_files.MAX_ENTRY_BYTES + 1)
    for preloading in (False, True):
        jax.clear_caches()
        preload = ep.begin(cache, hint, sys.stdout) if preloading else None
        out = np.asarray(jax.jit(fn)(x))
        facts = ep.end(preload, io.StringIO())
        assert np.allclose(out, np.sin(np.arange(4.0)) * 2.0 + 1.0)
        assert facts is None or facts["used"] == [], facts
    print("DONE", kind, flush=True)
"""


def test_a_planted_entry_at_the_runs_key_is_a_miss_with_or_without_the_preload(tmp_path) -> None:
    cache = str(tmp_path / "xla")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", PLANTED_ENTRY.format(root=ROOT, cache=cache, kinds=KINDS)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert [line for line in lines if line.startswith("DONE")] == [f"DONE {kind}" for kind in KINDS]
    skipped = [line for line in lines if line.endswith("; not read (compiled instead)")]
    assert len(skipped) == 3  # one line per planted file and reason, said once (the link kinds share theirs)
    assert any(": not a regular file;" in line for line in skipped)
    assert any(": a symbolic link, not a file the cache wrote;" in line for line in skipped)
    assert any(f": larger than {cache_files.MAX_ENTRY_BYTES:,} bytes;" in line for line in skipped)
    assert all(line.startswith(f"XLA compilation cache: {cache}/jit_") for line in skipped)
    assert "Traceback" not in done.stderr


# A load that never ends (a deserialize stuck in the runtime): the run still ends with its summary.
STUCK_LOAD = """
import io, os, sys, time, jax, jax.numpy as jnp
sys.path.insert(0, {root!r})
from train.compilation import compile_cache, executable_preload as ep
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
cache = {cache!r}
compile_cache.enable(cache, io.StringIO())
hint, x = ep.hint_of({{"test": "stuck"}}), jnp.arange(4.0)
fn = lambda v: jnp.cos(v) * 3.0
preload = ep.begin(cache, hint, io.StringIO()); jax.jit(fn)(x); ep.end(preload, io.StringIO())
ep._load_entry = lambda *args: time.sleep(3600)
preload = ep.begin(cache, hint, io.StringIO())
time.sleep(0.5)
assert preload.history and preload.history[0].future.running()
ep.end(preload, io.StringIO())
print("summary", flush=True)
"""


def test_the_process_exits_with_a_load_in_flight(tmp_path) -> None:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", STUCK_LOAD.format(root=ROOT, cache=str(tmp_path / "xla"))],
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "summary", done.stderr[-3000:]
    assert time.monotonic() - started < 60  # the import and one compile; not the hour the load would take


def output_count_twin(outputs: int):
    """Two programs JAX names alike (jit_f), with another output count."""
    def f(x):
        return (x * 2.0,) if outputs == 1 else (x * 2.0, x + 1.0, x - 1.0)
    return jax.jit(f)


def test_an_entry_of_another_program_is_compiled_again_with_one_line(tmp_path) -> None:
    min_time = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    out = io.StringIO()
    try:
        cache = compile_cache.enable(str(tmp_path / "xla"), out)
        x = jnp.arange(3.0)
        output_count_twin(1)(x)
        (one,) = [n for n in os.listdir(cache) if n.startswith("jit_f-")]
        output_count_twin(3)(x)
        (three,) = [n for n in os.listdir(cache) if n.startswith("jit_f-") and n != one]
        os.replace(os.path.join(cache, one), os.path.join(cache, three))  # the 1-output executable at the 3's key
        jax.clear_caches()
        got = output_count_twin(3)(x)
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_time)
        compile_cache.enable(None, io.StringIO())
    assert [np.asarray(g).tolist() for g in got] == [[0.0, 2.0, 4.0], [1.0, 2.0, 3.0], [-1.0, 0.0, 1.0]]
    assert ("XLA compilation cache: the entry for jit_f holds another program (1 outputs, not 3); compiled jit_f "
            "instead (delete its jit_f-*-cache files from the cache folder to stop this line)\n") in out.getvalue()


@pytest.mark.parametrize(("mode", "said"), [(0o770, "is group-writable"), (0o707, "is world-writable"),
                                            (0o777, "is group- and world-writable")])
def test_a_folder_others_can_write_is_not_used(tmp_path, mode, said) -> None:
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(mode)
    out = io.StringIO()
    try:
        assert compile_cache.enable(str(folder), out) is None
        assert not jax.config.jax_enable_compilation_cache
    finally:
        compile_cache.enable(None, io.StringIO())
    assert out.getvalue() == (f"XLA compilation cache: not used: --compile-cache {folder} {said}, so others could plant "
                              f"executables this run would run; run chmod go-w {folder}, or pass --compile-cache with a "
                              "folder of your own (this run goes on without the cache)\n")
    folder.chmod(0o700)  # fixed as the line says: used
    try:
        assert compile_cache.enable(str(folder), io.StringIO()) == str(folder)
    finally:
        compile_cache.enable(None, io.StringIO())


def test_a_folder_owned_by_another_user_is_not_used_and_the_line_names_its_source(tmp_path, monkeypatch) -> None:
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv(compile_cache.ENV, str(folder))
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(folder).st_uid + 1)  # as another user sees it
    out = io.StringIO()
    try:
        assert compile_cache.enable(None, out) is None
    finally:
        monkeypatch.undo()
        compile_cache.enable(None, io.StringIO())
    assert out.getvalue().startswith(f"XLA compilation cache: not used: JAX_COMPILATION_CACHE_DIR {folder} is owned by ")
    assert out.getvalue().endswith(", not by you, so others could plant executables this run would run; pass "
                                   "--compile-cache with a folder of your own (this run goes on without the cache)\n")


def test_only_the_folder_is_judged_and_the_suites_own_folder_is_used(tmp_path) -> None:
    parent = tmp_path / "team"
    parent.mkdir()
    parent.chmod(0o777)  # a parent others can write: not judged
    folder = parent / "mine"
    try:
        assert compile_cache.enable(str(folder), io.StringIO()) == str(folder)
        assert compile_cache.enable(None, io.StringIO()) == os.environ[compile_cache.ENV]  # conftest.py's mkdtemp
    finally:
        compile_cache.enable(None, io.StringIO())
        parent.chmod(0o700)


def test_the_folders_made_for_the_cache_are_the_users_alone_whatever_the_umask(tmp_path) -> None:
    old = os.umask(0)
    try:
        folder = str(tmp_path / "new" / "xla")
        assert compile_cache.enable(folder, io.StringIO()) == folder
        unfit_steps.remember(folder, unfit_steps.UnfitStep(KEY, 1 << 30, "refused"))
        executable_preload.write_record(executable_preload.record_path(folder, KEY),
                                        executable_preload.Record({}, ()))
    finally:
        os.umask(old)
        compile_cache.enable(None, io.StringIO())
    for made in (folder, os.path.join(folder, unfit_steps.FOLDER), os.path.join(folder, executable_preload.FOLDER)):
        assert stat.S_IMODE(os.stat(made).st_mode) == 0o700, made


def test_the_working_folder_as_cache_is_refused_naming_the_folder_and_its_source(tmp_path, monkeypatch) -> None:
    from train.run_config import outputs
    from train.run_config.config import TrainConfig, TrainError

    here = tmp_path / "work"
    (here / "S").mkdir(parents=True)
    monkeypatch.chdir(here)
    monkeypatch.setenv(compile_cache.ENV, str(here))
    with pytest.raises(TrainError) as e:
        outputs.check_outputs(TrainConfig(shards="S", steps=2))
    assert str(e.value).startswith(f"JAX_COMPILATION_CACHE_DIR {here} is the working folder; ")
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path))
    with pytest.raises(TrainError) as e:
        outputs.check_outputs(TrainConfig(shards="S", steps=2))
    assert str(e.value).startswith(f"JAX_COMPILATION_CACHE_DIR {tmp_path} is a folder above the working folder; ")
    monkeypatch.delenv(compile_cache.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(here))
    (here / "prepack" / "xla").mkdir(parents=True)
    monkeypatch.chdir(here / "prepack" / "xla")
    with pytest.raises(TrainError) as e:
        outputs.check_outputs(TrainConfig(shards=str(here / "S"), steps=2))
    assert str(e.value).startswith(f"--compile-cache's default {here}/prepack/xla is the working folder")
    with pytest.raises(TrainError) as e:
        outputs.check_outputs(TrainConfig(shards=str(here / "S"), steps=2, compile_cache=str(here)))
    assert str(e.value).startswith(f"--compile-cache {here} is a folder above the working folder")


def test_verify_refuses_a_cache_inside_the_set_before_any_work(tmp_path) -> None:
    from apps import verify
    from testkit.shard_sets import build_shard_set

    shard_set = tmp_path / "L64"
    build_shard_set(shard_set, num_rows=4, max_length=64)
    (shard_set / "00-not-a-shard.array_record").write_bytes(b"damage: verifying the set would report it")
    out, err = io.StringIO(), io.StringIO()
    assert verify.main([str(shard_set), "--model", "tiny-qwen3", "--compile-cache", str(shard_set / "xla")],
                       out=out, err=err) == verify.EXIT_REFUSED
    assert out.getvalue() == ""  # nothing verified, nothing loaded
    assert err.getvalue() == (f"prepack verify: --compile-cache {shard_set / 'xla'} lies inside the input SET {shard_set}; "
                              "writing there could replace or delete what this run reads: give --compile-cache a path "
                              "outside every input\n")
    assert not (shard_set / "xla").exists()
