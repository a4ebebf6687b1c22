"""`skippy certify` over every family × split × weight format: is every hand-off exact in
every format the torch runtime holds weights in?

    python -m skippy.evals.certify_matrix [--model smollm2 ...] [--stages 1 --stages 2 ...]
        [--weight-format fp32 ...] [--json PATH|-]

Defaults: the shipped models smollm2 and gemma3-270m, and every synthetic file the family
registry names (topology/families.py: each family's SynthCase, at its synthetic table's
sizes with the case's knobs, f32 weights, SmolLM2's tokenizer: the files the family tests
read), kept under `model_home()/synth` so reruns are free; splits 1, 2 and 3; every
format in stages/linear.py WEIGHT_FORMATS. `--model` also takes anything `skippy certify
--model` does (a name we hold, a .gguf). One row per model × stages × format: each check
PASS/FAIL (`-` where it does not apply: split_handoff at 1 stage; `rows`, the
row-invariance check, says `chunked` where the format keeps the chunked contract), the diagnostics
(roundtrip_state_matches: a re-export byte-identical or not; recurrent_only: the family's
state, KV or KV+recurrent) and the seconds taken; each failed check's detail (with its
max |d|) follows the table. Rows go to stderr as they finish, the whole table to stdout at
the end (stderr with `--json -`). A split the model cannot take (more stages than layers)
is a skipped row. Exit code 1 when a check failed, 2 when a model is missing. `--json P`
also draws P.png: a pass grid, model x split by format.

A synthetic f32 file has no 4-bit blocks, so its int4 matrices run as int8 (the rule in
stages/linear.py); the shipped files keep their own blocks.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from skippy.evals import plots
from skippy.mesh.progress import Console, tracked
from skippy.stages.certify import certify
from skippy.stages.linear import WEIGHT_FORMATS
from skippy.topology.families import SynthCase, synth_case, synth_cases
from skippy.topology.planner import PlanError
from skippy.evals.entry import guarded

SHIPPED = ("smollm2", "gemma3-270m")  # the catalogue's real checkpoints (mesh/models.py)
SPLITS = (1, 2, 3)
CHECKS = ("split_handoff", "restore_equals_recompute", "repeated_hits", "full_state")


def default_models() -> list[str]:
    """The default rows' models: the shipped ones, then every synthetic file the registry
    names (asked when called, so a family registered later is listed)."""
    return [*SHIPPED, *(case.name for _, case in synth_cases())]


def synth_path(arch: str, case: SynthCase, synth_dir: Path | None = None) -> Path:
    """The registry case's file, written on first use (the same arguments give the same
    bytes, so an existing file is the same file)."""
    from skippy.mesh.models import model_home, resolve_model
    from skippy.stages.synth import synth_file_name, write_synthetic
    folder = Path(synth_dir) if synth_dir is not None else model_home() / "synth"
    settings = dict(case.settings)
    out = folder / synth_file_name(arch, layers=case.layers, seed=case.seed, **settings)
    if not out.exists():
        folder.mkdir(parents=True, exist_ok=True)
        write_synthetic(arch, layers=case.layers, seed=case.seed, out=out,
                        tokenizer_from=resolve_model("smollm2"), **settings)
    return out


def model_path(name: str, synth_dir: Path | None = None) -> Path:
    """A registry case's file (synthesized on first use), else `skippy certify --model`'s."""
    from skippy.mesh.models import resolve_model
    if name not in SHIPPED and name in {c.name for _, c in synth_cases()}:
        fam, case = synth_case(name)
        return synth_path(fam.name, case, synth_dir)
    return resolve_model(name)


def run(models: list[str], splits: list[int], formats: list[str],
        synth_dir: Path | None = None, say=print) -> dict:
    """Certify every model × split × format (torch runtime), saying each row as it is
    done; each row is the certify report as a dict plus name, seconds and skipped (a
    reason, or None)."""
    paths = {name: model_path(name, synth_dir) for name in models}  # a missing one: now
    default = set(default_models())
    say(HEADER)
    rows, started = [], time.perf_counter()
    cells = [(spec, path, n, fmt) for spec, path in paths.items() for n in splits
             for fmt in formats]
    for spec, path, n, fmt in tracked(cells, "certify_matrix", "row", say=say):
        t = time.perf_counter()
        try:
            row = certify(path, n, weight_format=fmt).as_dict()
            row["skipped"] = None
        except PlanError as e:  # more stages than the model has layers
            row = {"model": str(path), "stages": n, "runtime": "torch",
                   "weight_format": fmt, "passed": None, "checks": [], "skipped": str(e)}
        row.update(name=spec if spec in default else path.stem,
                   seconds=time.perf_counter() - t)
        rows.append(row)
        say(format_row(row))
    return {"models": models, "stages": splits, "weight_formats": formats,
            "passed": all(r["passed"] is not False for r in rows),
            "seconds": time.perf_counter() - started, "rows": rows}


# -- the table --------------------------------------------------------------------------------
HEADER = (f"{'model':<12} {'stages':>6} {'format':<10} {'split':<5} {'restore':<7} "
          f"{'repeat':<6} {'full':<5} {'rows':<7} {'roundtrip':<9} {'state':<12} {'secs':>6}  "
          "result")


def format_row(r: dict) -> str:
    head = f"{r['name']:<12} {r['stages']:>6} {r['weight_format']:<10} "
    if r["skipped"]:
        return head + f"skipped: {r['skipped']}"
    status = {c["name"]: c for c in r["checks"]}

    def cell(name: str) -> str:
        c = status.get(name)
        return "-" if c is None else ("PASS" if c["passed"] else "FAIL")

    # The diagnostics' answers, from certify's wording of them.
    roundtrip = status["roundtrip_state_matches"]["detail"].endswith("True")
    recurrent = status["recurrent_only"]["detail"].startswith("recurrent state present")
    split, restore, repeat, full = (cell(n) for n in CHECKS)
    # row_invariant: None where the stages keep the chunked contract (nothing to check)
    rows = status.get("row_invariant")
    rows = "-" if rows is None else "chunked" if rows["passed"] is None else cell("row_invariant")
    return (head + f"{split:<5} {restore:<7} {repeat:<6} {full:<5} {rows:<7} "
            f"{'same' if roundtrip else 'differs':<9} "
            f"{'KV+recurrent' if recurrent else 'KV':<12} {r['seconds']:>6.1f}  "
            f"{'PASS' if r['passed'] else 'FAIL'}")


def table(result: dict) -> str:
    """Every row, then each failed check's detail (with its max |d|), then a count."""
    rows = result["rows"]
    lines = [HEADER] + [format_row(r) for r in rows]
    lines += [f"FAIL {r['name']} x{r['stages']} {r['weight_format']}: {c['name']}: "
              f"{c['detail']}" for r in rows for c in r["checks"] if c["passed"] is False]
    ran = [r for r in rows if r["passed"] is not None]
    passed = sum(r["passed"] for r in ran)
    lines.append(f"{passed}/{len(ran)} rows pass ({len(rows) - len(ran)} skipped) "
                 f"in {result['seconds']:.0f} s")
    return "\n".join(lines)


