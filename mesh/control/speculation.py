"""Speculative decoding's proposals: which tokens a decode step sends to be verified.

A decode step may carry k proposed tokens after the one it appends (proto Decode.proposed):
every stage computes their rows in the same step, and the last stage samples the rows in
order, stopping at the first draw that differs from the proposal (mesh/stage/session.py
`_verify`). Row-invariant stages compute each row bitwise as a step of one row would, and
the sampler draws exactly as often as without proposals, so the text and its log-probs are
the same with speculation on or off, greedy or seeded; a pipeline just pays its hops once
per accepted run instead of once per token.

Proposals come from a draft model where the engine has one (mesh/control/draft.py), else
from the last stage where the model ships a NextN layer (stages/nextn.py: it sends them
with each answer, as many as the step asked for), else from prompt lookup: the tokens
that followed the latest earlier occurrence
of the context's last n tokens (n from MAX_NGRAM down to MIN_NGRAM), which pays where
answers repeat spans of their input (code edits, RAG answers, agent loops).

How many to send (k) is chosen from what the request and its pipeline measure: the
request's recent acceptance a (each proposal taken, each run cut short, older steps
weighing less) and the pipeline's step costs (StepCosts: seconds of a one-row step, of
each further row, of a draft's proposal), as the k that maximizes the expected tokens
per second, (1 + a + ... + a^k) / (one row + k * (a row + a proposal)). A pipeline whose
hops cost much against its rows sends long runs; one where a row costs nearly a step sends
few or none. Until the pipeline has measured both costs, k adapts by rule: a run accepted
whole doubles it (up to MAX_PROPOSED), a rejection sets it to what was accepted plus one.
Where no k pays (or nothing is accepted) proposals are held back for a while, longer each
time, so a request whose text does not repeat its input decodes as it would without
speculation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

MAX_NGRAM = 4
MIN_NGRAM = 2
MAX_PROPOSED = 8
FIRST_K = 4
MAX_PAUSE = 32  # steps without proposals after repeated misses, at most
DECAY = 0.8  # the weight of a request's earlier verify steps in its acceptance, per step
EWMA = 0.2  # the weight of a new step in a pipeline's measured costs


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


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - EWMA) * old + EWMA * new


class StepCosts:
    """What one pipeline's decode steps cost, as its requests' drivers measure them while
    they decode alone: seconds of a one-row step (the stages' compute, the hops, the
    sessions), of each further row of a verify step, and of a draft model's proposal.
    Shared by the pipeline's requests, so that a new one chooses k from its first step."""

    def __init__(self):
        self.step_s: float | None = None
        self.row_s: float | None = None
        self.draft_s: float | None = None

    def observe_step(self, rows: int, seconds: float) -> None:
        if rows == 1:
            self.step_s = _ewma(self.step_s, seconds)
        elif self.step_s is not None:
            self.row_s = _ewma(self.row_s, max(0.0, seconds - self.step_s) / (rows - 1))

    def observe_draft(self, proposals: int, seconds: float) -> None:
        if proposals:
            self.draft_s = _ewma(self.draft_s, seconds / proposals)

    def best_k(self, acceptance: float, most: int) -> int | None:
        """The k in 0..most with the most expected tokens per second at `acceptance`;
        None until a one-row step and a verify step were measured."""
        if self.step_s is None or self.row_s is None:
            return None
        per = self.row_s + (self.draft_s or 0.0)
        best, best_rate, expected = 0, 1.0 / self.step_s, 1.0
        for k in range(1, most + 1):
            expected += acceptance ** k
            rate = expected / (self.step_s + per * k)
            if rate > best_rate:
                best, best_rate = k, rate
        return best


class Speculator:
    """One request's proposals and how many it sends (see the module docstring);
    `draft`: where they come from instead of prompt lookup (draft.py: (context, k) -> a
    draft model's k tokens; blocking); `costs`: its pipeline's measured step costs."""

    def __init__(self, context: Iterable[int],
                 draft: Callable[[list[int], int], list[int]] | None = None,
                 costs: StepCosts | None = None, staged: bool = False):
        """`staged`: the last stage's proposer sends the proposals (`offer`)."""
        self.lookup = PromptLookup(context)
        self.draft = draft
        self.costs = costs
        self.staged = staged
        self.offered: list[int] = []  # the last stage's proposals for the next step
        self.k = FIRST_K
        self._misses = 0
        self._pause = 0
        self._taken, self._cut = 1.0, 1.0  # the acceptance's prior: one of each, a = 1/2
        self.proposed = self.accepted = 0

    @property
    def acceptance(self) -> float:
        """Recent odds that a proposal is taken, given the one before it was (the
        geometric model's estimate: taken / (taken + runs cut short))."""
        return self._taken / (self._taken + self._cut)

    def propose(self, context_tail: Iterable[int], room: int) -> list[int]:
        """Proposals after the context grown by `context_tail`, at most `room` of them
        (what max_tokens leaves after the next token)."""
        self.lookup.extend(context_tail)
        if self._pause > 0:
            self._pause -= 1
            return []
        if self.draft is not None:
            return self.draft(self.lookup.tokens, min(self.k, room))
        if self.staged:
            return self.offered[:min(self.k, room)]
        return self.lookup.propose(min(self.k, room))

    def wanted(self, alone: bool) -> int:
        """How many proposals to ask the last stage's proposer for, for the step after
        the one being sent: none while held back, or where proposals are not verified."""
        return self.k if self.staged and alone and self._pause == 0 else 0

    def observe(self, proposed: int, accepted: int, offered: Iterable[int] = ()) -> None:
        """A verify step's outcome: `accepted` of `proposed` tokens taken; `offered`: the
        last stage's proposals sent with its answer, for the next step."""
        self.offered = list(offered)
        if not proposed:
            return
        self.proposed += proposed
        self.accepted += accepted
        self._taken = DECAY * self._taken + accepted
        self._cut = DECAY * self._cut + (accepted < proposed)
        k = None if self.costs is None else self.costs.best_k(self.acceptance, MAX_PROPOSED)
        if k is None:  # the pipeline's costs not yet measured: by rule
            k = min(MAX_PROPOSED, 2 * self.k) if accepted == proposed else accepted + 1
        if k and accepted:
            self.k, self._misses = k, 0
        else:  # nothing taken, or no k pays: hold back, then try one again
            self.k, self._misses = 1, self._misses + 1
            self._pause = min(MAX_PAUSE, 2 ** self._misses - 1)
