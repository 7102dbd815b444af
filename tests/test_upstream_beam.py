"""Upstream bugs the project works around, documented by a test that shows them.

Beam 2.77's multi-threaded local runner can lose grouped elements: the embedded SDK
worker's output streams (TimeBasedBufferingClosableOutputStream) are flushed every second
by a timer thread that sends get() and then _clear(), while the bundle thread writes into
the same buffer without _flush_lock (pipelines/README.md, "Why not multi_threading").
`prepack pack` refuses that mode (tested below). The loss depends on thread timing, so no
test can show it reliably in bounded time: benchmarks/repro_multithreading_flush_race.py
runs the reproduction repeatedly and with more load (it was a non-strict xfail here, which
checked nothing either way).
"""

import pytest

from pipelines.options import OptionsError, parse_args


def test_pack_refuses_multithreading_and_names_the_cause():
    with pytest.raises(OptionsError) as caught:
        parse_args(["--sample", "--output", "o", "--direct_running_mode=multi_threading"])
    message = str(caught.value)
    assert "TimeBasedBufferingClosableOutputStream" in message and "_flush_lock" in message
    assert "multi_processing" in message and "\n" not in message
