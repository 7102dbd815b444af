"""make_dataset: batch shapes, host splits, order, exact resume (also under mp_prefetch and Orbax)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from testkit.shard_sets import build_shard_set, row_ids

import loaders
from loaders import HostPlan
from prepack.format import rowformat

NUM_ROWS = 37  # prime: no batch size or host count divides it
L = 16


@pytest.fixture(scope="module")
def shard_set(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("set") / "L16")
    build_shard_set(path, num_rows=NUM_ROWS, rows_per_shard=[12, 0, 20, 5], max_length=L)
    return path


@pytest.fixture(scope="module")
def view(shard_set):
    return loaders.open_shards(shard_set)


def make(view, batch_size=4, seed=0, shard_index=0, shard_count=1, num_epochs=None, **kw):
    kw.setdefault("read_threads", 2)  # small pools keep the tests light; the default is tested below
    return loaders.make_dataset(view, batch_size, seed, shard_index, shard_count, num_epochs, **kw)


def ids_of(ds, limit: int | None = None) -> list[list[int]]:
    it = iter(ds)
    out = []
    for batch in it:
        out.append(row_ids(batch).tolist())
        if limit is not None and len(out) == limit:
            break
    it.close()
    return out


def test_batch_shapes_dtypes_and_content(shard_set, view):
    ds = loaders.make_dataset(shard_set, batch_size=4, seed=0, shard_index=0, shard_count=1, expected_max_length=L)
    it = iter(ds)
    for _ in range(3):
        batch = next(it)
        assert sorted(batch) == sorted(rowformat.FIELD_NAMES)
        for name, value in batch.items():
            assert isinstance(value, np.ndarray) and value.dtype == np.int32 and value.shape == (4, L), name
        # Each batch row is exactly the stored row.
        for j, i in enumerate(row_ids(batch)):
            for name in rowformat.FIELD_NAMES:
                np.testing.assert_array_equal(batch[name][j], view[int(i)][name])
            rowformat.check_row({k: v[j] for k, v in batch.items()}, L)
    it.close()


def test_one_epoch_is_a_permutation_and_epochs_reshuffle(view):
    plan = HostPlan(NUM_ROWS, 1, 1, 3)
    assert plan.dropped_rows == 0
    rows = sum(ids_of(make(view, batch_size=1, num_epochs=3)), [])
    epochs = [rows[k * NUM_ROWS : (k + 1) * NUM_ROWS] for k in range(3)]
    assert all(sorted(e) == list(range(NUM_ROWS)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != list(range(NUM_ROWS))


def test_order_is_deterministic_for_a_seed(view):
    a = ids_of(make(view, seed=7), limit=25)
    assert a == ids_of(make(view, seed=7, read_threads=0), limit=25)  # threads do not change the order
    assert a != ids_of(make(view, seed=8), limit=25)


def interleave(host_rows: list[list[int]]) -> list[int]:
    """Rebuilds the global stream: host h's k-th row is global position h + k * shard_count."""
    n = len(host_rows)
    stream = [None] * sum(len(r) for r in host_rows)
    for h, rows in enumerate(host_rows):
        stream[h::n] = rows
    return stream


