"""--compile-preload (train/run_config/executable_preload.py): a repeat run's cached executables load on
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
from train.measurement.metrics import process_age_s
from train.run_config import compile_cache, executable_preload


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
    preload = executable_preload.begin(folder, HINT, io.StringIO())
    fn.lower(x).compile()
    executable_preload.end(preload, io.StringIO())
    return executable_preload.read_record(executable_preload.record_path(folder, HINT))


def twice(x):
    return jnp.sin(x) * 2.0 + 1.0


def thrice(x):
    return jnp.cos(x) * 3.0 - 1.0


def test_a_lookup_is_answered_from_the_preload_only_for_the_key_options_and_devices_it_was_loaded_for(cache) -> None:
    x = jnp.linspace(0.0, 1.0, 8)
    (entry,) = compiled_once(jax.jit(twice), x, cache)
    assert entry.module == "jit_twice" and entry.key.startswith("jit_twice-") and entry.devices == (jax.devices()[0].id,)

    def run(record: list[executable_preload.Entry], fn) -> tuple[list[str], np.ndarray]:
        executable_preload.write_record(executable_preload.record_path(cache, HINT), record)
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
    moved = executable_preload.Entry(entry.module, entry.key, entry.options, (jax.devices()[0].id, jax.devices()[0].id))
    used, out = run([moved], twice)
    assert used == [] and np.allclose(out, twice(np.asarray(x)))


def test_a_damaged_entry_falls_back_to_jax_which_compiles_afresh(cache) -> None:
    x = jnp.arange(5.0)
    (entry,) = compiled_once(jax.jit(thrice), x, cache)
    with open(os.path.join(cache, entry.key + "-cache"), "wb") as f:
        f.write(b"not an executable")
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


@pytest.mark.parametrize("record, message", [
    ("{", "not a JSON record"),
    ([], "not a preload record (an object of format and entries expected)"),
    ({"format": "prepack-preload/9", "entries": []}, "format: 'prepack-preload/9', expected 'prepack-preload/1'"),
    ({"format": "prepack-preload/1", "entries": [ENTRY] * 33}, "entries: a list of at most 32 expected"),
    ({"format": "prepack-preload/1", "entries": [{**ENTRY, "key": "../../etc/passwd"}]},
     "entries[0].key: not a JAX cache name (letters, digits, _ . -; at most 300)"),
    ({"format": "prepack-preload/1", "entries": [{**ENTRY, "module": 7}]},
     "entries[0].module: not a JAX cache name"),
    ({"format": "prepack-preload/1", "entries": [{**ENTRY, "options": "%%%"}]}, "entries[0].options: not base64"),
    ({"format": "prepack-preload/1", "entries": [{**ENTRY, "options": "A" * 100_000}]},
     "entries[0].options: base64 of at most 65,536 bytes expected"),
    ({"format": "prepack-preload/1", "entries": [{**ENTRY, "devices": ["0"]}]},
     "entries[0].devices: a list of 1 to 4096 device ids expected"),
    ({"format": "prepack-preload/1", "entries": [{**ENTRY, "devices": []}]},
     "entries[0].devices: a list of 1 to 4096 device ids expected"),
    ({"format": "prepack-preload/1", "entries": [{**ENTRY, "extra": 1}]},
     "entries[0]: an object of module, key, options and devices expected"),
])
def test_a_strangers_record_is_named_in_one_line_and_ignored(cache, record, message) -> None:
    path = executable_preload.record_path(cache, HINT)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(record if isinstance(record, str) else json.dumps(record))
    with pytest.raises(executable_preload.PreloadRecordError) as e:
        executable_preload.read_record(path)
    assert str(e.value).startswith(f"{path}: {message}")
    out = io.StringIO()
    preload = executable_preload.begin(cache, HINT, out)
    assert preload is not None and preload.loads == {}
    assert out.getvalue() == f"compile preload: {e.value}; ignored (this run writes it afresh)\n"
    executable_preload.abandon(preload)


def test_an_oversized_record_is_not_read(cache) -> None:
    path = executable_preload.record_path(cache, HINT)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(b" " * (executable_preload.MAX_FILE_BYTES + 1))
    with pytest.raises(executable_preload.PreloadRecordError, match=r": larger than 262,144 bytes; not read$"):
        executable_preload.read_record(path)


def test_the_process_age_grows_from_the_process_start() -> None:
    first = process_age_s()
    assert first is not None and 0 < first < 24 * 3600
    assert process_age_s() >= first


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
    (record,) = os.listdir(os.path.join(cache, executable_preload.FOLDER))
    modules = [e.module for e in executable_preload.read_record(os.path.join(cache, executable_preload.FOLDER, record))]
    assert "jit_train_step" in modules
    warm = summary_of(shards, tmp_path, cache)
    assert "jit_train_step" in warm["compile_preload"]["used"]
    assert warm["final_loss"] == cold["final_loss"] and warm["first_loss"] == cold["first_loss"]
    assert warm["launch_to_first_step_s"] > warm["first_step_time_s"] > 0
    # Another max length or option is another record: nothing of this one is loaded.
    other = summary_of(shards, tmp_path, cache, "--lora-rank", "4")
    assert other["compile_preload"]["loaded"] == []
    off = summary_of(shards, tmp_path, cache, "--compile-preload", "off")
    assert "compile_preload" not in off and off["final_loss"] == cold["final_loss"]
    capsys.readouterr()
