"""How a stage's compute loop gathers decode rows into a step: rows wait for the other
decoding sessions' rows (up to GATHER_S), except a later stage's rows whose previous
stage's step is all there (that stage formed the batch)."""

from __future__ import annotations

import contextlib
import threading

import pytest

from skippy.mesh.stage import loop as loop_module
from skippy.mesh.stage.loop import Row, StageLoop


@pytest.fixture
def loop(monkeypatch):
    monkeypatch.setattr(loop_module, "GATHER_S", 60.0)  # only a whole batch may run
    steps: list[int] = []
    loop = StageLoop(lambda rows: steps.append(len(rows)) or [None] * len(rows))
    loop.steps = steps
    yield loop
    loop.decoding_changed(-loop.decoding)  # whatever still waits runs, then the loop ends
    loop.stop()


def post(loop: StageLoop, upstream=None) -> tuple[Row, threading.Thread]:
    row = Row(0, None, lambda out: out, upstream)
    t = threading.Thread(target=loop.decode, args=(row,), daemon=True)
    t.start()
    return row, t


def test_rows_of_one_previous_step_run_together_without_waiting_for_other_sessions(loop):
    loop.decoding_changed(8)  # eight sessions decode; this step of the stage before ran 2
    rows = [post(loop, (5, 2))[0] for _ in range(2)]
    assert all(r.done.wait(10) for r in rows)
    assert loop.steps == [2] and [r.batch for r in rows] == [2, 2]
    assert rows[0].step == rows[1].step == 1  # the next stage is told this step's number


def test_a_previous_step_still_arriving_waits_for_its_last_row(loop):
    loop.decoding_changed(8)
    first = [post(loop, (5, 3))[0] for _ in range(2)]
    assert not first[0].done.wait(0.3)  # one row of the three is still on its way
    last = post(loop, (5, 3))[0]
    assert all(r.done.wait(10) for r in [*first, last])
    assert loop.steps == [3]


def test_rows_with_no_previous_step_wait_for_every_decoding_session(loop):
    loop.decoding_changed(3)  # a first stage: its rows come from the driver
    rows = [post(loop)[0] for _ in range(2)]
    assert not rows[0].done.wait(0.3)
    rows.append(post(loop)[0])
    assert all(r.done.wait(10) for r in rows)
    assert loop.steps == [3]


def test_rows_of_two_previous_steps_run_once_both_are_whole(loop):
    loop.decoding_changed(8)
    a = post(loop, (5, 1))[0]
    assert a.done.wait(10)  # a whole step alone runs at once
    b = [post(loop, (6, 2))[0], post(loop, (7, 1))[0]]
    assert not b[0].done.wait(0.3)  # step 6 lacks a row: step 7's waits with it
    b.append(post(loop, (6, 2))[0])
    assert all(r.done.wait(10) for r in b)
    assert loop.steps == [1, 3]


def test_a_rows_preparation_runs_on_the_loop_thread_before_its_step_and_fails_it_alone(loop):
    """A verify step's rewind rides with its row (no trip of its own to the loop thread);
    a rewind that fails fails that row only, and the step runs the others."""
    loop.decoding_changed(2)
    seen = []

    def rewind():
        seen.append((threading.current_thread().name, len(loop.steps)))

    def broken():
        raise ValueError("cannot rewind")

    def session(row):
        with contextlib.suppress(ValueError):  # the row's own failure, read below
            loop.decode(row)

    rows = [Row(0, None, lambda out: out, prepare=rewind),
            Row(1, None, lambda out: out, prepare=broken)]
    threads = [threading.Thread(target=session, args=(r,), daemon=True) for r in rows]
    for t in threads:
        t.start()
    assert all(r.done.wait(10) for r in rows)
    assert seen == [(loop._thread.name, 0)]  # on the loop thread, before the step
    assert loop.steps == [1] and rows[0].error is None
    with pytest.raises(ValueError, match="cannot rewind"):
        rows[1].outcome()


def test_a_lone_sessions_row_runs_on_its_own_thread_and_others_on_the_loops():
    """One session, the loop idle: the row's step runs on the caller's thread (no hand-off
    to the loop thread); with other sessions open the loop runs it, gathering rows."""
    threads: list[threading.Thread] = []
    loop = StageLoop(lambda rows: threads.append(threading.current_thread()) or
                     [None] * len(rows))
    try:
        loop.opened(1)
        loop.decoding_changed(1)
        row = Row(0, None, lambda out: loop.call(lambda: "finished"))  # a nested call
        assert loop.decode(row) == "finished"
        assert threads == [threading.current_thread()]
        loop.opened(1)
        loop.decoding_changed(1)
        rows = [Row(0, None, lambda out: out) for _ in range(2)]
        posts = [threading.Thread(target=loop.decode, args=(r,)) for r in rows]
        for t in posts:
            t.start()
        assert all(r.done.wait(10) for r in rows)
        assert threads[1:] == [loop._thread] and rows[0].batch == 2
    finally:
        loop.decoding_changed(-2)
        loop.stop()
