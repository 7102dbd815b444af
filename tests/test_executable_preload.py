"""--compile-preload (train/compilation/executable_preload.py): a repeat run's cached executables load on
threads, JAX takes one only for the exact lookup it was loaded for, and a record is a stranger's file."""

from __future__ import annotations

import base64
import io
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from testkit.shard_sets import TEST_TOKENIZER, build_shard_set
from train import cli
from train.compilation import compile_cache, executable_preload


@pytest.fixture
def cache(tmp_path):
    """A fresh cache folder that keeps every program (JAX's 1 s threshold would keep none of these)."""
    min_time = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    folder = compile_cache.enable(str(tmp_path / "xla"), io.StringIO())
    yield folder
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_time)
    compile_cache.enable(None, io.StringIO())


HINT = executable_preload.hint_of({"test": "preload"})


def compiled_once(fn, x, folder: str) -> list[executable_preload.Entry]:
    """Compiles `fn` (a cold compile: the cache writes it) under a preload session; the record's entries."""
    jax.clear_caches()  # JAX's lookup in the cache, not its in-memory executable of an earlier test
    preload = executable_preload.begin(folder, HINT, io.StringIO())
    fn.lower(x).compile()
    executable_preload.end(preload, io.StringIO())
    return list(executable_preload.read_record(executable_preload.record_path(folder, HINT)).entries)


def record(*entries: executable_preload.Entry, **runtime: str) -> executable_preload.Record:
    return executable_preload.Record({**executable_preload.runtime_of(jax.devices()[0].client), **runtime}, entries)


def twice(x):
    return jnp.sin(x) * 2.0 + 1.0


def thrice(x):
    return jnp.cos(x) * 3.0 - 1.0


def test_a_lookup_is_answered_from_the_preload_only_for_the_key_options_and_devices_it_was_loaded_for(cache) -> None:
    x = jnp.linspace(0.0, 1.0, 8)
    (entry,) = compiled_once(jax.jit(twice), x, cache)
    assert entry.module == "jit_twice" and entry.key.startswith("jit_twice-") and entry.devices == (jax.devices()[0].id,)

    def run(entries: list[executable_preload.Entry], fn) -> tuple[list[str], np.ndarray]:
        executable_preload.write_record(executable_preload.record_path(cache, HINT), record(*entries))
        jax.clear_caches()  # JAX's lookup in the cache, not its in-memory executable
        preload = executable_preload.begin(cache, HINT, io.StringIO())
        out = np.asarray(jax.jit(fn)(x))
        facts = executable_preload.end(preload, io.StringIO())
        return facts["used"], out

    used, out = run([entry], twice)
    assert used == ["jit_twice"] and np.allclose(out, twice(np.asarray(x)))
    # Another program asks under its own key: the preloaded one is never returned for it.
    used, out = run([entry], thrice)
    assert used == [] and np.allclose(out, thrice(np.asarray(x)))
    # The right key with other compile options, or other devices: JAX's own read, not the preload.
    forged = executable_preload.Entry(entry.module, entry.key, entry.options + b"\x00", entry.devices)
    used, out = run([forged], twice)
    assert used == [] and np.allclose(out, twice(np.asarray(x)))
    # Entries of another runtime (another libtpu, JAX or platform) are never deserialized.
    executable_preload.write_record(executable_preload.record_path(cache, HINT), record(entry, jax="0.0.0"))
    preload = executable_preload.begin(cache, HINT, io.StringIO())
    assert preload.loads == {} and executable_preload.end(preload, io.StringIO())["loaded"] == []


def test_a_function_recorded_once_and_asked_for_under_another_key_lets_its_stale_load_go(cache) -> None:
    x = jnp.arange(6.0)
    (entry,) = compiled_once(jax.jit(twice), x, cache)
    stale = executable_preload.Entry(entry.module, f"{entry.module}-{'0' * 64}", entry.options, entry.devices)
    executable_preload.write_record(executable_preload.record_path(cache, HINT), record(stale))
    jax.clear_caches()
    preload = executable_preload.begin(cache, HINT, io.StringIO())
    assert set(preload.loads) == {stale.key}
    assert np.allclose(np.asarray(jax.jit(twice)(x)), twice(np.asarray(x)))
    assert preload.loads == {} and preload.used == []  # not held until the run's end
    executable_preload.end(preload, io.StringIO())


