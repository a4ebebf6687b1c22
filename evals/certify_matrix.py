"""`skippy certify` over every family × split × weight format: is every hand-off exact in
every format the torch runtime holds weights in?

    python -m skippy.evals.certify_matrix [--model smollm2 ...] [--stages 1 --stages 2 ...]
        [--weight-format fp32 ...] [--json PATH|-]

Defaults: the shipped models smollm2 and gemma3-270m, and qwen3, lfm2 and falcon-h1
synthesized by stages.synth at the sizes the tests use (tests/conftest.py: hidden 256,
6/6/4 layers, f32 weights, SmolLM2's tokenizer), kept under `model_home()/synth` so
reruns are free; splits 1, 2 and 3; every format in stages/linear.py WEIGHT_FORMATS.
`--model` also takes anything `skippy certify --model` does (a name we hold, a .gguf).
One row per model × stages × format: each check PASS/FAIL (`-` where it does not apply:
split_handoff at 1 stage), the diagnostics (roundtrip_state_matches: a re-export byte-
identical or not; recurrent_only: the family's state, KV or KV+recurrent) and the
seconds taken; each failed check's detail (with its max |d|) follows the table. Rows go
to stderr as they finish, the whole table to stdout at the end (stderr with `--json -`).
A split the model cannot take (more stages than layers) is a skipped row. Exit code 1
when a check failed, 2 when a model is missing. `--json P` also draws P.png: a pass grid,
model x split by format.

Also by default, issue 19's dense families gemma2, olmo, olmo2, glm4 and llama3 (llama
with rope_freqs), synthesized at 4 layers as tests/test_family_<name>.py writes them.

A synthetic f32 file has no 4-bit blocks, so its int4 matrices run as int8 (the rule in
stages/linear.py); the shipped files keep their own blocks.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from skippy.evals import plots
from skippy.evals.bench_stage_cache import Family, Shape
from skippy.mesh.progress import Console, tracked
from skippy.stages.certify import certify
from skippy.stages.linear import WEIGHT_FORMATS
from skippy.topology.planner import PlanError


def _test_shape(arch: str, **options) -> Shape:
    """The dense families' shape in their tests/test_family_<name>.py (synth defaults)."""
    return Shape(arch, layers=4, hidden=256, heads=4, kv_heads=2, ff=768, dtype="f32", seed=7,
                 **options)


# The synthetic shapes and seeds of tests/conftest.py's fixtures (stages.synth defaults).
MODELS = {
    "smollm2": Family("smollm2", "dense", model="smollm2"),
    "gemma3-270m": Family("gemma3-270m", "dense", model="gemma3-270m"),
    "qwen3": Family("qwen3", "dense", shape=Shape("qwen3", layers=6, hidden=256, heads=4,
                                                  kv_heads=2, ff=768, dtype="f32", seed=7)),
    "lfm2": Family("lfm2", "hybrid", shape=Shape("lfm2", layers=6, hidden=256, heads=4,
                                                 kv_heads=2, ff=768, dtype="f32", seed=3)),
    "falcon-h1": Family("falcon-h1", "hybrid",
                        shape=Shape("falcon-h1", layers=4, hidden=256, heads=4, kv_heads=2,
                                    ff=512, dtype="f32", seed=7)),
    # the E4B-like and A4B-like shapes of tests/test_family_gemma4.py
    "gemma4": Family("gemma4", "dense", shape=Shape("gemma4", layers=6, hidden=256, heads=4,
                                                    kv_heads=2, ff=512, dtype="f32", seed=5)),
    "gemma4-a4b": Family("gemma4-a4b", "dense",
                         shape=Shape("gemma4", layers=6, hidden=256, heads=4, kv_heads=2,
                                     ff=512, dtype="f32", seed=9, variant="a4b")),
    # tests/test_family_deepseek2.py's file, the synth's deepseek2 defaults: MLA (kv_lora
    # 128 + rope 16, YaRN), 1 dense layer, then 16 experts (4 used, grouped) + 1 shared
    "deepseek2": Family("deepseek2", "dense",
                        shape=Shape("deepseek2", layers=4, hidden=256, heads=8, kv_heads=1,
                                    ff=512, dtype="f32", seed=5)),
    # tests/test_family_qwen3moe.py and test_family_minimax_m2.py: 8 experts of width ff
    "qwen3moe": Family("qwen3moe", "dense",
                       shape=Shape("qwen3moe", layers=4, hidden=256, heads=4, kv_heads=2,
                                   ff=128, dtype="f32", seed=7)),
    "minimax-m2": Family("minimax-m2", "dense",
                         shape=Shape("minimax-m2", layers=4, hidden=256, heads=4, kv_heads=2,
                                     ff=128, dtype="f32", seed=7)),
    # tests/test_family_qwen3next.py's shape: DeltaNet and gated attention, MoE FFN
    "qwen3next": Family("qwen3next", "hybrid",
                        shape=Shape("qwen3next", layers=6, hidden=256, heads=4, kv_heads=2,
                                    ff=128, dtype="f32", seed=5)),
    "gemma2": Family("gemma2", "dense", shape=_test_shape("gemma2")),
    "olmo": Family("olmo", "dense", shape=_test_shape("olmo")),
    "olmo2": Family("olmo2", "dense", shape=_test_shape("olmo2")),
    "glm4": Family("glm4", "dense", shape=_test_shape("glm4")),
    "llama3": Family("llama3", "dense", shape=_test_shape("llama", rope_freqs=True)),
}
SPLITS = (1, 2, 3)
CHECKS = ("split_handoff", "restore_equals_recompute", "repeated_hits", "full_state")


