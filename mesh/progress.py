"""Progress of long steps: a bar on a terminal, plain lines in a log.

A step that knows how much work it has (bytes to copy or hash, stages to load, checks to
run) reports it through `progress_bar(total, desc, unit, say=...)`. `say` is where the
user reads: a `Console` whose stream is a terminal gets a tqdm bar with rate and ETA;
anything else that takes a line (a Console on a pipe, a logger's method, a test's
`list.append`) gets plain lines: one at each tenth of the work and at least one every
`EVERY_S` seconds, never a carriage return, so a CI log reads one line per event.

The step itself never imports this: it counts with topology/tally.py's `Tally` into a
plain `(done, total)` callback, which `Bar.to` is (stages/ and topology/ cannot import
mesh/; a stage fetching its parts, mesh/stage/part_fetch.py, counts the same way).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TextIO, TypeVar

from tqdm import tqdm

EVERY_S = 10.0  # a plain line at least this often while work goes on

Say = Callable[[str], None]
T = TypeVar("T")

_LINE = "{desc}: {percentage:3.0f}% {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}]"
_LINE_NO_TOTAL = "{desc}: {n_fmt} [{elapsed}, {rate_fmt}]"


class Console:
    """The stream a command tells its progress on (stderr by default). A line said while a
    bar is drawn goes above the bar, not through it."""

    def __init__(self, stream: TextIO | None = None, prefix: str = ""):
        self.stream = stream if stream is not None else sys.stderr
        self.prefix = prefix
        self.tty = _isatty(self.stream)

    def __call__(self, message: str) -> None:
        if self.tty:
            tqdm.write(self.prefix + message, file=self.stream)
        else:
            print(self.prefix + message, file=self.stream, flush=True)


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class Bar:
    """How much of a step is done. `update(n)` adds n; `to(done, total)` sets both (the
    callback stages/ and topology/ functions take); `note(text)` says what it is on."""

    def __init__(self, total: int | None, desc: str, unit: str, say: Say):
        self.total, self.desc, self.unit, self.say = total, desc, unit, say
        self.n, self.text = 0, ""
        self.start = self._last_at = time.monotonic()
        self._last_tenth = 0

    def update(self, n: int = 1) -> None:
        self.n += n
        self._show()

    def to(self, done: int, total: int | None = None) -> None:
        if total is not None:
            self.total = total or None  # 0: not known
        self.update(done - self.n)

    def note(self, text: str) -> None:
        self.text = text

    def close(self) -> None:
        pass

    def line(self) -> str:
        """The bar's state as one plain line (tqdm's own figures, without the bar)."""
        known = bool(self.total)
        text = tqdm.format_meter(self.n, self.total if known else None,
                                 time.monotonic() - self.start, prefix=self.desc,
                                 unit=self.unit, bar_format=_LINE if known else _LINE_NO_TOTAL,
                                 **_scale(self.unit))
        return f"{text} {self.text}" if self.text else text

    def _show(self) -> None:
        now = time.monotonic()
        tenth = self.n * 10 // self.total if self.total else 0
        if tenth > self._last_tenth or now - self._last_at >= EVERY_S:
            self._last_tenth, self._last_at = tenth, now
            self.say(self.line())


class _TerminalBar(Bar):
    """A tqdm bar drawn on a terminal."""

    def __init__(self, total: int | None, desc: str, unit: str, stream: TextIO):
        super().__init__(total, desc, unit, lambda _line: None)
        self._bar = tqdm(total=total, desc=desc, unit=unit, file=stream, dynamic_ncols=True,
                         mininterval=0.2, **_scale(unit))

    def update(self, n: int = 1) -> None:
        self.n += n
        self._bar.update(n)

    def to(self, done: int, total: int | None = None) -> None:
        if total is not None and total != self._bar.total:
            self._bar.total = total or None
        self.update(done - self.n)

    def note(self, text: str) -> None:
        self._bar.set_postfix_str(text, refresh=False)

    def close(self) -> None:
        self._bar.close()


def _scale(unit: str) -> dict:
    # Bytes read best as KB/MB/GB per second; counts of things as they are.
    return {"unit_scale": True, "unit_divisor": 1024} if unit == "B" else {}


@contextlib.contextmanager
def progress_bar(total: int | None, desc: str, unit: str = "it", *,
                 say: Say | None = None) -> Iterator[Bar]:
    """A bar for one step of `total` units (None: not known yet; `Bar.to` may say it).
    `say`: a Console (default: stderr's), or any line sink for plain lines."""
    say = say if say is not None else Console()
    if isinstance(say, Console) and say.tty:
        bar: Bar = _TerminalBar(total, desc, unit, say.stream)
    else:
        bar = Bar(total, desc, unit, say)
    try:
        yield bar
    finally:
        bar.close()


def tracked(items: Sequence[T], desc: str, unit: str = "it", *,
            say: Say | None = None) -> Iterator[T]:
    """Each of `items` in turn, with a bar of how many are done (an eval's outer loop)."""
    with progress_bar(len(items), desc, unit, say=say) as bar:
        for item in items:
            yield item
            bar.update()