@settings(max_examples=20, deadline=None)
@given(
    shard_count=st.integers(1, 6),
    batch_size=st.integers(1, 5),
    num_epochs=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_host_splits_disjoint_and_covering(view, shard_count, batch_size, num_epochs, seed):
    plan = HostPlan(NUM_ROWS, batch_size, shard_count, num_epochs)
    if plan.batches_per_host == 0:
        with pytest.raises(ValueError, match="do not fill one batch"):
            make(view, batch_size, seed, 0, shard_count, num_epochs)
        return
    hosts = [sum(ids_of(make(view, batch_size, seed, h, shard_count, num_epochs, read_threads=0)), []) for h in range(shard_count)]
    # Every host steps the same number of full batches, as the plan says.
    assert all(len(rows) == plan.batches_per_host * batch_size for rows in hosts)
    stream = interleave(hosts)
    assert len(stream) == plan.used_rows == NUM_ROWS * num_epochs - plan.dropped_rows
    assert plan.dropped_rows < shard_count * batch_size
    # Each full epoch holds every row exactly once, across hosts; the cut last one has no repeats.
    for e in range(num_epochs):
        epoch = stream[e * NUM_ROWS : (e + 1) * NUM_ROWS]
        if len(epoch) == NUM_ROWS:
            assert sorted(epoch) == list(range(NUM_ROWS))
        else:
            assert len(set(epoch)) == len(epoch) and e == num_epochs - 1
    # Hosts are disjoint within every epoch (no row read twice by different hosts).
    for e in range(num_epochs):
        owners = {}
        for pos in range(e * NUM_ROWS, min((e + 1) * NUM_ROWS, len(stream))):
            assert owners.setdefault(stream[pos], pos % shard_count) == pos % shard_count


@settings(max_examples=8, deadline=None)
@given(shard_count=st.integers(2, 5), batch_size=st.integers(1, 8))
def test_host_splits_forever(view, shard_count, batch_size):
    steps = -(-2 * NUM_ROWS // (shard_count * batch_size))  # enough global steps for two epochs
    hosts_batches = [ids_of(make(view, batch_size, 5, h, shard_count, None, read_threads=0), limit=steps) for h in range(shard_count)]
    stream = interleave([sum(b, []) for b in hosts_batches])
    assert len(stream) >= 2 * NUM_ROWS
    for e in range(2):
        assert sorted(stream[e * NUM_ROWS : (e + 1) * NUM_ROWS]) == list(range(NUM_ROWS))


def test_host_plan_numbers():
    plan = HostPlan(num_rows=37, batch_size=4, shard_count=3, num_epochs=2)
    assert (plan.stream_rows, plan.used_rows, plan.dropped_rows) == (74, 72, 2)
    assert [plan.rows_for_host(h) for h in range(3)] == [24, 24, 24] and plan.batches_per_host == 6
    keep = HostPlan(num_rows=37, batch_size=4, shard_count=3, num_epochs=2, drop_remainder=False)
    assert keep.dropped_rows == 0 and [keep.rows_for_host(h) for h in range(3)] == [25, 25, 24]
    assert [keep.batches_for_host(h) for h in range(3)] == [7, 7, 6]
    forever = HostPlan(num_rows=37, batch_size=4, shard_count=3, num_epochs=None)
    assert forever.dropped_rows == 0 and forever.batches_per_host is None


def test_no_drop_remainder_keeps_every_row(view):
    batches = ids_of(make(view, batch_size=5, num_epochs=1, drop_remainder=False))
    assert [len(b) for b in batches] == [5] * 7 + [2]
    assert sorted(sum(batches, [])) == list(range(NUM_ROWS))


def test_host_arguments():
    assert loaders.resolve_host(None, None) == (0, 1)  # JAX on one CPU process
    assert loaders.resolve_host(2, 4) == (2, 4)
    with pytest.raises(ValueError, match="give both shard_index and shard_count"):
        loaders.resolve_host(1, None)
    with pytest.raises(ValueError, match=r"shard_index must be in \[0, shard_count\), got 4 of 4"):
        loaders.resolve_host(4, 4)


def resume_check(view, stop_after: int, **kw):
    """Reads stop_after batches, saves the state as JSON, and checks a fresh iterator continues exactly."""
    ds = make(view, **kw)
    it = iter(ds)
    for _ in range(stop_after):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    expected = [row_ids(next(it)).tolist() for _ in range(6)]
    it.close()
    fresh = iter(make(view, **kw))
    fresh.set_state(state)
    got = [row_ids(next(fresh)).tolist() for _ in range(6)]
    fresh.close()
    assert got == expected
    return state


def test_resume_mid_epoch(view):
    state = resume_check(view, stop_after=3, batch_size=4, seed=11)
    assert len(json.dumps(state)) < 1000


def test_resume_across_epoch_boundary(view):
    # 37 rows / 4 per batch: batch 9 holds the last row of epoch 0 and three rows of epoch 1.
    resume_check(view, stop_after=8, batch_size=4, seed=11, num_epochs=3)
    resume_check(view, stop_after=9, batch_size=4, seed=11, num_epochs=3)


def test_resume_helpers_and_state_checks(view, tmp_path):
    it = iter(make(view, seed=2))
    next(it), next(it)
    loaders.save_iterator_state(it, str(tmp_path / "ckpt" / "data-0.json"))
    expected = row_ids(next(it)).tolist()
    it.close()

    fresh = iter(make(view, seed=2))
    loaders.restore_iterator_state(fresh, str(tmp_path / "ckpt" / "data-0.json"))
    assert row_ids(next(fresh)).tolist() == expected
    fresh.close()

    other = iter(make(view, seed=3, shard_index=1, shard_count=2))
    with pytest.raises(ValueError, match=r"saved from a different pipeline.*seed: saved 2, now 3; shard_index: saved 0, now 1; shard_count: saved 1, now 2"):
        loaders.restore_iterator_state(other, str(tmp_path / "ckpt" / "data-0.json"))
    with pytest.raises(FileNotFoundError, match="no iterator state at"):
        loaders.restore_iterator_state(other, str(tmp_path / "missing.json"))
    other.close()


def test_resume_with_orbax_checkpoint_manager(view, tmp_path):
    import orbax.checkpoint as ocp
    it = iter(make(view, seed=4))
    for _ in range(5):
        next(it)
    manager = ocp.CheckpointManager(str(tmp_path / "orbax"))
    manager.save(5, args=ocp.args.Composite(data=loaders.orbax_save_args(it)))
    manager.wait_until_finished()
    expected = [row_ids(next(it)).tolist() for _ in range(3)]
    it.close()

    fresh = iter(make(view, seed=4))
    ocp.CheckpointManager(str(tmp_path / "orbax")).restore(5, args=ocp.args.Composite(data=loaders.orbax_restore_args(fresh)))
    assert [row_ids(next(fresh)).tolist() for _ in range(3)] == expected
    fresh.close()


def test_mp_prefetch_keeps_order_and_resumes(view):
    """Two worker processes: same batches as in-process, and an exact resume from a JSON state."""
    kw = dict(batch_size=4, seed=9, num_epochs=2)
    reference = ids_of(make(view, **kw))
    ds = make(view, worker_count=2, **kw)
    it = iter(ds)
    head = [row_ids(next(it)).tolist() for _ in range(5)]
    state = json.loads(json.dumps(it.get_state()))
    assert state["loader"]["worker_count"] == 2
    it.close()
    assert head == reference[:5]

    fresh = iter(make(view, worker_count=2, **kw))
    fresh.set_state(state)
    tail = [row_ids(b).tolist() for b in fresh]
    fresh.close()
    assert tail == reference[5:]


def test_checks_an_opened_view_too(view):
    with pytest.raises(loaders.ManifestError, match="packed for max_length 16, but 99 was expected"):
        make(view, expected_max_length=99)
    with pytest.raises(ValueError, match="batch_size must be positive"):
        make(view, batch_size=0)
