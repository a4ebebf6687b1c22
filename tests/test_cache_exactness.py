"""Cache on vs off on the corpus: the first 2 records of half the use cases each, their
first 192 tokens (hits at the 64- and 128-token chunk boundaries of shared prefixes);
SmolLM2 and Gemma 3 take alternate use cases, so every use case runs on a shipped model.
The full set: `python -m skippy.evals.cache_exactness`."""

from __future__ import annotations

import pytest

from skippy.evals.cache_exactness import compare
from skippy.evals.numerics import first_of_each_use_case


def half(corpus, which: int) -> list[dict]:
    """The first 2 records of every other use case (in the corpus's order), from `which`."""
    records = first_of_each_use_case(corpus, 2)
    cases = list(dict.fromkeys(r["use_case"] for r in records))[which::2]
    return [r for r in records if r["use_case"] in cases]


def check(path, records, stages):
    r = compare(path, records, stages, cap=192)
    bad = [x["id"] for x in r["rows"] if not (x["same_tokens"] and x["bitwise_logits"])]
    print(f"\n{r['model']} x{stages}: reused {r['reused_tokens']}/{r['prompt_tokens']} tokens")
    assert not bad, f"cache on differs from cache off for {bad}"
    assert r["reused_tokens"] > 0


def test_smollm2_cache_exact_on_corpus(smollm2, corpus):
    check(smollm2, half(corpus, 0), 2)


def test_qwen3_cache_exact_on_corpus(qwen3_f32, corpus):
    check(qwen3_f32, first_of_each_use_case(corpus, 2), 3)


@pytest.mark.slow
def test_gemma3_cache_exact_on_corpus(gemma3, corpus):
    check(gemma3, half(corpus, 1), 1)