SHORT = {"split_handoff": "split", "restore_equals_recompute": "restore",
         "repeated_hits": "repeat", "full_state": "full"}


def plot(result: dict):
    """A pass grid: one row per model x stages, one column per weight format; green every
    check passed, red (naming the failed checks) a failure, grey a skipped split."""
    import numpy as np
    from matplotlib.colors import ListedColormap

    rows = result["rows"]
    lines = list(dict.fromkeys((r["name"], r["stages"]) for r in rows))
    formats = list(dict.fromkeys(r["weight_format"] for r in rows))
    grid = np.full((len(lines), len(formats)), np.nan)
    fig, ((ax,),) = plots.figure(width=max(6.4, 1.3 * len(formats) + 2.5),
                                 height=max(2.5, 0.32 * len(lines) + 1.2))
    for r in rows:
        i, j = lines.index((r["name"], r["stages"])), formats.index(r["weight_format"])
        grid[i, j] = -1 if r["skipped"] else (1 if r["passed"] else 0)
        failed = [SHORT.get(c["name"], c["name"]) for c in r["checks"] if c["passed"] is False]
        if failed:
            ax.text(j, i, ",".join(failed), ha="center", va="center", fontsize=7,
                    color="white")
    ax.imshow(grid, cmap=ListedColormap([plots.SKIP, plots.FAIL, plots.PASS]), vmin=-1.5,
              vmax=1.5, aspect="auto")
    ax.set_xticks(range(len(formats)), formats)
    ax.set_yticks(range(len(lines)), [f"{name} x{n}" for name, n in lines], fontsize=8)
    ax.set_xticks(np.arange(len(formats) + 1) - 0.5, minor=True)
    ax.set_yticks(np.arange(len(lines) + 1) - 0.5, minor=True)
    ax.grid(which="minor", color="white", linewidth=1)
    ax.tick_params(which="minor", length=0)
    ran = [r for r in rows if r["passed"] is not None]
    ax.set_title(f"certify, torch runtime: {sum(r['passed'] for r in ran)}/{len(ran)} pass",
                 fontsize=10)
    ax.set_xlabel("green: every check passed; red: the failed checks, named; grey: skipped "
                  "split", fontsize=8)
    return fig


def main(argv: list[str] | None = None) -> int:
    from skippy.evals.bench_gateway import emit
    from skippy.mesh.models import ModelError

    p = argparse.ArgumentParser(prog="python -m skippy.evals.certify_matrix")
    p.add_argument("--model", action="append",
                   help=f"repeatable; default: {', '.join(default_models())}")
    p.add_argument("--stages", type=int, action="append",
                   help=f"repeatable; default: {', '.join(map(str, SPLITS))}")
    p.add_argument("--weight-format", action="append", dest="formats", choices=WEIGHT_FORMATS,
                   help="repeatable; default: every format")
    p.add_argument("--json", help="also write the results to PATH and a pass grid to PATH "
                                  "with .png ('-': JSON on stdout, the table on stderr)")
    args = p.parse_args(argv)
    progress = Console()  # rows as they are done; a bar on a terminal
    try:
        result = run(args.model or default_models(), args.stages or list(SPLITS),
                     args.formats or list(WEIGHT_FORMATS), say=progress)
    except ModelError as e:  # e.g. a shipped model not pulled yet
        print(f"certify_matrix: {e}", file=sys.stderr)
        return 2
    emit(result, table(result), args.json, "certify_matrix")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(guarded(main))
