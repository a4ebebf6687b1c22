"""Stop strings cut the text wherever token boundaries fall; UTF-8 stays whole."""

from __future__ import annotations

import random

import pytest

from skippy.mesh.front.stop_text import StopStrings, StopText


def feed(stops, pieces):
    s = StopStrings(stops)
    out = "".join(s.push(p) for p in pieces)
    return out + ("" if s.stopped else s.flush()), s.stopped


def oracle(stops, text):
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


def test_stop_string_spanning_pieces_is_cut_and_not_returned():
    assert feed(["\n\nUser:"], ["Hi", " there\n", "\nUs", "er: more"]) == ("Hi there", True)


def test_partial_stop_is_held_back_then_released():
    s = StopStrings(["END"])
    assert s.push("abcE") == "abc"
    assert s.push("N") == ""
    assert s.push("x") == "ENx"
    assert s.flush() == ""


def test_earliest_of_several_stops_wins():
    assert feed(["cd", "b"], ["abcd"]) == ("a", True)
    assert feed(["bcd", "cx"], ["ab", "cd"]) == ("a", True)


def test_the_stop_string_that_ended_the_text_is_named():
    s = StopStrings(["cx", "bcd", "zz"])
    assert s.matched is None and s.push("ab") == "a" and s.matched is None
    assert s.push("cd") == "" and s.matched == "bcd"  # Anthropic's stop_sequence


@pytest.mark.parametrize("seed", range(40))
def test_any_split_equals_cutting_the_whole_text(seed):
    rng = random.Random(seed)
    text = "".join(rng.choice("ab\n") for _ in range(30))
    stops = ["".join(rng.choice("ab\n") for _ in range(rng.randint(1, 4)))
             for _ in range(rng.randint(1, 3))]
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, 8)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert feed(stops, pieces) == oracle(stops, text)


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError):
        StopStrings(["x", ""])


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from skippy.mesh.tokenizer import Tokenizer
    return Tokenizer(smollm2)


def test_multibyte_characters_come_out_whole(tokenizer):
    text = "Snow ❄️ and 🎉 fête"
    ids = tokenizer.encode(text, add_special=False)
    stream = StopText(tokenizer)
    pieces = [stream.push(t) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + stream.finish() == tokenizer.decode(ids)


def test_stop_string_made_of_multibyte_characters(tokenizer):
    ids = tokenizer.encode("Party 🎉 now", add_special=False)
    stream = StopText(tokenizer, ["🎉"])
    out = ""
    for t in ids:
        out += stream.push(t)
        if stream.stopped:
            break
    assert (out, stream.stopped) == ("Party ", True)
