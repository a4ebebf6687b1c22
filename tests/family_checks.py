"""What every family must pass, written once; each family's test file calls these on its
own synthetic f32 file (issue 19's bar)."""

from __future__ import annotations

from skippy.evals.numerics import family_agreement
from skippy.stages.certify import certify


def check_agreement(path, name: str, **spec) -> dict:
    """Teacher-forced against llama.cpp: 2 prompts of 320 tokens, 16 decode steps."""
    r = family_agreement(path, **spec)
    print(f"\n{name} f32 vs llama.cpp: max |dlogit| {r['max_abs_delta']:.2e} over "
          f"{r['positions']} rows ({r['decided']} with a clear top-1)")
    assert r["top1_where_clear"], r
    assert r["max_abs_delta"] <= 1e-3, r
    return r


def check_certify(path, stages: int, weight_format: str) -> None:
    report = certify(path, stages, weight_format=weight_format)
    assert report.passed, report.table()
    assert all(c.max_abs_diff == 0.0 for c in report.checks if c.passed is not None)
