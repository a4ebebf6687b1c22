"""A stage's compute loop: one thread runs every torch call, the way llama.cpp's server
runs its slots.

Sessions only post work and wait for its result. The loop takes every waiting decode row
into one runtime step, and runs other work (lane bookkeeping, a prefill) between steps; a
prefill runs the rows that arrive meanwhile between its chunks, so one long prompt never
stalls the other streams. One thread also keeps OpenMP to one worker team: teams started
from several threads fought over the cores (`evals/bench_mesh.py` measures a stage's step
time in and out of the actor). The one exception: a lone session's decode row, with the
loop idle, runs on the session's own thread while the loop waits (one thread at a time
still: a thread hand-off less per token).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from .turns import Turn

log = logging.getLogger(__name__)

# How long a row waits for the other decoding sessions' rows to join its step (other
# work runs meanwhile), counted from its arrival or the end of the last step, whichever
# is later: without it rows settle into groups that take turns and a batch runs
# half-empty. (From arrival alone, a row that came during a step ran alone after it,
# while the step's own rows were still on their way back: two sessions took turns.)
# A later stage's rows say which step of the stage before ran them: once that step's rows
# are all here, they run at once (waiting on would only idle this stage while the other
# sessions' rows are still computed there: 3 ms of every step of the second of two).
GATHER_S = 0.003


class _Posted:
    """Work a session posted to the loop: it waits for the loop to settle it."""

    def __init__(self):
        self.done = threading.Event()
        self.result: object = None
        self.error: BaseException | None = None

    def settle(self, result=None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()

    def outcome(self):
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result


class Row(_Posted):
    """One session's decode row. `finish` runs on the loop thread with the runtime's
    output for this row (note the token, sample) and its return value is the row's
    result; an exception there fails this row only. `upstream`: the previous stage's
    (step, rows in it) that ran this row, if any. `prepare` runs on the loop thread before
    the row's step (a verify step's rejected rows dropped: no trip of its own there)."""

    def __init__(self, lane: int, x: object, finish: Callable[[object], object],
                 upstream: tuple[int, int] | None = None,
                 prepare: Callable[[], None] | None = None):
        super().__init__()
        self.lane, self.x, self.finish, self.upstream = lane, x, finish, upstream
        self.prepare = prepare
        self.batch = 0  # rows in the step that ran it (its trace span says so)
        self.step = 0   # that step's number here (the next stage's `upstream`)


class _Job(_Posted):
    def __init__(self, fn: Callable[[], object]):
        super().__init__()
        self.fn = fn


@dataclass
class Timing:
    """Seconds spent computing, by step kind (for /metrics)."""
    seconds: dict = field(default_factory=lambda: {"prefill": 0.0, "decode": 0.0})
    count: dict = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    rows: int = 0  # decode rows: rows / count["decode"] is the mean batch
    prefill_rows: int = 0  # rows prefills computed: what recomputing a prefix costs

    def add(self, kind: str, dt: float, rows: int = 0) -> None:
        self.seconds[kind] += dt
        self.count[kind] += 1
        if kind == "decode":
            self.rows += rows
        else:
            self.prefill_rows += rows

    def prefill_s_per_row(self) -> float | None:
        """Mean seconds a prefill spent per row computed; None before any prefill."""
        if not self.prefill_rows:
            return None
        return self.seconds["prefill"] / self.prefill_rows


class StageLoop:
    """`step(rows)` runs one batched runtime decode and returns one output per row;
    `check(row)` validates a row before it joins a step (its exception fails that row
    only). Thread counts are the loop's: `threads` while several sessions are open,
    `burst` (its pipeline's cores) while one session alone keeps the stages computing in
    turn, where the runtime's bits do not depend on the thread count; with a `turn`
    (mesh/stage/turns.py) every step takes it and `burst` threads."""

    def __init__(self, step: Callable[[list[tuple[int, object]]], list], *,
                 check: Callable[[Row], None] = lambda row: None,
                 threads: int | None = None):
        self._step, self._check = step, check
        self._threads, self._burst = threads, None
        self._turn: Turn | None = None
        self._away = 0.0  # seconds a prefill let other stages have the turn
        self._cv = threading.Condition()
        self._jobs: deque[_Job] = deque()
        self._rows: list[Row] = []
        self._rows_since = 0.0     # when the oldest waiting row arrived
        self._stepped = 0.0        # when the last decode step's rows were answered
        self._steps = 0            # decode steps run (numbers rows' steps)
        self._prefills_waiting = 0  # compute() jobs posted, not yet started
        self.decoding = 0          # sessions past their prefill: rows to expect
        self.sessions = 0          # open sessions (thread bursting)
        self.timing = Timing()
        self._stopped = False
        self._busy = threading.Lock()  # held by whichever thread runs the loop's work
        self._inline: int | None = None  # a lone session's thread running its own row
        self._thread = threading.Thread(target=self._run, name="stage-loop", daemon=True)
        self._thread.start()
        if threads:
            self.call(torch.set_num_threads, threads)

    # -- what sessions call --------------------------------------------------------------
    def call(self, fn, *args, **kwargs):
        """Run fn on the loop thread between steps; its result or its exception."""
        if threading.current_thread() is self._thread or \
                threading.get_ident() == self._inline:  # already here (between chunks)
            return fn(*args, **kwargs)
        job = _Job(lambda: fn(*args, **kwargs))
        with self._cv:
            self._jobs.append(job)
            self._cv.notify_all()
        return job.outcome()

    def decode(self, row: Row):
        """Post one decode row and wait for its result."""
        if self._ran_here(row):
            return row.outcome()
        with self._cv:
            if not self._rows:
                self._rows_since = time.monotonic()
            self._rows.append(row)
            self._cv.notify_all()
        return row.outcome()

    def _ran_here(self, row: Row) -> bool:
        """A lone session's row, the loop idle: its step runs on the caller's thread,
        the loop's work held off meanwhile. One thread hand-off less a token and stage
        (0.1-0.3 ms on a VM); with other sessions the loop gathers their rows instead."""
        if not self._alone() or not self._busy.acquire(blocking=False):
            return False
        try:
            if not self._alone():  # work came between the look and the lock
                return False
            self._inline = threading.get_ident()
            self._run_rows([row])
            return True
        finally:
            self._inline = None
            self._busy.release()

    def _alone(self) -> bool:
        with self._cv:
            return self.sessions <= 1 and self.decoding <= 1 and not self._rows \
                and not self._jobs and not self._stopped

    def compute(self, kind: str, fn, *args, rows: int = 0, then=None, **kwargs):
        """A prefill-like job of `rows` rows, timed and run at the loop's thread count;
        `then(result)`, untimed, in the same trip to the loop thread (its value is the
        answer)."""
        def timed():
            self._posted(-1)
            with self._computing():
                t, away = time.perf_counter(), self._away
                try:
                    out = fn(*args, **kwargs)
                finally:  # less the time it let other stages have the turn
                    self.timing.add(kind, time.perf_counter() - t - (self._away - away), rows)
            return out if then is None else then(out)
        self._posted(1)  # waiting until timed() starts
        return self.call(timed)

    def _posted(self, delta: int) -> None:
        with self._cv:
            self._prefills_waiting += delta

    def figures(self) -> dict:
        """What the loop has done and what waits for it now, for /metrics and the status
        page: rows computed (counters: a reader takes rates from two readings), seconds
        and steps by kind, open sessions, and the queue (decode rows gathering for the
        next step, prefills posted but not started). Read without posting to the loop, so
        a reader never counts itself in the queue."""
        t = self.timing
        with self._cv:
            out = {"seconds": dict(t.seconds), "steps": dict(t.count),
                   "decode_rows": t.rows, "prefill_rows": t.prefill_rows,
                   "sessions": self.sessions, "decoding": self.decoding,
                   "queue_rows": len(self._rows), "queue_prefills": self._prefills_waiting}
        if self._turn is not None:  # seconds its steps waited while the others computed
            out["turn_wait_seconds"] = self._turn.waited_s
        return out

    def allow_burst(self, burst: int | None, turn: Turn | None = None) -> None:
        """Take `burst` threads while one session is open, or at every step where the
        stages sharing the cores take `turn`s (only where the runtime's bits do not
        depend on the thread count)."""
        if burst and self._threads and burst > self._threads:
            self._burst, self._turn = burst, turn

    def end_turn(self) -> None:
        """The stage is closing: no more turns (on the loop thread, between steps)."""
        if self._turn is not None:
            self._turn.close()
            self._turn = None

    def opened(self, delta: int) -> None:
        with self._cv:
            self.sessions += delta

    def decoding_changed(self, delta: int) -> None:
        with self._cv:
            self.decoding += delta
            self._cv.notify_all()  # a gathering step may now have every row it expects

    # -- the loop ------------------------------------------------------------------------
    def run_waiting_rows(self) -> None:
        """On the loop thread (between a prefill's chunks): run the rows waiting now."""
        with self._cv:
            rows, self._rows = self._rows, []
        if rows:
            self._run_rows(rows)
        if self._turn is not None:  # another stage's step may wait on this prefill
            t = time.perf_counter()
            self._turn.offer()
            self._away += time.perf_counter() - t

    def stop(self) -> None:
        """End the loop thread once the work already posted is done."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()

    def _run(self) -> None:
        while True:
            rows, job = self._next()
            if not rows and job is None:  # stopped
                return
            with self._busy:
                if rows:
                    self._run_rows(rows, join=True)
                elif job is not None:
                    try:
                        job.settle(job.fn())
                    except BaseException as e:  # the poster raises it
                        job.settle(error=e)

    def _next(self) -> tuple[list[Row], _Job | None]:
        """The waiting rows once every decoding session's row is in (or the gather time
        is up); other work runs while they gather; then wait."""
        with self._cv:
            while True:
                wait = max(self._rows_since, self._stepped) + GATHER_S - time.monotonic()
                if self._rows and (len(self._rows) >= self.decoding or wait <= 0
                                   or self._upstream_whole()):
                    rows, self._rows = self._rows, []
                    return rows, None
                if self._jobs:
                    return [], self._jobs.popleft()
                if self._rows:
                    self._cv.wait(timeout=wait)
                elif self._stopped:
                    return [], None
                else:
                    self._cv.wait()

    def _upstream_whole(self) -> bool:
        """Every waiting row came with its previous stage's step, and every row of each
        such step is here: that stage formed the batch, so gathering longer only idles
        this one (another step's rows are still being computed there)."""
        steps = Counter(row.upstream for row in self._rows)
        return None not in steps and all(n >= rows for (_, rows), n in steps.items())

    def _run_rows(self, rows: list[Row], join: bool = False) -> None:
        """One runtime step for the rows that pass their check; each row then finishes
        (or fails) on its own. A failing runtime step fails its rows: a stage fault.
        `join`: rows that come while the step waits for its turn join it."""
        with self._computing(step=True):
            if join and self._turn is not None and all(r.upstream is None for r in rows):
                rows = rows + self._latecomers(len(rows))
            ok = []
            for row in rows:
                try:
                    if row.prepare is not None:
                        row.prepare()
                    self._check(row)
                    ok.append(row)
                except Exception as e:
                    row.settle(error=e)
            if not ok:
                return
            t = time.perf_counter()
            try:
                outs = self._step([(row.lane, row.x) for row in ok])
            except Exception as e:
                log.exception("decode step of %d rows failed", len(ok))
                for row in ok:
                    row.settle(error=e)
                return
            finally:
                self.timing.add("decode", time.perf_counter() - t, len(ok))
            # each row's finish (its frame sent on, or its draw) in the same turn: work
            # beside another stage's step slows that step's threads
            self._steps += 1
            for row, out in zip(ok, outs):
                row.batch, row.step = len(ok), self._steps
                try:
                    row.settle(row.finish(out))
                except Exception as e:
                    row.settle(error=e)
        with self._cv:
            self._stepped = time.monotonic()

    def _latecomers(self, have: int) -> list[Row]:
        """A first stage's step, its turn taken: the rows of the step the last stage has
        just answered are on their way back through the driver (~1 ms); they join this
        step rather than form a group of their own that would take turns with it ever
        after (a step of 2 rows costs nearly what one of 8 does)."""
        until = self._turn.answered_at() + GATHER_S
        with self._cv:
            while have + len(self._rows) < self.decoding and time.monotonic() < until:
                self._cv.wait(timeout=until - time.monotonic())
            rows, self._rows = self._rows, []
        return rows

    @contextmanager
    def _computing(self, step: bool = False):
        """Around each runtime call: the turn, where the stages take turns, and the
        thread count that goes with it."""
        with self._turn.held(step) if self._turn is not None else nullcontext():
            if self._burst:
                n = self._burst if self.sessions <= 1 or self._turn else self._threads
                if torch.get_num_threads() != n:
                    torch.set_num_threads(n)
            yield
