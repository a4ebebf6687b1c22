"""`skippy certify --stage A..B`: one stage of a package certified alone, fed synthetic
upstream activations, with the parts of every other layer absent from the disk."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from skippy.mesh.cli import main as cli_main
from skippy.stages import certify_range as cr
from skippy.stages.package import split_package
from skippy.topology.model_package import MANIFEST


@pytest.fixture(scope="module")
def late_stage_only(qwen3_f32, tmp_path_factory):
    """qwen3_f32 as a package holding only what layers 3..6 (the last stage) read."""
    full = tmp_path_factory.mktemp("pkg") / "full"
    split_package(qwen3_f32, full)
    keep = {"shared.gguf", "output.gguf"} | {f"layer-{i:03d}.gguf" for i in range(3, 6)}
    pkg = tmp_path_factory.mktemp("pkg") / "late"
    pkg.mkdir()
    shutil.copy(full / MANIFEST, pkg)
    for part in json.loads((full / MANIFEST).read_text())["parts"]:
        if part["file"] in keep:
            shutil.copy(full / part["file"], pkg)
    assert not (pkg / "layer-000.gguf").exists() and not (pkg / "embeddings.gguf").exists()
    return pkg


@pytest.mark.parametrize("fmt", ["fp32", "int4"])
def test_the_last_stage_of_a_partial_package_certifies_alone(late_stage_only, fmt, capsys):
    rc = cli_main(["certify", "--model", str(late_stage_only), "--stage", "3..6",
                   "--weight-format", fmt, "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["passed"], report
    names = {c["name"] for c in report["checks"] if c["passed"] is not None}
    # the rows checked where the stage keeps the row-invariant contract (int4, our kernel)
    rows = {"row_invariant"} if fmt == "int4" else set()
    assert names == {"split_handoff", "restore_equals_recompute", "repeated_hits",
                     "full_state"} | rows
    assert all(c["max_abs_diff"] == 0.0 for c in report["checks"] if c["passed"])


def test_a_middle_stage_and_the_first_stage_certify(qwen3_f32):
    for a, b in [(0, 2), (2, 5)]:
        report = cr.certify_range(qwen3_f32, a, b, weight_format="int8")
        assert report.passed, report.table()


def test_a_state_changed_in_transit_fails(qwen3_f32, monkeypatch):
    real = cr.through_store

    def nudged(state, store, kind):
        out = real(state, store, kind)
        out.keys[0] = out.keys[0] + 1e-6
        return out

    monkeypatch.setattr(cr, "through_store", nudged)
    report = cr.certify_range(qwen3_f32, 4, 6)
    failed = {c.name for c in report.checks if c.passed is False}
    assert failed == {"restore_equals_recompute", "full_state"}, report.table()


@pytest.mark.parametrize("text", ["3", "4..2", "a..b", "0..99"])
def test_a_bad_range_is_one_line_and_exit_2(qwen3_f32, text, capsys):
    assert cli_main(["certify", "--model", str(qwen3_f32), "--stage", text]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--stage" in err


def test_upstream_rows_are_fixed_by_position():
    class Cfg:
        vocab, hidden = 1000, 8
    a, b = cr._Upstream(Cfg, False, 40), cr._Upstream(Cfg, False, 40)
    assert torch.equal(a.inputs(0, 40).rows[30:], b.inputs(30, 40).rows)
    other = a.inputs(0, 40, other_from=32).rows
    assert torch.equal(other[:32], a.inputs(0, 32).rows) and not torch.equal(other[32:], a.rows[32:])
