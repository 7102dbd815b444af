"""--compile-cache DIR|off (train/compilation/compile_cache.py): which folder, a refused folder in one line,
`off` writes nothing even where JAX_COMPILATION_CACHE_DIR is set, and a repeat run's step comes
from the cache."""

from __future__ import annotations

import io
import json
import os

import jax
import jax.numpy as jnp
import pytest

from testkit.shard_sets import TEST_TOKENIZER, build_shard_set
from train import cli
from train.compilation import compile_cache


@pytest.fixture
def restore_cache():
    """Each test leaves JAX's cache as conftest.py set it (JAX_COMPILATION_CACHE_DIR)."""
    min_time = jax.config.jax_persistent_cache_min_compile_time_secs
    yield
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_time)
    compile_cache.enable(None, io.StringIO())


def test_the_flag_then_the_environment_then_the_user_cache_folder(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
    assert compile_cache.resolve("off") is None
    assert compile_cache.resolve(str(tmp_path / "mine")) == str(tmp_path / "mine")
    assert compile_cache.resolve(None) == str(tmp_path / "env")
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.resolve(None) == str(tmp_path / "xdg" / "prepack" / "xla")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert compile_cache.resolve(None) == os.path.expanduser("~/.cache/prepack/xla")


def test_off_writes_nothing_even_where_the_environment_names_a_folder(monkeypatch, tmp_path, restore_cache) -> None:
    env_dir = tmp_path / "env"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(env_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    out = io.StringIO()
    assert compile_cache.enable("off", out) is None
    assert out.getvalue() == "XLA compilation cache: off\n"
    jax.jit(lambda x: jnp.sin(x) * 3 + 1)(jnp.ones((7, 3))).block_until_ready()
    assert not env_dir.exists() or not os.listdir(env_dir)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("compile-cache") / "L64")
    build_shard_set(path, num_rows=4, max_length=64, tokenizer={**TEST_TOKENIZER, "name": "tiny-test", "vocab_size": 512})
    return path


def train_args(shards: str, tmp_path, *more: str) -> list[str]:
    return ["--shards", shards, "--model", "tiny-qwen3", "--lora-rank", "2", "--batch-size", "1", "--steps", "2",
            "--log-every", "1", "--metrics-out", str(tmp_path / "m.jsonl"), "--overwrite", *more]


def test_a_folder_that_cannot_be_written_is_one_line_before_the_weights_load(shards, tmp_path, capsys, restore_cache) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert cli.main(train_args(shards, tmp_path, "--compile-cache", str(blocker / "xla"))) == 2
    err = capsys.readouterr().err  # the output rule judges the folder first, as every output of the run
    assert err == (f"prepack train: --compile-cache {blocker / 'xla'}: {blocker} is a file, so no folder can be made "
                   "there; give another path\n")
    # Where the rule lets a folder pass that still cannot be made, the cache says so in one line too.
    with pytest.raises(compile_cache.CompileCacheError) as e:
        compile_cache.enable(str(blocker / "xla"), io.StringIO())
    assert str(e.value).startswith(f"--compile-cache cannot create {blocker / 'xla'}: ")
    assert str(e.value).endswith("; pass a writable folder, or --compile-cache off")


def first_step_time(shards: str, tmp_path, folder: str, capsys) -> float:
    assert cli.main(train_args(shards, tmp_path, "--compile-cache", folder, "--remat", "none")) == 0
    capsys.readouterr()
    return json.loads(open(tmp_path / "m.jsonl").read().splitlines()[-1])["summary"]["first_step_time_s"]


def test_a_repeat_run_takes_its_step_from_the_cache(shards, tmp_path, capsys, restore_cache) -> None:
    folder = tmp_path / "xla"
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    cold = first_step_time(shards, tmp_path, str(folder), capsys)
    assert os.listdir(folder)  # the step's executable, among others
    warm = first_step_time(shards, tmp_path, str(folder), capsys)
    print(f"\nfirst step: {cold:.2f} s cold, {warm:.2f} s from the cache")
    assert warm < cold / 2
