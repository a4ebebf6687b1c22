"""Turning a logits row into the next token id with the request's sampling settings.

Penalties and biases follow OpenAI's definitions: logit_bias adds a fixed amount to a
token's logit; presence_penalty subtracts once from every token already generated, and
frequency_penalty once per time it was generated (tokens of this completion, not the
prompt). They apply before greedy choice too: a biased greedy request is still exact.

A constrained request (mesh/constraint.py) first has every token its grammar forbids
next set to -inf (mesh/token_mask.py), then biases, penalties and the pick as usual: a
constrained greedy request is as exact and repeatable as any other.

Log-probabilities, when asked for, are the model's own: log_softmax of the logits as the
stage computed them, before the constraint's mask, biases, penalties and temperature (what
vLLM reports by default). With a compact head (stages/linear.py RescoredHead) the highest 64 logits are
float32 and the rest carry a small rounding error, which moves the normaliser slightly.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from skippy.topology.errors import RequestError

from .constraint import Constraint

if TYPE_CHECKING:
    from .token_mask import TokenMask


MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs


@dataclass(frozen=True)
class TokenLogprobs:
    """The chosen token's log-probability and the `k` most likely tokens' (id, log-prob),
    most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # 0: argmax of the logits
    top_p: float = 1.0
    top_k: int = 0             # 0: no limit
    seed: int | None = None    # None: a fresh random seed per request
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending
    logprobs: int | None = None  # report the chosen token's log-prob and this many top ones
    constraint: Constraint | None = None  # the shape the reply must take (mesh/constraint.py)

    def __post_init__(self):
        """RequestError naming the field for a setting out of range: a request's."""
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise RequestError(f"temperature must be a finite number >= 0, not "
                               f"{self.temperature}", "temperature")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], not {self.top_p}", "top_p")
        if not 0 <= self.top_k < 2**32:  # the stage wire's uint32
            raise RequestError(f"top_k must be in [0, {2**32 - 1}] (any above the vocabulary "
                               f"is no limit), not {self.top_k}", "top_k")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise RequestError(f"{name} must be in [-2, 2], not {getattr(self, name)}",
                                   name)
        if any(not -100 <= b <= 100 for _, b in self.logit_bias):
            raise RequestError("logit_bias values must be in [-100, 100]", "logit_bias")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], not "
                               f"{self.logprobs}", "logprobs")

    @property
    def deterministic(self) -> bool:
        return self.temperature == 0 or self.seed is not None


class Sampler:
    """One per request: its generator advances with each sampled token, so a seeded
    request gives the same tokens every time. A constrained request's `mask`
    (mesh/token_mask.py) forbids, before every pick, the tokens its grammar does not allow
    next, and moves past each token picked: the one place a constraint touches sampling."""

    def __init__(self, params: SamplingParams, generated: Iterable[int] = (),
                 mask: TokenMask | None = None):
        """`generated`: tokens the request produced before this sampler took over (a
        request rebuilt after a stage failed); the penalties count them too, the grammar
        moves past them, and a seeded generator first moves past the draws they took, so
        the request goes on as if nothing had failed."""
        self.params = params
        self._seed = params.seed if params.seed is not None else random.getrandbits(63)
        self._generator: torch.Generator | None = None  # made at the first draw
        generated = list(generated)
        self.counts = Counter(generated)  # tokens generated so far, for the penalties
        self._behind = len(generated) if params.temperature else 0  # draws to skip
        self.last: TokenLogprobs | None = None  # the last token's, when params.logprobs
        self._adjusts = bool(params.logit_bias or params.presence_penalty
                             or params.frequency_penalty)
        if (mask is None) != (params.constraint is None):
            raise ValueError("a constrained request needs its token mask (and only it)")
        self.mask = mask
        for token in generated if mask is not None else ():
            mask.advance(token)

    def __call__(self, logits: torch.Tensor) -> int:
        scores = logits if self.mask is None else self.mask.apply(logits)
        token = self._pick(self._adjusted(scores) if self._adjusts else scores)
        if self.mask is not None:
            self.mask.advance(token)
        self.counts[token] += 1
        k = self.params.logprobs
        if k is not None:  # the model's own log-probs: before the mask, as before biases
            logp = torch.log_softmax(logits.to(torch.float32), dim=-1)
            best = torch.topk(logp, k) if k else None
            top = () if best is None else tuple(
                zip(best.indices.tolist(), best.values.tolist()))
            self.last = TokenLogprobs(float(logp[token]), top)
        return token

    def _adjusted(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        scores = logits.to(torch.float32).clone()
        n = scores.numel()
        for token, bias in p.logit_bias:
            if token < n:
                scores[token] += bias
        if self.counts and (p.presence_penalty or p.frequency_penalty):
            ids = torch.tensor(list(self.counts))
            times = torch.tensor(list(self.counts.values()), dtype=torch.float32)
            scores[ids] -= p.presence_penalty + p.frequency_penalty * times
        return scores

    def _pick(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.temperature == 0:
            return argmax(logits)
        scores = logits.to(torch.float32) / p.temperature
        if p.top_k and p.top_k < scores.numel():
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if self._behind:
            self._skip(probs.numel())
        if not bool(torch.isfinite(probs).all()):
            # A tiny temperature scaled the logits past float32 (inf, then NaN): the limit
            # of such a distribution is the greedy choice. The draw is still taken, so a
            # seeded request rebuilt later skips exactly one draw per token.
            self._draw_nothing(probs.numel())
            return argmax(logits)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # keep the smallest head of the distribution whose mass reaches top_p
            drop = torch.cumsum(sorted_probs, 0) - sorted_probs >= p.top_p
            sorted_probs[drop] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    @property
    def generator(self) -> torch.Generator:
        """The request's generator (a greedy request never makes one)."""
        if self._generator is None:
            self._generator = torch.Generator().manual_seed(self._seed)
        return self._generator

    def _skip(self, n: int) -> None:
        """Move the generator past the draws of the tokens generated before this sampler."""
        for _ in range(self._behind):
            self._draw_nothing(n)
        self._behind = 0

    def _draw_nothing(self, n: int) -> None:
        """Take one draw's values from the generator and discard them: torch.multinomial
        (one sample) fills one Exp(1) value per token of the vocabulary and picks
        argmax(p / q), so each draw takes n values whatever p is."""
        torch.empty(n).exponential_(1, generator=self.generator)


def argmax(logits: torch.Tensor) -> int:
    """The index of the highest logit, the first of equal ones (a NaN counts highest, as
    in torch.argmax). numpy's for a float32 row: 4 us where torch's takes 50-80 on 49k
    logits (220 on 262k), a cost every greedy token pays."""
    if logits.dtype == torch.float32 and logits.dim() == 1 and logits.is_contiguous():
        return int(logits.numpy().argmax())
    return int(torch.argmax(logits))
