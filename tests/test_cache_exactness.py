"""Cache on vs off on the corpus: the first 2 records of each use case, their first 192
tokens (hits at the 64- and 128-token chunk boundaries of shared prefixes; the full set:
`python -m skippy.evals.cache_exactness`)."""

from __future__ import annotations

import pytest

from skippy.evals.cache_exactness import compare
from skippy.evals.numerics import first_of_each_use_case


def check(path, corpus, stages):
    r = compare(path, first_of_each_use_case(corpus, 2), stages, cap=192)
    bad = [x["id"] for x in r["rows"] if not (x["same_tokens"] and x["bitwise_logits"])]
    print(f"\n{r['model']} x{stages}: reused {r['reused_tokens']}/{r['prompt_tokens']} tokens")
    assert not bad, f"cache on differs from cache off for {bad}"
    assert r["reused_tokens"] > 0


def test_smollm2_cache_exact_on_corpus(smollm2, corpus):
    check(smollm2, corpus, 2)


def test_qwen3_cache_exact_on_corpus(qwen3_f32, corpus):
    check(qwen3_f32, corpus, 3)


@pytest.mark.slow
def test_gemma3_cache_exact_on_corpus(gemma3, corpus):
    check(gemma3, corpus, 1)
