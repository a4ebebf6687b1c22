"""The certify matrix (evals/certify_matrix.py): its table, JSON and exit code on one tiny
case, a split the model cannot take, and a broken hand-off caught and named."""

from __future__ import annotations

import json

import pytest

from skippy.evals import certify_matrix as matrix
from skippy.stages import certify as certify_mod
from skippy.topology.families import synth_cases


def test_table_and_json_of_a_passing_and_a_skipped_split(qwen3_f32, tmp_path, capsys):
    out = tmp_path / "matrix.json"
    rc = matrix.main(["--model", str(qwen3_f32), "--stages", "2", "--stages", "7",
                      "--weight-format", "int8", "--json", str(out)])
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == matrix.HEADER
    # int8 keeps the row-invariant contract: its rows check runs and passes
    assert lines[1].split() == ["qwen3-L6", "2", "int8", "PASS", "PASS", "PASS", "PASS",
                                "PASS", "same", "KV", lines[1].split()[-2], "PASS"]
    assert lines[2].startswith("qwen3-L6") and "skipped: cannot cut 6 layers" in lines[2]
    assert lines[-1].startswith("1/1 rows pass (1 skipped)")
    data = json.loads(out.read_text())
    assert data["passed"] is True and data["weight_formats"] == ["int8"]
    ran, skipped = data["rows"]
    assert (ran["name"], ran["stages"], ran["weight_format"], ran["passed"]) == \
        ("qwen3-L6", 2, "int8", True)
    assert {c["name"] for c in ran["checks"]} >= {"split_handoff", "restore_equals_recompute"}
    assert skipped["passed"] is None and "6 layers" in skipped["skipped"]
    assert data["bench"] == "certify_matrix"
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"  # the pass grid


def test_a_failed_check_is_named_with_its_difference_and_exits_1(qwen3_f32, monkeypatch,
                                                                   capsys):
    real = certify_mod.through_store

    def nudged(state, store, kind):
        out = real(state, store, kind)
        out.keys[0] = out.keys[0] + 1e-6
        return out

    monkeypatch.setattr(certify_mod, "through_store", nudged)
    rc = matrix.main(["--model", str(qwen3_f32), "--stages", "1", "--weight-format", "fp32",
                      "--json", "-"])
    assert rc == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["passed"] is False  # JSON on stdout, the table on stderr
    fails = [l for l in captured.err.splitlines() if l.startswith("FAIL qwen3-L6 x1 fp32: ")]
    assert any("restore_equals_recompute" in l and "max |d|" in l for l in fails)


@pytest.mark.parametrize("family, fixture", [("qwen3", "qwen3_f32"), ("lfm2", "lfm2_f32"),
                                             ("falcon-h1", "falcon_h1_f32")])
def test_synthetic_families_are_the_test_models(family, fixture, tmp_path, request):
    made = matrix.model_path(family, synth_dir=tmp_path)
    assert made.parent == tmp_path
    assert made.read_bytes() == request.getfixturevalue(fixture).read_bytes()


def test_defaults_cover_every_family_split_and_format():
    models = matrix.default_models()
    assert models[:2] == ["smollm2", "gemma3-270m"]
    assert models[2:] == [case.name for _, case in synth_cases()]
    assert {"qwen3", "lfm2", "falcon-h1", "qwen3moe", "minimax-m2", "gemma2", "olmo", "olmo2",
            "glm4", "llama3", "gemma4", "gemma4-a4b", "deepseek2", "qwen3next"} <= set(models)
    assert matrix.SPLITS == (1, 2, 3)