def model_path(name: str, synth_dir: Path | None = None) -> Path:
    """A default model's file (synthesized on first use), else `skippy certify --model`'s."""
    if name in MODELS:
        return MODELS[name].path(synth_dir)
    from skippy.mesh.models import resolve_model
    return resolve_model(name)


def run(models: list[str], splits: list[int], formats: list[str],
        synth_dir: Path | None = None, say=print) -> dict:
    """Certify every model × split × format (torch runtime), saying each row as it is
    done; each row is the certify report as a dict plus name, seconds and skipped (a
    reason, or None)."""
    paths = {name: model_path(name, synth_dir) for name in models}  # a missing one: now
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
        row.update(name=spec if spec in MODELS else path.stem,
                   seconds=time.perf_counter() - t)
        rows.append(row)
        say(format_row(row))
    return {"models": models, "stages": splits, "weight_formats": formats,
            "passed": all(r["passed"] is not False for r in rows),
            "seconds": time.perf_counter() - started, "rows": rows}


# -- the table --------------------------------------------------------------------------------
HEADER = (f"{'model':<12} {'stages':>6} {'format':<10} {'split':<5} {'restore':<7} "
          f"{'repeat':<6} {'full':<5} {'roundtrip':<9} {'state':<12} {'secs':>6}  result")


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
    return (head + f"{split:<5} {restore:<7} {repeat:<6} {full:<5} "
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
                   help=f"repeatable; default: {', '.join(MODELS)}")
    p.add_argument("--stages", type=int, action="append",
                   help=f"repeatable; default: {', '.join(map(str, SPLITS))}")
    p.add_argument("--weight-format", action="append", dest="formats", choices=WEIGHT_FORMATS,
                   help="repeatable; default: every format")
    p.add_argument("--json", help="also write the results to PATH and a pass grid to PATH "
                                  "with .png ('-': JSON on stdout, the table on stderr)")
    args = p.parse_args(argv)
    progress = Console()  # rows as they are done; a bar on a terminal
    try:
        result = run(args.model or list(MODELS), args.stages or list(SPLITS),
                     args.formats or list(WEIGHT_FORMATS), say=progress)
    except ModelError as e:  # e.g. a shipped model not pulled yet
        print(f"certify_matrix: {e}", file=sys.stderr)
        return 2
    emit(result, table(result), args.json, "certify_matrix")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
