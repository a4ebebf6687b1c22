"""A text that begins as a recent one did reuses its ids (mesh/prefix_tokens.py): the ids
are always llama.cpp's own for the whole text, on texts of every kind, sharing starts cut
anywhere; the reuse really happens on a byte-level BPE vocabulary (SmolLM2), and a
SentencePiece one (Gemma 3) reuses only whole texts."""

from __future__ import annotations

import random

import pytest

from skippy.mesh.prefix_tokens import MIN_BYTES
from skippy.mesh.tokenizer import Tokenizer

PIECES = ["the", "The", "cat", "sat", "on", "mat", "x", "I", "don't", "we're", "it's",
          "42", "1999", "3.14", "x2", "A1", ",", ".", "!", "?", ";", "(", ")", "--", "'",
          "\"", "café", "naïve", "日本語", "中文", "🙂", "Ωmega", "<|im_start|>",
          "<|im_end|>", "<|endoftext|>", "user", "assistant", "\n", "\n\n", "\t", "  ",
          "   ", " ", "http://x.y/z", "snake_case", "camelCase", "UPPER", "a-b", "#"]


def _text(rng: random.Random, n: int) -> str:
    out = []
    for _ in range(n):
        p = rng.choice(PIECES)
        out.append(p if rng.random() < 0.3 else " " + p)
    return "".join(out)


def _cases(rng: random.Random, n: int) -> list[str]:
    """Texts, most beginning as an earlier one did, cut anywhere (mid-word, at a space,
    inside a special token's spelling) and continued differently."""
    texts = [_text(rng, 80)]
    for _ in range(n):
        base = rng.choice(texts)
        cut = rng.randrange(len(base) + 1)
        texts.append(base[:cut] + _text(rng, rng.randrange(0, 30)) if rng.random() < 0.85
                     else _text(rng, 80))
    return texts


def _check(tok: Tokenizer, texts: list[str]) -> None:
    for flags in ((True, True), (False, True), (True, False), (False, False)):
        for text in texts:
            got = tok.encode(text, add_special=flags[0], control=flags[1])
            assert got == tok._encode(text.encode("utf-8"), *flags), (flags, text)


def test_reused_ids_are_llama_cpps_on_texts_of_every_kind(smollm2):
    tok = Tokenizer(smollm2)
    assert tok.cuts_at_space
    _check(tok, _cases(random.Random(0), 300))
    assert tok._prefix.reused > 10_000  # most ids came from earlier texts


def test_a_warm_prompt_tokenizes_only_its_new_words(smollm2):
    tok = Tokenizer(smollm2)
    prompt = " ".join(f"word{i % 7} and more" for i in range(60))
    assert len(prompt.encode()) >= MIN_BYTES
    tok.encode(prompt + " first question")
    before = tok._prefix.reused
    assert tok.encode(prompt + " second question") == \
        tok._encode((prompt + " second question").encode(), True, True)
    assert tok._prefix.reused - before >= len(tok.encode(prompt)) - 2


def test_a_sentencepiece_vocabulary_reuses_only_whole_texts(gemma3):
    tok = Tokenizer(gemma3)
    assert not tok.cuts_at_space
    texts = _cases(random.Random(1), 60)
    _check(tok, texts + texts)  # the second pass: whole texts seen before
    reused = tok._prefix.reused
    tok.encode(texts[0] + " more words here")
    assert tok._prefix.reused == reused  # no cut: tokenized whole


@pytest.mark.parametrize("text", ["word " * 80, "word\n" * 80, "é " * 200])
def test_long_runs_of_one_piece(smollm2, text):
    tok = Tokenizer(smollm2)
    for end in ("tail", " tail", "\ntail", "", "word"):
        got = tok.encode(text + end)
        assert got == tok._encode((text + end).encode(), True, True)


def test_what_is_kept_is_bounded_in_bytes(smollm2, monkeypatch):
    from skippy.mesh import prefix_tokens
    monkeypatch.setattr(prefix_tokens, "HELD_BYTES", 20_000)
    tok = Tokenizer(smollm2)
    rng = random.Random(2)
    for _ in range(40):
        text = _text(rng, 600)  # ~3 KB of text, ~1,000 ids
        assert tok.encode(text) == tok._encode(text.encode(), True, True)
    known = tok._prefix._known[(True, True)]
    held = sum(k.nbytes for k in known.values())
    assert 1 <= len(known) < 40 and (held <= 20_000 or len(known) == 1)
