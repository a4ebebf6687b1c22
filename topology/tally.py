"""Work done out of a known total, told to a `progress(done, total)` callback.

The one way a long step (a package split or verify, certify's checks, a stage fetching its
parts) reports progress without knowing how it is shown: it counts with a `Tally`, and the
caller passes the callback. mesh/progress.py shows it (a bar, or plain lines in a log);
its `Bar.to` is such a callback. Here, below mesh/, so topology/ and stages/ can count.
"""

from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[int, int], None]


class Tally:
    """Units done out of `total` (bytes, checks), told to `progress` (if any) as they add
    up, starting with (0, total)."""

    def __init__(self, total: int, progress: Progress | None):
        self.done, self.total, self.progress = 0, total, progress
        if progress is not None:
            progress(0, total)

    def add(self, n: int = 1) -> None:
        self.done += n
        if self.progress is not None:
            self.progress(self.done, self.total)
