"""Turning a logits row into the next token id with the request's sampling settings."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # 0: argmax of the logits
    top_p: float = 1.0
    top_k: int = 0             # 0: no limit
    seed: int | None = None    # None: a fresh random seed per request

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, not {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, not {self.top_k}")

    @property
    def deterministic(self) -> bool:
        return self.temperature == 0 or self.seed is not None


class Sampler:
    """One per request: its generator advances with each sampled token, so a seeded
    request gives the same tokens every time."""

    def __init__(self, params: SamplingParams):
        self.params = params
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.temperature == 0:
            return int(torch.argmax(logits))
        scores = logits.to(torch.float32) / p.temperature
        if p.top_k and p.top_k < scores.numel():
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # keep the smallest head of the distribution whose mass reaches top_p
            drop = torch.cumsum(sorted_probs, 0) - sorted_probs >= p.top_p
            sorted_probs[drop] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))