def test_a_damaged_entry_falls_back_to_jax_which_compiles_afresh(cache) -> None:
    x = jnp.arange(5.0)
    (entry,) = compiled_once(jax.jit(thrice), x, cache)
    from jax._src import compilation_cache

    with open(os.path.join(cache, entry.key + "-cache"), "wb") as f:
        f.write(compilation_cache.compress_executable(b"not an executable"))  # read whole; fails to deserialize
    jax.clear_caches()
    preload = executable_preload.begin(cache, HINT, io.StringIO())
    with pytest.warns(UserWarning, match="Error reading persistent compilation cache entry"):
        out = np.asarray(jax.jit(thrice)(x))
    facts = executable_preload.end(preload, io.StringIO())
    assert facts["loaded"] == ["jit_thrice"] and facts["used"] == []
    assert np.allclose(out, thrice(np.asarray(x)))


def test_the_record_keeps_only_what_the_cache_holds(cache) -> None:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 3600)  # nothing is worth a file
    preload = executable_preload.begin(cache, HINT, io.StringIO())
    jax.jit(twice).lower(jnp.ones(4)).compile()
    assert executable_preload.end(preload, io.StringIO())["loaded"] == []
    assert not os.path.exists(executable_preload.record_path(cache, HINT))  # no entry: no record
    assert executable_preload.begin(None, HINT, io.StringIO()) is None  # --compile-cache off: no preload


ENTRY = {"module": "jit_train_step", "key": "jit_train_step-" + "ab" * 32,
         "options": base64.b64encode(b"\x08\x01").decode(), "devices": [0]}
RUNTIME = {"platform": "cpu", "platform_version": "cpu", "jax": "0.10.2", "jaxlib": "0.10.2"}


def a_record(**fields) -> dict:
    return {"format": "prepack-preload/1", "runtime": RUNTIME, "entries": [ENTRY], **fields}


@pytest.mark.parametrize("text, message", [
    ("{", "not a JSON record (JSONDecodeError)"),
    ("[" * 200_000, "not a JSON record (RecursionError)"),
    ([], "not a preload record (an object of format, runtime and entries expected)"),
    (a_record(format="prepack-preload/9"), "format: 'prepack-preload/9', expected 'prepack-preload/1'"),
    (a_record(runtime={"jax": 1}), "runtime: an object of platform, platform_version, jax, jaxlib (strings) expected"),
    (a_record(entries=[ENTRY] * 33), "entries: a list of at most 32 expected"),
    (a_record(entries=[{**ENTRY, "key": "../../etc/passwd"}]),
     "entries[0].key: not a JAX cache key of its module (<module>-<64 hex digits>)"),
    (a_record(entries=[{**ENTRY, "key": "jit_evil"}]), "entries[0].key: not a JAX cache key of its module"),
    (a_record(entries=[{**ENTRY, "key": "jit_other-" + "ab" * 32}]), "entries[0].key: not a JAX cache key of its module"),
    (a_record(entries=[{**ENTRY, "key": "jit_train_step-" + "ab" * 32 + "/x"}]),
     "entries[0].key: not a JAX cache key of its module"),
    (a_record(entries=[{**ENTRY, "module": 7}]), "entries[0].module: not a JAX module name (letters, digits, _ . -; at most 200)"),
    (a_record(entries=[{**ENTRY, "options": "%%%"}]), "entries[0].options: not base64"),
    (a_record(entries=[{**ENTRY, "options": "A" * 100_000}]), "entries[0].options: base64 of at most 65,536 bytes expected"),
    (a_record(entries=[{**ENTRY, "devices": ["0"]}]), "entries[0].devices: a list of 1 to 4096 device ids expected"),
    (a_record(entries=[{**ENTRY, "devices": []}]), "entries[0].devices: a list of 1 to 4096 device ids expected"),
    (a_record(entries=[{**ENTRY, "extra": 1}]), "entries[0]: an object of module, key, options and devices expected"),
])
def test_a_strangers_record_is_named_in_one_line_and_ignored(cache, text, message) -> None:
    path = executable_preload.record_path(cache, HINT)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text if isinstance(text, str) else json.dumps(text))
    with pytest.raises(executable_preload.PreloadRecordError) as e:
        executable_preload.read_record(path)
    assert str(e.value).startswith(f"{path}: {message}")
    out = io.StringIO()
    preload = executable_preload.begin(cache, HINT, out)
    assert preload is not None and preload.loads == {}
    assert out.getvalue() == f"compile preload: {e.value}; ignored\n"
    executable_preload.abandon(preload)


def test_an_oversized_record_or_a_fifo_is_not_read(cache) -> None:
    path = executable_preload.record_path(cache, HINT)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(b" " * (executable_preload.MAX_FILE_BYTES + 1))
    with pytest.raises(executable_preload.PreloadRecordError, match=r": larger than 262,144 bytes; not read$"):
        executable_preload.read_record(path)
    os.remove(path)
    os.mkfifo(path)  # nobody writes it: a blocking open would hold the run forever
    with pytest.raises(executable_preload.PreloadRecordError, match=r": not a regular file; not read$"):
        executable_preload.read_record(path)


