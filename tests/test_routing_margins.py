"""A near-tie in expert routing against a real disagreement (evals/routing_margins.py,
evals/numerics.py teacher_forced): the reference here is our own run with one expert
choice made the other way, as llama.cpp's summation order may make it."""

from __future__ import annotations

import numpy as np
import pytest

from family_checks import case_file
from skippy.evals.numerics import forced_rows, teacher_forced, whole_model
from skippy.evals.routing_margins import RoutingMargins

PROMPT = [(i * 7919) % 40000 + 100 for i in range(96)]
TOKENS = [5, 6, 7]


@pytest.fixture(scope="module")
def observed(smollm2, tmp_path_factory):  # smollm2: the tokenizer the file borrows
    """A4B in one stage under observation, and each row's margin in each block."""
    rt = whole_model(case_file("gemma4-a4b", tmp_path_factory))
    with RoutingMargins(rt) as routing:
        routing.start()
        ours = forced_rows(rt, PROMPT, TOKENS)
        yield rt, routing, ours, routing.margins(len(ours)).numpy()


def reference(rt, routing, flip: tuple[int, int]) -> np.ndarray:
    routing.start({flip})
    return forced_rows(rt, PROMPT, TOKENS)


def test_a_near_tie_the_reference_broke_the_other_way_is_followed(observed):
    rt, routing, ours, margins = observed
    b, row = np.unravel_index(margins.argmin(), margins.shape)
    assert margins[b, row] < 1e-3
    theirs = reference(rt, routing, (b, row))
    assert np.abs(theirs - ours).max() > 1e-3  # the other choice leaves the bar
    got, flips = teacher_forced(rt, routing, PROMPT, TOKENS, theirs)
    assert flips == [(row, routing.layers[b], pytest.approx(margins[b, row]))]
    assert np.array_equal(got, theirs)


def test_a_disagreement_where_every_choice_is_clear_still_fails(observed):
    rt, routing, ours, margins = observed
    row = int(margins.min(0).argmax())  # the row whose closest choice is the clearest
    b = int(margins[:, row].argmax())
    assert margins[:, row].min() > 1e-3
    theirs = reference(rt, routing, (b, row))
    got, flips = teacher_forced(rt, routing, PROMPT, TOKENS, theirs)
    assert flips == []
    off = np.flatnonzero(np.abs(got - theirs).max(-1) > 1e-3)
    assert len(off) and off[0] == row  # held to the bar from that row on
