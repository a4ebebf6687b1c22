"""evals/family_servers.py's prompts: words of one token each, so that a row's shared part
is the same tokens on both servers, and each repeat's prompts its own."""

from __future__ import annotations

import pytest

from skippy.evals.family_servers import ROWS, Words, one_token_words, plan
from skippy.mesh.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def words(smollm2):
    tok = Tokenizer(smollm2)
    vocab = one_token_words(lambda s: tok.encode(s, add_special=False),
                            lambda i: tok.decode([i]), tok.vocab_size, limit=300)
    yield tok, vocab
    tok.close()


def test_a_prompt_of_n_words_is_n_tokens_and_shares_its_prefix_to_the_token(words):
    tok, vocab = words
    w = Words(vocab, seed=3)
    prefix = w.text(128)
    ids = tok.encode(prefix + w.text(16), add_special=False)
    assert len(ids) == 144 and ids[:128] == tok.encode(prefix, add_special=False)


def test_every_row_once_per_repeat_with_prompts_of_its_own(words):
    _, vocab = words
    repeats = plan(Words(vocab, seed=1), 2, hybrid=True)
    assert [[t.row for t in rows] for rows in repeats] == [list(ROWS)] * 2
    first, second = ({t.row: t for t in rows} for rows in repeats)
    assert first["warm_hit"].prompt != second["warm_hit"].prompt
    long = first["diverge_1000"]
    assert long.prompt.split(" ")[:1001] == long.warm[0].split(" ")[:1001]
    assert len(long.prompt.split(" ")) - 1 == 1024
    assert "{reply}" in first["next_turn"].prompt
    assert "diverge_1000" not in {t.row for t in plan(Words(vocab, 1), 1, hybrid=False)[0]}
