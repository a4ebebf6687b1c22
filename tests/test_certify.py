"""`skippy certify`: every state hand-off exact, and a broken one caught."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from skippy.evals import certify as certify_mod
from skippy.evals.certify import certify


@pytest.mark.parametrize("model, stages", [("qwen3_f32", 1), ("qwen3_f32", 3), ("smollm2", 2),
                                           ("lfm2_f32", 1), ("lfm2_f32", 3),
                                           ("falcon_h1_f32", 3)])
def test_certify_passes(model, stages, request):
    report = certify(request.getfixturevalue(model), stages)
    assert report.passed, report.table()
    names = {c.name for c in report.checks}
    assert {"restore_equals_recompute", "repeated_hits", "full_state",
            "roundtrip_state_matches"} <= names
    assert ("split_handoff" in names) == (stages > 1)


@pytest.mark.parametrize("model", ["smollm2", "lfm2_f32", "falcon_h1_f32"])
def test_certify_passes_on_the_llama_cpp_runtime(model, request):
    report = certify(request.getfixturevalue(model), 1, "llama.cpp")
    assert report.passed, report.table()


def test_a_state_that_changes_in_transit_fails(qwen3_f32, monkeypatch):
    real = certify_mod.through_store

    def nudged(state, store, kind):
        out = real(state, store, kind)
        out.keys[0] = out.keys[0] + 1e-6  # one layer's keys off by a hair
        return out

    monkeypatch.setattr(certify_mod, "through_store", nudged)
    report = certify(qwen3_f32, 1)
    assert not report.passed
    failed = {c.name for c in report.checks if c.passed is False}
    assert "restore_equals_recompute" in failed


def test_cli_json_and_exit_codes(qwen3_f32):
    run = lambda *a: subprocess.run([sys.executable, "-m", "skippy.mesh.cli", "certify", *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=600,
                                    env=os.environ.copy())
    ok = run("--model", str(qwen3_f32), "--stages", "2", "--json")
    assert ok.returncode == 0, ok.stderr
    data = json.loads(ok.stdout)
    assert data["passed"] is True and data["stages"] == 2
    bad = run("--model", str(qwen3_f32), "--stages", "2", "--runtime", "llama.cpp")
    assert bad.returncode == 2 and "stages 1" in bad.stderr and "Traceback" not in bad.stderr


def test_a_token_the_f16_wire_flips_is_named_with_how_near_a_tie_it_was():
    ref = torch.tensor([[3.0, 1.0, 0.0], [2.0, 1.99, 0.0]])
    got = torch.tensor([[3.0, 1.0, 0.0], [1.98, 2.0, 0.0]])
    text = certify_mod.first_difference(ref, [0, 0], got, [0, 1])
    assert "greedy token 2 of 2 differs" in text
    assert "1.00e-02 apart" in text and "up to 2.00e-02 off" in text
    assert certify_mod.first_difference(ref, [0, 0], ref, [0, 0]) == ""
