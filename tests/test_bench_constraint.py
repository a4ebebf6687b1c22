"""The constrained-decoding bench (evals/bench_constraint.py): a small real run of the
engines that are installed, its JSON, table and plot, and the generated schemas it
shares with tests/test_constraint.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skippy.evals import bench_constraint as bench
from skippy.evals.json_schemas import conforms, schemas
from skippy.mesh.constraint import check, json_schema


def test_small_run_measures_each_engine_and_writes_json_and_png(tmp_path: Path, capsys):
    path = tmp_path / "constraint.json"
    out = bench.main(["--schemas", "2", "--steps", "12", "--json", str(path)])
    assert json.loads(path.read_text())["shares"] == out["shares"]
    assert path.with_suffix(".png").stat().st_size > 0
    rows = out["results"]
    assert {r["vocab"] for r in rows} == {49152, 262144}  # SmolLM2's and Gemma 3's
    assert "llguidance" in {r["engine"] for r in rows}
    for r in rows:
        assert r["steps"] > 0 and r["compile_ms"] > 0 and r["tokenizer_s"] > 0
        assert 0 < r["mask_cpu_us"]["p50"] <= r["mask_cpu_us"]["p95"]
        assert r["per_token_cpu_us"]["p50"] >= r["mask_cpu_us"]["p50"]
    assert out["decode_step"]["ms"] > 0
    assert 0 < out["shares"]["llguidance"] < 1
    assert "mask cost / SmolLM2 decode step" in capsys.readouterr().out


def test_generated_schemas_are_deterministic_bounded_and_compile():
    fifty = schemas(50)
    assert schemas(10) == fifty[:10] and schemas(50) == fifty
    assert schemas(5, seed=1) != fifty[:5]
    text = json.dumps(fifty)
    for word in ('"enum"', '"array"', '"number"', '"integer"', '"boolean"', '"maxLength"'):
        assert word in text
    assert any('"type": "object"' in json.dumps(s["properties"]) for _, s in fifty)
    for _, schema in fifty:
        check(json_schema(schema))


@pytest.mark.parametrize("reply, ok", [('{"a": 3}', True), ('{"a": "x"}', False),
                                       ('{"a": 3', False), ('{"a": 3, "b": 1}', False)])
def test_conforms_is_jsonschemas_verdict(reply, ok):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}},
              "required": ["a"], "additionalProperties": False}
    assert conforms(reply, schema) is ok
