"""The stages of one pipeline that share a node's cores take turns at them.

Two stages on a 2-core node, each computing on its own core, leave one core idle
whenever one waits on the other's rows, and under concurrent decode that is most of the
time (the last stage, with the head, is the slower: evals/README.md, "two stages on one
node"). Taking turns, every step on all the pipeline's cores, two stages compute as one
does; the hop between them over the node's socket (0.2 ms) is what it costs.

The turn is an flock on a file of the pipeline's, in a directory only this user can
open. The file also holds one byte a stage, set while that stage waits for the turn: a
stage that just had it lets a waiting one go first (flock alone hands it to whichever
asks first, which is the one that just let go); and when the last stage last ended a
decode step, so that the first stage can let those rows, on their way back, join its
next step (mesh/stage/loop.py).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import stat
import struct
import tempfile
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

SLOTS = 64          # stages a pipeline may have on one node
_ANSWERED = struct.Struct("d")  # after the slots: the last stage's last step's end
POLITE_S = 0.05     # the longest a stage lets a waiting one go first (one that died waiting)
POLL_S = 0.0001


def turns_dir() -> Path | None:
    """This user's directory of turn files; None where it is not this user's alone (the
    stages then compute without turns)."""
    path = Path(tempfile.gettempdir()) / f"skippy-turns-{os.getuid()}"
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as e:
        log.warning("no turn directory %s: %s", path, e)
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        log.warning("turn directory %s is not this user's alone: no turns", path)
        return None
    return path


class Turn:
    """Stage `slot`'s side of the turn named `key`; `last`: the pipeline's last stage
    (its steps' rows go back to the first). `held()` is re-entrant on one thread (a
    prefill runs waiting rows between its chunks); `offer()`, while held, lets a waiting
    stage have the turn and takes it back after."""

    def __init__(self, path: Path, slot: int, last: bool = False):
        if not 0 <= slot < SLOTS:
            raise ValueError(f"turn slot {slot} out of range")
        self.slot, self.last, self._path = slot, last, path
        size = SLOTS + _ANSWERED.size
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        if os.fstat(self._fd).st_size < size:
            os.ftruncate(self._fd, size)
        self._flags = mmap.mmap(self._fd, size)
        self._flags[slot] = 0  # a restarted stage's slot, left set by its last process
        self._depth, self._step = 0, False
        self._lock = threading.RLock()  # one thread holds it at a time (the loop's)
        self.waited_s = 0.0  # seconds spent waiting for the turn (stage figures)

    @classmethod
    def named(cls, key: str | None, slot: int, last: bool = False) -> "Turn | None":
        if not key:
            return None
        where = turns_dir()
        if where is None or not key.replace("-", "").isalnum():
            return None
        try:
            return cls(where / key, slot, last)
        except OSError as e:
            log.warning("no turn %s: %s", key, e)
            return None

    def held(self, step: bool = False) -> "_Held":
        """The turn, for a decode step (`step`) or other work."""
        return _Held(self, step)

    def answered_at(self) -> float:
        """When (time.monotonic, system-wide) the last stage last ended a decode step."""
        return _ANSWERED.unpack_from(self._flags, SLOTS)[0]

    def offer(self) -> None:
        """Held: if another stage waits, let it have the turn, then take it back."""
        if self._depth and self._others_waiting():
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            self._take()

    def close(self) -> None:
        """This stage is done: the file goes too (its pipeline's stages end together)."""
        self._flags.close()
        os.close(self._fd)
        self._path.unlink(missing_ok=True)

    def _enter(self, step: bool = False) -> None:
        self._lock.acquire()
        self._depth += 1
        if self._depth == 1:
            self._step = step
            self._take()

    def _exit(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            if self._step and self.last:
                _ANSWERED.pack_into(self._flags, SLOTS, time.monotonic())
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._lock.release()

    def _take(self) -> None:
        t = time.monotonic()
        polite = t + POLITE_S
        while self._others_waiting() and time.monotonic() < polite:
            time.sleep(POLL_S)
        self._flags[self.slot] = 1
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        finally:
            self._flags[self.slot] = 0
        self.waited_s += time.monotonic() - t

    def _others_waiting(self) -> bool:
        return self._flags[:SLOTS].count(1) > self._flags[self.slot]


class _Held:
    def __init__(self, turn: Turn, step: bool):
        self._turn, self._step = turn, step

    def __enter__(self) -> None:
        self._turn._enter(self._step)

    def __exit__(self, *exc) -> None:
        self._turn._exit()
