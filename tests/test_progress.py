"""Progress lines (pipelines/progress.py): tqdm counts and times; each update is one line of its
own (no carriage returns in a worker's piped stderr), and a short run prints nothing."""

from __future__ import annotations

import io
import re

from pipelines.progress import counter


def test_each_update_is_one_line_with_count_time_and_rate():
    out = io.StringIO()
    bar = counter("prepack pack [pid 7]: read", "records", every_s=0.0, out=out)
    bar.update(1500)
    bar.update(500)
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) >= 2
    assert re.fullmatch(r"prepack pack \[pid 7\]: read: 2000 records in 00:00 \([0-9.]+ records/s\)", lines[-1]), lines


def test_a_short_run_prints_nothing():
    out = io.StringIO()
    bar = counter("preflight: a: read", "records", every_s=60.0, out=out)
    bar.update(10)
    bar.close()
    assert out.getvalue() == ""


def test_the_pack_workers_rates_go_through_one_counter_each(monkeypatch, capsys):
    from pipelines import progress
    from pipelines.stage_shared import Progress

    monkeypatch.setattr(progress, "EVERY_S", 0.0)
    monkeypatch.setattr(Progress, "counters", {})
    made = []
    real = progress.counter
    monkeypatch.setattr(progress, "counter", lambda desc, unit, every_s=0.0, out=None: made.append(desc) or real(desc, unit, 0.0, out))
    Progress.add("read", "records", 3)
    Progress.add("read", "records", 4)
    Progress.add("tokenized", "examples", 2)
    assert [d.split("]: ")[1] for d in made] == ["read", "tokenized"]
    assert Progress.counters["read"].n == 7 and Progress.counters["tokenized"].n == 2
    err = capsys.readouterr().err
    assert re.search(r"prepack pack \[pid \d+\]: read: 7 records in 00:00 \(", err) and "\r" not in err
