"""Every name and path of a packing job's output, for the job (writing) and the loaders (reading).

    OUTPUT/
      .lock                        the output lock (pipelines/output/lock.py)
      published.json               the run record: which manifests one run published together
      L<L>/manifest.json           a shard set (prepack/format/manifest.py)
      L<L>/rows-00000-of-00004-<12 hex>.array_record
      L<L>/dead_letter.jsonl       examples dropped at that length (named by the manifest)
      L<L>/dead_letter.failed.jsonl   a failed run's dead letter, kept beside the set
      L<L>/.staging-<run>/         a run's files before they are published
      tokens/manifest.json         the tokenized set (prepack/format/tokenset.py), its files beside it
      tokens/.staging-<run>/
      .staging-<run>/              a run's summary, parts and temp files
"""

from __future__ import annotations

import re

LOCK_NAME = ".lock"
RUN_RECORD_NAME = "published.json"
MANIFEST_NAME = "manifest.json"
DEAD_LETTER_NAME = "dead_letter.jsonl"
FAILED_DEAD_LETTER_NAME = "dead_letter.failed.jsonl"
TOKENS_DIR = "tokens"
STAGING_PREFIX = ".staging-"
SUMMARY_NAME = "summary.json"
SHARD_FILE = re.compile(r"^rows-\d{5}-of-\d{5}(-[0-9a-f]{12})?\.array_record$")


def join(folder: str, name: str) -> str:
    """The one join, for local paths and gs:// alike: `name` always lands inside `folder` (even one
    that starts with '/'), and a folder's trailing slashes are not doubled."""
    folder = str(folder)
    return f"{folder.rstrip('/')}/{name}" if folder else name


def lock_path(output: str) -> str:
    return join(output, LOCK_NAME)


def run_record_path(output: str) -> str:
    return join(output, RUN_RECORD_NAME)


def length_dir(output: str, max_length: int) -> str:
    return join(output, f"L{max_length}")


def manifest_path(output: str, max_length: int) -> str:
    return join(length_dir(output, max_length), MANIFEST_NAME)


def staging_dir(output: str, max_length: int, run_id: str) -> str:
    return join(length_dir(output, max_length), STAGING_PREFIX + run_id)


def run_staging_dir(output: str, run_id: str) -> str:
    return join(output, STAGING_PREFIX + run_id)


def summary_path(output: str, run_id: str) -> str:
    return join(run_staging_dir(output, run_id), SUMMARY_NAME)


def tokens_dir(output: str) -> str:
    return join(output, TOKENS_DIR)


def tokens_staging_dir(output: str, run_id: str) -> str:
    return join(tokens_dir(output), STAGING_PREFIX + run_id)


def tokens_manifest_path(output: str) -> str:
    return join(tokens_dir(output), MANIFEST_NAME)
