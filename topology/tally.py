"""Work done out of a known total, told to a `progress(done, total)` callback.

How long steps below mesh/ (a package split or verify, certify's checks) report progress
without knowing how it is shown: mesh/progress.py draws the bar, and its `Bar.to` is such
a callback.
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
