"""Certify's row-invariance check (DESIGN.md §5.3): on stages that keep the row-invariant
contract, a row's bits never depend on the call that computes it.

Every stage's output rows (the frame rows a stage hands on, the logits of the last) for
positions [0, n) of one prompt are computed once as the reference (64 rows per call from
position 0), then again: at 1, 3, 17, 64 and 200 rows per call, starting at positions 0,
5 and 64 (the rows before the start prefilled first); on one thread; and as decode steps,
a lane alone and beside 7 other lanes, whose rows must equal the prefill rows at their
positions. Stages that keep the chunked contract get a diagnostic instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .certify_report import Check, max_abs_diff
from .runtime_kind import Exactness

CALL_ROWS = (1, 3, 17, 64, 200)
STARTS = (0, 5, 64)
NEIGHBOURS = 7
DECODED = 4  # the prompt's last rows, decoded one step at a time

# inputs(a, b): the first stage's inputs for positions [a, b) (token ids, or a Frame)
Inputs = Callable[[int, int], object]


def row_invariance(stages, inputs: Inputs, n: int) -> Check:
    """The check over positions [0, n) of the prompt `inputs` gives."""
    chunked = [s.spec.stage_index for s in stages if s.exactness is not Exactness.ROW_INVARIANT]
    if chunked:
        return Check("row_invariant", None, f"stages {chunked} keep the chunked contract "
                     "(rows in chunks of their fixed shape): nothing to check")
    ref = _prefill_rows(stages, inputs, n, 0, 64)
    runs = {f"{r} rows per call from {s}": (s, _prefill_rows(stages, inputs, _end(n, s, r), s, r))
            for s in STARTS for r in CALL_ROWS if s < n and (s, r) != (0, 64)}  # (0, 64): ref
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        runs["one thread, 17 rows per call from 5"] = (5, _prefill_rows(stages, inputs, n, 5, 17))
    finally:
        torch.set_num_threads(threads)
    p = n - DECODED
    runs["decode steps alone"] = (p, _decode_rows(stages, inputs, n, 0))
    runs[f"decode steps beside {NEIGHBOURS} lanes"] = (p, _decode_rows(stages, inputs, n,
                                                                       NEIGHBOURS))
    runs[f"decode steps of {DECODED} rows beside {NEIGHBOURS} lanes"] = (
        p, _decode_rows(stages, inputs, n, NEIGHBOURS, DECODED))
    for what, (start, got) in runs.items():
        for i, (a, b) in enumerate(zip(ref, got)):
            want = a[start:start + b.shape[0]]
            if not torch.equal(want, b):
                row = start + int((want != b).reshape(b.shape[0], -1).any(1).nonzero()[0])
                d = max_abs_diff(want, b)
                return Check("row_invariant", False, f"{what}: stage {i}'s row {row} differs "
                             f"from 64 rows per call from 0; max |d| {d:.2e}", d)
    return Check("row_invariant", True, f"{len(runs)} ways of computing {n} rows ("
                 f"{', '.join(runs)}): every stage's rows bitwise equal", 0.0)


def _end(n: int, start: int, rows: int) -> int:
    """Enough positions for a few calls of `rows` and a short last one."""
    return min(n, start + 4 * rows + 7)


def _prefill_rows(stages, inputs: Inputs, n: int, start: int, rows: int) -> list[torch.Tensor]:
    """Each stage's output rows for [start, n), prefilled from `start` in calls of `rows`
    (the rows before `start` prefilled first, in one call)."""
    lanes = [s.alloc_lane() for s in stages]
    try:
        if start:  # rows compared only from `start`: no logits before it
            _through(stages, lanes, inputs(0, start), 0, start, "none")
        return _through(stages, lanes, inputs(start, n), start, rows)
    finally:
        for s, lane in zip(stages, lanes):
            s.free_lane(lane)


def _through(stages, lanes, x, start: int, rows: int,
             logits: str = "all") -> list[torch.Tensor]:
    """Each stage's output rows (the last stage's: `logits`, "all" or "none")."""
    outs = []
    for s, lane in zip(stages, lanes):
        out = s.prefill(lane, x, start, logits if s.spec.is_last else "last",
                        rows_per_call=rows)
        outs.append(out.logits if out.frame is None else out.frame.rows.float())
        x = out.frame
    return outs


def _decode_rows(stages, inputs: Inputs, n: int, neighbours: int,
                 k: int = 1) -> list[torch.Tensor]:
    """Each stage's rows for the prompt's last DECODED positions as decode steps of k rows
    of one lane, beside `neighbours` lanes of other prompts (of other lengths) in every
    step."""
    p = n - DECODED
    lanes = [[s.alloc_lane() for s in stages] for _ in range(neighbours + 1)]
    lengths = [p] + [8 + 9 * j for j in range(neighbours)]  # the neighbours' prompts
    order = list(range(len(lanes)))[::-1]  # ours last: its neighbours ahead of it
    try:
        for lane, m in zip(lanes, lengths):  # only the decode rows are compared
            _through(stages, lane, inputs(0, m), 0, 64, "none")
        outs = [[] for _ in stages]
        for at in range(0, DECODED, k):
            xs = [_step(inputs(m + at, m + at + k)) for m in lengths]
            for i, s in enumerate(stages):
                res = s.decode([(lanes[j][i], xs[j]) for j in order])
                ours = res[-1]
                outs[i].append(ours.logits.reshape(k, -1) if ours.logits is not None
                               else ours.frame.rows.float())
                xs = [res[order.index(j)].frame for j in range(len(lanes))]
        return [torch.cat(o) for o in outs]
    finally:
        for lane in lanes:
            for s, one in zip(stages, lane):
                s.free_lane(one)


def _step(x):
    """A decode step's input: a 0-d token id for one row, k token ids, or the Frame."""
    return x.reshape(()) if isinstance(x, torch.Tensor) and x.numel() == 1 else x
