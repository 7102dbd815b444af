"""train/compilation/unfit_steps.py: a verdict file is a stranger's; only a well-formed one for this step and budget counts."""

from __future__ import annotations

import json

import pytest

from train.compilation import unfit_steps

KEY = "ab" * 32


@pytest.fixture()
def folder(tmp_path) -> str:
    unfit_steps.remember(str(tmp_path), unfit_steps.UnfitStep(KEY, 1000, "21.40 GiB"))
    return str(tmp_path)


def test_a_remembered_verdict_covers_its_budget_and_smaller_ones(folder) -> None:
    assert unfit_steps.recall(folder, KEY, 1000) == unfit_steps.UnfitStep(KEY, 1000, "21.40 GiB")
    assert unfit_steps.recall(folder, KEY, 10) is not None
    assert unfit_steps.recall(folder, KEY, 1001) is None  # more room than it was planned with: plan again
    assert unfit_steps.recall(folder, "cd" * 32, 10) is None


@pytest.mark.parametrize("edit", [
    lambda d: {**d, "key": "cd" * 32},  # another step's verdict under this step's name
    lambda d: {**d, "budget_bytes": True},
    lambda d: {**d, "budget_bytes": 0},
    lambda d: {**d, "budget_bytes": "1000"},
    lambda d: {**d, "planned": 5},
    lambda d: {**d, "planned": "x" * 301},
    lambda d: {**d, "extra": 1},
    lambda d: [d],
])
def test_a_malformed_verdict_is_ignored(folder, edit) -> None:
    path = unfit_steps.path_of(folder, KEY)
    with open(path) as f:
        data = json.load(f)
    with open(path, "w") as f:
        json.dump(edit(data), f)
    assert unfit_steps.recall(folder, KEY, 10) is None


def test_an_oversized_or_unreadable_verdict_is_ignored(folder) -> None:
    path = unfit_steps.path_of(folder, KEY)
    with open(path, "w") as f:
        f.write(" " * unfit_steps.MAX_FILE_BYTES + "{}")
    assert unfit_steps.recall(folder, KEY, 10) is None
    with open(path, "w") as f:
        f.write("{not json")
    assert unfit_steps.recall(folder, KEY, 10) is None


def test_a_key_that_is_not_a_digest_never_matches(tmp_path) -> None:
    bad = "../" + "a" * 61
    assert unfit_steps._valid({"key": bad, "budget_bytes": 5, "planned": "x"}, bad) is None


def test_remember_leaves_no_temporary_file(folder) -> None:
    import os

    assert os.listdir(os.path.join(folder, unfit_steps.FOLDER)) == [f"{KEY}.json"]
