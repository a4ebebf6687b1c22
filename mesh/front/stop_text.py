"""Generated token ids -> the completion text a client sees, with stop strings cut.

Two concerns, one pass per token:
- UTF-8: a character spread over several byte-level tokens comes out only once whole
  (the tokenizer's `TextStream`).
- Stop strings: the text ends before the earliest occurrence of any stop string, which is
  not returned. A stop string may span token boundaries, so text that could still be the
  start of one is held back until the next token settles it.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..tokenizer import Tokenizer


class StopStrings:
    """Text in, text safe to emit out; `stopped` once a stop string has been seen."""

    def __init__(self, stops: Sequence[str]):
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self.stops = tuple(stops)
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text
        self._held = ""

    def push(self, text: str) -> str:
        """The part of the text so far that can no longer become part of a stop string.

        A match cannot start in text already emitted: such text was emitted only because
        no stop string begins with any of its suffixes, so searching the held-back text
        plus the new text is enough."""
        if self.stopped:
            return ""
        buf = self._held + text
        hits = [(i, s) for i, s in ((buf.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda hit: hit[0])
            self.stopped, self._held = True, ""
            return buf[:at]
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """The text ended: what was held back is not a stop string after all."""
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop string."""
        longest = min(max((len(s) for s in self.stops), default=1) - 1, len(buf))
        for k in range(longest, 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0


class StopText:
    """Token ids in, completion text out (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str] = ()):
        self._decoder = tokenizer.stream_decoder()
        self._stops = StopStrings(stops)

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    @property
    def matched(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return self._stops.matched

    def push(self, token: int) -> str:
        return self._stops.push(self._decoder.push(token))

    def finish(self) -> str:
        """The rest of the text once generation ended for another reason than a stop
        string (an incomplete UTF-8 character becomes U+FFFD, as in `Tokenizer.decode`)."""
        return self._stops.push(self._decoder.flush()) + self._stops.flush()
