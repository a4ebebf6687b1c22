"""Every eval's plot (evals/plots.py): drawn from a JSON of the shape the eval writes, to a
real PNG. The stored JSONs (tests/data/evals/<eval>.json) were written by the evals
themselves in small runs (tests/data/evals/README.md has the commands); each is also read
back by its eval's own table or line code, so a stored JSON its eval no longer writes
fails here, and once rewritten, a plot that no longer reads it does too."""

from __future__ import annotations

import ast
import json
import struct
from pathlib import Path

import pytest

from skippy.evals import plots

ROOT = Path(__file__).resolve().parent.parent
EVALS = ROOT / "evals"
DATA = ROOT / "tests" / "data" / "evals"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) of a PNG file; fails on anything else."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path}: not a PNG"
    return struct.unpack(">II", data[16:24])


def assert_sensible_png(path: Path) -> None:
    width, height = png_size(path)
    assert 400 <= width <= 4000 and 250 <= height <= 4000, (width, height)
    assert path.stat().st_size > 10_000  # something was drawn, not an empty canvas


def stored(bench: str) -> dict:
    return json.loads((DATA / f"{bench}.json").read_text())


def _takes_json(path: Path) -> bool:
    """Whether an eval's command line has a --json option (read from its source)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" \
                and any(isinstance(a, ast.Constant) and a.value == "--json" for a in node.args):
            return True
    return False


def test_every_eval_that_writes_json_is_drawn_and_has_a_stored_json():
    with_json = {p.stem for p in EVALS.glob("*.py") if _takes_json(p)}
    assert with_json == set(plots.BENCHES)
    assert {p.stem for p in DATA.glob("*.json")} == set(plots.BENCHES)


@pytest.mark.parametrize("bench", plots.BENCHES)
def test_each_eval_draws_its_stored_json(bench, tmp_path):
    result = stored(bench)
    assert result["bench"] == bench
    assert_sensible_png(plots.render(result, tmp_path / f"{bench}.png"))


def _read_back(bench: str, result: dict) -> str:
    """The stored JSON through its eval's own code that reads a result (its table, its
    printed lines, or the code that builds the figures from the samples)."""
    from importlib import import_module
    m = import_module(f"skippy.evals.{bench}")
    if bench in ("bench_cache", "bench_runtime"):
        return m._table(result)
    if bench in ("bench_cluster", "bench_mesh", "certify_matrix", "giant_proof"):
        return m.table(result)
    if bench == "bench_gateway":
        # the comparisons again from the servers' figures (json: NaN speedups compare)
        assert json.dumps(m.comparisons(result["servers"])) == json.dumps(result["comparisons"])
        return m.table(result)
    if bench == "bench_stage_cache":
        again = m.summary(result["families"], repeats=result["repeats"],
                          chunk=result["chunk"], seconds=result["seconds"])
        assert again == {k: v for k, v in result.items() if k != "bench"}
        return "\n".join(m.format_row(f["family"], r) for f in result["families"]
                         for r in f["rows"])
    if bench == "family_matrix":
        return m.markdown(result["families"])
    if bench == "bench_cold_tier":
        return "\n".join(m.line(r) for r in result["rows"])
    return "\n".join(m.line(r) for r in result["results"])


@pytest.mark.parametrize("bench", plots.BENCHES)
def test_each_stored_json_is_the_shape_its_eval_writes_now(bench):
    assert _read_back(bench, stored(bench)).strip()


def test_a_run_writes_its_png_and_the_command_draws_it_again(tmp_path, capsys):
    from skippy.evals import bench_cache
    out = tmp_path / "cache.json"
    result = bench_cache.main(["--entries", "8,16", "--tokens", "256", "--block", "16",
                               "--repeats", "5", "--json", str(out)])
    png = tmp_path / "cache.png"
    assert_sensible_png(png)
    assert json.loads(out.read_text()) == result and result["bench"] == "bench_cache"
    png.unlink()
    capsys.readouterr()
    assert plots.main([str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(png)
    assert_sensible_png(png)


def test_json_on_stdout_draws_nothing(tmp_path, capsys):
    assert plots.write({"x": 1}, "-", "bench_cache") is None
    assert json.loads(capsys.readouterr().out) == {"x": 1, "bench": "bench_cache"}
    assert not list(tmp_path.iterdir())


def test_a_json_written_before_bench_is_drawn_when_named(tmp_path, capsys):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({k: v for k, v in stored("bench_mesh").items() if k != "bench"}))
    assert plots.main([str(old)]) == 2
    assert "no eval named None" in capsys.readouterr().err
    assert plots.main([str(old), "--bench", "bench_mesh"]) == 0
    assert_sensible_png(tmp_path / "old.png")


@pytest.mark.parametrize("text, says", [
    ("[1, 2]", "not an eval's JSON"),
    ("{not json", "Expecting property name"),
    ('{"bench": "bench_mesh"}', "not the shape bench_mesh writes (KeyError"),
])
def test_bad_input_is_one_line_not_a_traceback(tmp_path, capsys, text, says):
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    assert plots.main([str(bad)]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert plots.main([str(tmp_path / "absent.json")]) == 2


def test_make_figures_makes_every_figure_the_readme_embeds_with_valid_arguments(tmp_path):
    import re
    from importlib import import_module

    from skippy.evals import figures
    readme = (ROOT / "README.md").read_text()
    embedded = set(re.findall(r"\]\(evals/figures/(\w+)\.png\)", readme))
    assert embedded and embedded <= set(figures.FIGURES_BY_EVAL) <= set(plots.BENCHES)
    for name, fig in figures.FIGURES_BY_EVAL.items():
        cmd = figures.command(name, tmp_path / f"{name}.json")
        assert cmd[-2:] == ["--json", str(tmp_path / f"{name}.json")]
        assert f"skippy.evals.{name}" in cmd
        parse = getattr(import_module(f"skippy.evals.{name}"), "parse_args", None)
        if parse is not None:  # the eval's own parser takes the figure's arguments
            parse([*fig.args, "--json", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit):
        figures.main(["no_such_eval"])
