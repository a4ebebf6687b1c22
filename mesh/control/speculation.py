"""Speculative decoding's proposals: which tokens a decode step sends to be verified.

A decode step may carry k proposed tokens after the one it appends (proto Decode.proposed):
every stage computes their rows in the same step, and the last stage samples the rows in
order, stopping at the first draw that differs from the proposal (mesh/stage/session.py
`_verify`). Row-invariant stages compute each row bitwise as a step of one row would, and
the sampler draws exactly as often as without proposals, so the text and its log-probs are
the same with speculation on or off, greedy or seeded; a pipeline just pays its hops once
per accepted run instead of once per token.

Proposals come from a draft model where the engine has one (mesh/control/draft.py), else
from prompt lookup: the tokens that followed the latest earlier occurrence
of the context's last n tokens (n from MAX_NGRAM down to MIN_NGRAM), which pays where
answers repeat spans of their input (code edits, RAG answers, agent loops). How many to
send adapts per request: a run accepted whole doubles k (up to MAX_PROPOSED); a rejection
sets it to what was accepted plus one; a step that accepts nothing holds proposals back
for a while, longer each time, so a request whose text does not repeat its input decodes
as it would without speculation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

MAX_NGRAM = 4
MIN_NGRAM = 2
MAX_PROPOSED = 8
FIRST_K = 4
MAX_PAUSE = 32  # steps without proposals after repeated misses, at most


class PromptLookup:
    """The context so far and, for each n-gram of up to MAX_NGRAM tokens, where the
    tokens after its latest occurrence begin."""

    def __init__(self, tokens: Iterable[int] = ()):
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            p = len(self.tokens)
            self.tokens.append(int(t))
            # the n-grams ending just before t are now followed by it
            for n in range(1, min(MAX_NGRAM, p) + 1):
                self._after[tuple(self.tokens[p - n:p])] = p

    def propose(self, k: int) -> list[int]:
        """k tokens that followed the longest recent match of the context's end; where
        the match is so recent that they run past the end, the span repeats (a loop in
        the text is proposed as one)."""
        if k <= 0:
            return []
        seq = self.tokens
        for n in range(min(MAX_NGRAM, len(seq)), MIN_NGRAM - 1, -1):
            at = self._after.get(tuple(seq[-n:]))
            if at is not None:
                out: list[int] = []
                for i in range(at, at + k):
                    out.append(seq[i] if i < len(seq) else out[i - len(seq)])
                return out
        return []


class Speculator:
    """One request's proposals and how many it sends (see the module docstring);
    `draft`: where they come from instead of prompt lookup (draft.py: (context, k) -> a
    draft model's k tokens; blocking)."""

    def __init__(self, context: Iterable[int],
                 draft: Callable[[list[int], int], list[int]] | None = None):
        self.lookup = PromptLookup(context)
        self.draft = draft
        self.k = FIRST_K
        self._misses = 0
        self._pause = 0
        self.proposed = self.accepted = 0

    def propose(self, context_tail: Iterable[int], room: int) -> list[int]:
        """Proposals after the context grown by `context_tail`, at most `room` of them
        (what max_tokens leaves after the next token)."""
        self.lookup.extend(context_tail)
        if self._pause > 0:
            self._pause -= 1
            return []
        if self.draft is not None:
            return self.draft(self.lookup.tokens, min(self.k, room))
        return self.lookup.propose(min(self.k, room))

    def observe(self, proposed: int, accepted: int) -> None:
        """A verify step's outcome: `accepted` of `proposed` tokens taken."""
        if not proposed:
            return
        self.proposed += proposed
        self.accepted += accepted
        if accepted == proposed:
            self.k, self._misses = min(MAX_PROPOSED, 2 * self.k), 0
        elif accepted:
            self.k, self._misses = accepted + 1, 0
        else:
            self.k, self._misses = 1, self._misses + 1
            self._pause = min(MAX_PAUSE, 2 ** self._misses - 1)