def test_a_key_named_twice_is_loaded_once() -> None:
    parsed = executable_preload.record_of(a_record(entries=[ENTRY, {**ENTRY, "devices": [1]}, ENTRY]), "r.json")
    assert [e.devices for e in parsed.entries] == [(0,)]


def test_an_unknown_compile_preload_value_is_refused_in_one_line() -> None:
    from train.run_config.config import TrainConfig, TrainError
    from train.run_setup import check_flags

    with pytest.raises(TrainError, match=r"^unknown --compile-preload 'maybe'; choose on or off$"):
        check_flags(TrainConfig(shards="unused", compile_preload="maybe"))


OTHER_DEVICE = """
import io, os, sys, numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, {root!r})
from train.compilation import compile_cache, executable_preload as ep
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
compile_cache.enable({cache!r}, io.StringIO())
hint, x = ep.hint_of({{"test": "devices"}}), jnp.arange(4.0)
fn = lambda v: jnp.sin(v) * 2.0 + 1.0
preload = ep.begin({cache!r}, hint, io.StringIO()); jax.jit(fn).lower(x).compile(); ep.end(preload, io.StringIO())
(entry,) = ep.read_record(ep.record_path({cache!r}, hint)).entries
assert entry.devices == (0,), entry.devices
# The same key, recorded as loaded for the second device: deserialized there, never given to JAX for the first.
moved = ep.Entry(entry.module, entry.key, entry.options, (1,))
ep.write_record(ep.record_path({cache!r}, hint), ep.Record(ep.runtime_of(jax.devices()[0].client), (moved,)))
jax.clear_caches()
preload = ep.begin({cache!r}, hint, io.StringIO())
out = np.asarray(jax.jit(fn)(x))
facts = ep.end(preload, io.StringIO())
assert facts["loaded"] == [entry.module] and facts["used"] == [], facts
assert np.allclose(out, np.sin(np.arange(4.0)) * 2.0 + 1.0)
print("OK")
"""


def test_an_entry_loaded_for_other_devices_is_not_given_to_jax(tmp_path) -> None:
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", OTHER_DEVICE.format(root=root, cache=str(tmp_path / "xla"))],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-2000:]


def test_the_process_age_is_the_time_since_the_process_started() -> None:
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (f"import sys, time; sys.path.insert(0, {root!r}); time.sleep(0.5); "
            "from train.measurement.metrics import process_age_s; print(process_age_s())")
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120).stdout)
    assert 0.5 <= age < 10  # the sleep, the interpreter's start and one import; not the machine's uptime


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("preload") / "L64")
    build_shard_set(path, num_rows=4, max_length=64, tokenizer={**TEST_TOKENIZER, "name": "tiny-test", "vocab_size": 512})
    return path


def summary_of(shards: str, tmp_path, folder: str, *more: str) -> dict:
    metrics = tmp_path / "m.jsonl"
    assert cli.main(["--shards", shards, "--model", "tiny-qwen3", "--lora-rank", "2", "--batch-size", "1", "--steps", "2",
                     "--log-every", "1", "--metrics-out", str(metrics), "--overwrite", "--remat", "none",
                     "--compile-cache", folder, *more]) == 0
    return json.loads(metrics.read_text().splitlines()[-1])["summary"]


def test_a_repeat_train_run_takes_its_step_from_the_preload_and_trains_the_same(shards, tmp_path, cache, capsys) -> None:
    cold = summary_of(shards, tmp_path, cache)
    assert cold["compile_preload"]["used"] == []
    (name,) = os.listdir(os.path.join(cache, executable_preload.FOLDER))
    written = executable_preload.read_record(os.path.join(cache, executable_preload.FOLDER, name))
    modules = [e.module for e in written.entries]
    assert "jit_train_step" in modules
    warm = summary_of(shards, tmp_path, cache)
    assert "jit_train_step" in warm["compile_preload"]["used"]
    assert warm["final_loss"] == cold["final_loss"] and warm["first_loss"] == cold["first_loss"]
    assert warm["launch_to_first_step_s"] > 0 and warm["first_step_time_s"] > 0
    # Another max length or option is another record: nothing of this one is loaded.
    other = summary_of(shards, tmp_path, cache, "--lora-rank", "4")
    assert other["compile_preload"]["loaded"] == []
    off = summary_of(shards, tmp_path, cache, "--compile-preload", "off")
    assert "compile_preload" not in off and off["final_loss"] == cold["final_loss"]
    capsys.readouterr()
