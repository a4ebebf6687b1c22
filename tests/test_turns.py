"""The turn the stages of one pipeline take at their node's cores (mesh/stage/turns.py):
one at a time, a waiting stage first, and every step of a loop that has one on all the
pipeline's threads. Two Turn objects open the file apart, as two stage processes do (an
flock belongs to the open file, not the process)."""

from __future__ import annotations

import fcntl
import os
import threading
import time

import pytest
import torch

from skippy.mesh.stage import loop as loop_module
from skippy.mesh.stage import turns as turns_module
from skippy.mesh.stage.loop import Row, StageLoop
from skippy.mesh.stage.turns import Turn


@pytest.fixture
def where(tmp_path, monkeypatch):
    monkeypatch.setattr(turns_module.tempfile, "gettempdir", lambda: str(tmp_path))
    return tmp_path


def pair(where):
    return Turn.named("abc-0", 0), Turn.named("abc-0", 1)


def take_in_thread(turn: Turn, events: list, hold_s: float = 0.0) -> threading.Thread:
    def run():
        with turn.held():
            events.append(("in", turn.slot))
            time.sleep(hold_s)
            events.append(("out", turn.slot))
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_one_stage_at_a_time_and_the_waiting_one_after(where):
    a, b = pair(where)
    events: list = []
    with a.held():
        t = take_in_thread(b, events)
        time.sleep(0.2)
        assert events == []  # b waits while a holds the turn
        events.append(("a done", 0))
    t.join(5)
    assert events == [("a done", 0), ("in", 1), ("out", 1)]
    assert b.waited_s >= 0.15


def test_held_is_reentrant_and_the_turn_goes_only_at_the_outer_end(where):
    a, b = pair(where)
    events: list = []
    with a.held():
        with a.held():  # a prefill's chunk runs the waiting rows inside its own turn
            pass
        t = take_in_thread(b, events)
        time.sleep(0.2)
        assert events == []
    t.join(5)
    assert events == [("in", 1), ("out", 1)]


def test_offer_lets_a_waiting_stage_go_first_then_takes_the_turn_back(where):
    a, b = pair(where)
    events: list = []
    with a.held():
        started = time.monotonic()
        a.offer()  # nobody waits: the turn stays
        assert time.monotonic() - started < 0.05
        t = take_in_thread(b, events, hold_s=0.1)
        while not b._flags[1]:  # b is waiting now
            time.sleep(0.001)
        a.offer()
        events.append(("a back", 0))
    t.join(5)
    assert events == [("in", 1), ("out", 1), ("a back", 0)]


def test_a_stage_that_just_let_go_lets_the_waiting_one_go_first(where):
    a, b = pair(where)
    events: list = []
    a._enter()
    t = take_in_thread(b, events, hold_s=0.1)
    while not b._flags[1]:
        time.sleep(0.001)
    a._exit()
    with a.held():  # asked at once: flock alone would likely hand it back to a
        events.append(("a again", 0))
    t.join(5)
    assert events == [("in", 1), ("out", 1), ("a again", 0)]


def test_no_turns_where_the_directory_is_open_to_others(where):
    d = where / f"skippy-turns-{os.getuid()}"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    assert Turn.named("abc-0", 0) is None
    assert Turn.named(None, 0) is None


def test_a_name_outside_its_form_is_refused(where):
    assert Turn.named("../x", 0) is None


def test_close_removes_the_file(where):
    a = Turn.named("abc-1", 0)
    path = where / f"skippy-turns-{os.getuid()}" / "abc-1"
    assert path.exists()
    a.close()
    assert not path.exists()


def test_a_loop_with_a_turn_steps_holding_it_on_the_pipelines_threads(where):
    a, other = pair(where)
    seen = []

    def step(rows):
        fd = os.open(other._path, os.O_RDWR)
        try:  # the turn is held: another stage cannot take it now
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        seen.append(torch.get_num_threads())
        return [None] * len(rows)

    loop = StageLoop(step, threads=1)
    saved = torch.get_num_threads()
    try:
        loop.allow_burst(2, a)
        loop.opened(3)  # several sessions: without a turn each step would take 1 thread
        row = Row(0, None, lambda out: out)
        loop.decode(row)
        assert seen == [2]
        assert "turn_wait_seconds" in loop.figures()
        loop.call(loop.end_turn)
        assert "turn_wait_seconds" not in loop.figures()
    finally:
        loop.stop()
        torch.set_num_threads(saved)


def poster(loop: StageLoop):
    def post():
        row = Row(0, None, lambda out: out)
        threading.Thread(target=loop.decode, args=(row,), daemon=True).start()
        return row
    return post


@pytest.mark.parametrize("answered, expect", [(True, [3]), (False, [1, 2])])
def test_rows_back_from_the_last_stages_step_join_the_first_stages_waiting_one(
        where, monkeypatch, answered, expect):
    """Rows that arrive while a first stage's step waits for its turn join it where the
    last stage has just answered a step (they are its rows coming back): groups of
    sessions merge instead of taking turns ever after. After other work (a prefill)
    nothing is on its way back, and the step goes as it was."""
    monkeypatch.setattr(loop_module, "GATHER_S", 0.3)
    first, last = Turn.named("abc-2", 0), Turn.named("abc-2", 1, last=True)
    steps: list[int] = []
    loop = StageLoop(lambda rows: steps.append(len(rows)) or [None] * len(rows), threads=1)
    saved = torch.get_num_threads()
    try:
        loop.allow_burst(2, first)
        loop.decoding_changed(3)
        post = poster(loop)
        last._enter(step=answered)  # the last stage computes
        rows = [post()]
        time.sleep(0.6)  # the row's gather is over: its step waits for the turn
        assert steps == []
        last._exit()
        if not answered:  # nothing was on its way back: the row went on alone at once
            assert rows[0].done.wait(10)
        rows += [post(), post()]
        assert all(r.done.wait(10) for r in rows)
        assert steps == expect
    finally:
        loop.decoding_changed(-3)
        loop.stop()
        torch.set_num_threads(saved)
