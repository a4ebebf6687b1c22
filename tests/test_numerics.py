"""Our torch stages against llama.cpp, logits at every position, on the same GGUF: the
first prompt of each use case, its last 128 tokens (Gemma 3, whose every row is 262k
logits on both sides: 64), two per use case at 256 in `python -m skippy.evals.numerics`."""

from __future__ import annotations

import pytest

from skippy.evals.numerics import (compare_on_corpus, first_of_each_use_case, margin_agreement,
                                   prompt_ids,
                                   whole_model)
from skippy.evals.reference import LlamaCppReference


WINDOW = 128


def report(result: dict) -> dict:
    print(f"\n{result}")
    return result


def test_smollm2_matches_llama_cpp_on_f16(smollm2_f16, corpus):
    r = report(compare_on_corpus(smollm2_f16, first_of_each_use_case(corpus, 1), WINDOW))
    assert r["top1"] >= 0.99
    assert r["min_final_cosine"] >= 0.9999


@pytest.mark.slow
def test_gemma3_matches_llama_cpp_on_f16(gemma3_f16, corpus):
    r = report(compare_on_corpus(gemma3_f16, first_of_each_use_case(corpus, 1), WINDOW // 2))
    assert r["top1"] >= 0.99
    assert r["min_final_cosine"] >= 0.9999


def test_synthetic_qwen3_f32_matches_llama_cpp(qwen3_f32, corpus):
    """f32 weights on both sides: the only differences are summation order."""
    ref = LlamaCppReference(qwen3_f32)
    rt = whole_model(qwen3_f32)
    prompts = [prompt_ids(ref, record)[:160] for record in first_of_each_use_case(corpus, 1)]
    r = margin_agreement(rt, ref, prompts)
    print(f"\nqwen3 f32: {r}")
    assert r["top1_where_clear"] and r["max_abs_delta"] <= 1e-3
