"""The persistent XLA compilation cache of `prepack train`, `prepack verify --model` and `prepack generate`.

A run compiles its train step (or forward) for minutes on an accelerator; with the cache, a repeat
run of the same program (same model, shapes and options; another learning rate or seed is the same
program) loads the executable instead. `--compile-cache DIR|off` chooses, in this order:

- `off`: no persistent cache, even where JAX_COMPILATION_CACHE_DIR is set;
- `DIR`: that folder (created on first use);
- no flag: JAX_COMPILATION_CACHE_DIR where set (the user's own choice, and the test suite's
  per-run folder, conftest.py), else `$XDG_CACHE_HOME/prepack/xla` (`~/.cache/prepack/xla`).

JAX's own thresholds stand (jax_persistent_cache_min_compile_time_secs, 1 s by default, and its
JAX_ environment variable): programs that compile faster than that are not worth a file. The folder
is checked (created, writable) before any weight loads, and its location printed once per process.

An entry of the cache is an executable the run runs: it is as trusted as the user's own files, so the
folder must be theirs alone. A folder that is group- or world-writable, or owned by another user, is
not used (one line says why and how to fix it; the run goes on without the cache). Only the folder
itself is judged, not its parents; the folders made for the cache (it, prepack-preload/,
prepack-unfit-steps/) are made 0700. What is read from it is bounded (train/compilation/cache_files.py).
"""

from __future__ import annotations

import os
import stat
from typing import TextIO

OFF = "off"
ENV = "JAX_COMPILATION_CACHE_DIR"
HELP = ("persistent XLA compilation cache: a folder, or off (also overrides JAX_COMPILATION_CACHE_DIR). "
        "Default: JAX_COMPILATION_CACHE_DIR where set, else $XDG_CACHE_HOME/prepack/xla (~/.cache/prepack/xla)")


class CompileCacheError(ValueError):
    """--compile-cache names a folder that cannot be used (one line)."""


_UNSET = object()
_announced: object = _UNSET  # the choice already printed in this process (a folder, or None: off)


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "prepack", "xla")


def chosen(flag: str | None) -> str | None:
    """The cache folder the flag means (see the module doc), as given; None: off."""
    if flag == OFF:
        return None
    if flag:
        return flag
    return os.environ.get(ENV) or default_dir()


def source(flag: str | None) -> str:
    """Where the folder resolve(flag) returns comes from, as a refusal names it: the flag, the environment
    variable, or the default."""
    if flag:
        return "--compile-cache"
    return ENV if os.environ.get(ENV) else "--compile-cache's default"


def resolve(flag: str | None) -> str | None:
    """The cache folder the flag means, resolved as the output rule resolves every output
    (prepack.storage.places.resolved: links followed, then `..`); None: off. The same string
    for the rule's check and for JAX."""
    from prepack.storage import places

    folder = chosen(flag)
    return places.resolved(folder) if folder else None


def resolved_option(flag: str | None) -> str | None:
    """--compile-cache as a command keeps it after reading its options: a folder resolved as
    `resolve` does (the one string the output rule checks and JAX uses), `off` and None (the
    default) as they are. Refuses (prepack.storage.output_rule.OutputPathError, one line naming
    --compile-cache, or JAX_COMPILATION_CACHE_DIR where that chooses) a folder, given or
    default, through a dangling link or a link loop."""
    from prepack.storage import output_rule

    folder = chosen(flag)
    if folder:
        label = "--compile-cache" if flag or not os.environ.get(ENV) else ENV
        folder = output_rule.output_path(label, folder)
    return folder if flag and flag != OFF else flag


def place(flag: str | None):
    """The cache folder as an output of the one output rule (prepack/storage/output_rule.py), or None: off."""
    from prepack.storage import output_rule

    folder = resolve(flag)
    return output_rule.Place(source(flag), folder) if folder else None


def problem(folder: str) -> str | None:
    """Why `folder` cannot hold the cache (it is created here if missing); None when it can."""
    if "://" in folder:
        return f"{folder} is not a local folder (the cache is written by XLA on this machine)"
    from train.compilation import cache_files

    try:
        cache_files.make_folder(folder)  # 0700: the user's alone (its parents, where made, too)
    except OSError as e:
        return f"cannot create {folder}: {e.strerror or e}"
    if not os.path.isdir(folder):
        return f"{folder} is not a folder"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{folder} is not writable"
    return None


def untrusted(folder: str) -> str | None:
    """Why the entries in `folder` cannot be trusted (others can write it), or None: the user's alone."""
    info = os.stat(folder)
    if info.st_uid != os.geteuid():
        try:
            import pwd

            owner = pwd.getpwuid(info.st_uid).pw_name
        except (ImportError, KeyError):
            owner = f"user id {info.st_uid}"
        return f"is owned by {owner}, not by you"
    writable = [who for who, bit in (("group", stat.S_IWGRP), ("world", stat.S_IWOTH)) if info.st_mode & bit]
    return f"is {'- and '.join(writable)}-writable" if writable else None


def enable(flag: str | None, out: TextIO) -> str | None:
    """Sets JAX's persistent cache as `flag` says (before the first compile); returns the folder (None: off,
    or a folder others can write: said in one line). Raises CompileCacheError for a folder that cannot be used."""
    global _announced
    import jax
    from jax._src import compilation_cache

    from train.compilation import cache_files

    folder = resolve(flag)
    if folder is not None:
        why = problem(folder)
        if why:
            raise CompileCacheError(f"--compile-cache {why}; pass a writable folder, or --compile-cache off")
    if folder is not None and (others := untrusted(folder)):
        # Its entries are executables this run would run: anyone who can write them could run code as you.
        fix = f"run chmod go-w {folder}, or pass" if others.endswith("-writable") else "pass"
        print(f"XLA compilation cache: not used: {source(flag)} {folder} {others}, so others could plant "
              f"executables this run would run; {fix} --compile-cache with a folder of your own "
              "(this run goes on without the cache)", file=out, flush=True)
        folder = _announced = None  # said instead of "XLA compilation cache: off"
    if folder is not None:
        cache_files.install(out)
    if jax.config.jax_compilation_cache_dir != folder:
        # JAX opens its cache at the first compile and keeps it: a process that compiled already
        # (a test calling the CLI twice) starts afresh with the new folder.
        compilation_cache.reset_cache()
    jax.config.update("jax_enable_compilation_cache", folder is not None)
    jax.config.update("jax_compilation_cache_dir", folder)
    if folder != _announced:
        print(f"XLA compilation cache: {folder if folder is not None else 'off'}"
              f"{' (--compile-cache off to turn it off)' if folder is not None else ''}", file=out, flush=True)
        _announced = folder
    return folder
