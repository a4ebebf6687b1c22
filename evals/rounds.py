"""Figures of several rounds as one: a bench that runs its servers in turn, round after
round, merges each server's rounds here.

Why rounds: this VM's speed drifts (up to 1.3x within minutes, nothing else running), so
servers run one after another carry the drift into their ratios; run in turn, each round's
pair ran back to back, and the median of the rounds' ratios leaves most of it out.

Merging: samples are pooled (and their summary taken again by the caller's `summarize`),
rates and other measured floats go by their median, errors are summed, counts that every
round shares are kept, and lists of per-item figures (a sweep) merge item by item.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

SUMMED = ("errors",)  # counted over every round, not per round


def merge(rounds: list, summarize: Callable[[list[float]], dict]) -> object:
    """One value for the rounds' values of the same figure (the same key in each)."""
    first = rounds[0]
    if isinstance(first, dict):
        keys = dict.fromkeys(k for r in rounds for k in r)
        out = {k: merge([r[k] for r in rounds if k in r], summarize) for k in keys}
        for k in SUMMED:
            if k in out:
                out[k] = sum(r.get(k) or 0 for r in rounds)
        if isinstance(out.get("samples_ms"), list):
            out.update(summarize(out["samples_ms"]))
        return out
    if isinstance(first, list):
        if first and all(isinstance(x, dict) for r in rounds for x in r):
            return [merge(list(items), summarize) for items in zip(*rounds)]
        return [x for r in rounds for x in r]
    if first is None or isinstance(first, (bool, str)):
        return next((r for r in rounds if r is not None), None)
    if isinstance(first, float):
        values = [r for r in rounds if r is not None and not math.isnan(r)]
        return statistics.median(values) if values else math.nan
    if isinstance(first, int):
        return first if all(r == first for r in rounds) else sum(rounds)
    return first


def paired(ratio: Callable[[dict, dict], float], ours: list[dict], reference: list[dict]
           ) -> list[float]:
    """Each round's ratio of ours to the reference (rounds in the same order)."""
    return [ratio(o, r) for o, r in zip(ours, reference)]
