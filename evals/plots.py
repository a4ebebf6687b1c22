"""Plots of the evals: every eval given `--json P` writes P and its figure P.png (P with a
.png suffix), and any stored JSON is drawn again the same way:

    python -m skippy.evals.plots P.json [Q.json ...]     # P.png next to each
    python -m skippy.evals.plots P.json --bench NAME     # a JSON written before "bench"

Each eval keeps its own `plot(result) -> Figure` beside the code that builds the result, so
one file owns a result's shape; the JSON names its eval in `"bench"`. This module holds
what they share: the figure's set-up (`figure`, `finish`), the saving, the JSON + PNG
writing (`write`) and the dispatch on `"bench"` (`render`). Figures are built on
matplotlib's Agg canvas directly (no pyplot): no global state, no display needed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from skippy.evals.entry import guarded

# Every eval that writes JSON, by module name: the value of its JSON's "bench" key.
BENCHES = ("bench_cache", "bench_cluster", "bench_cold_tier", "bench_constraint",
           "bench_gateway", "bench_mesh", "bench_runtime", "bench_speculation",
           "bench_stage_cache",
           "cache_exactness", "certify_matrix", "family_matrix", "format_accuracy",
           "giant_proof", "numerics", "robustness", "wire_accuracy")
DPI = 100
MIB = 2**20
OURS, REFERENCE = "tab:blue", "tab:orange"   # one colour per side in every figure
PASS, FAIL, SKIP = "#4caf50", "#e53935", "#bdbdbd"


class PlotError(Exception):
    """A JSON that cannot be drawn: unreadable, or no eval named for it."""


def figure(rows: int = 1, cols: int = 1, *, width: float = 6.4, height: float = 4.0,
           title: str | None = None):
    """(Figure, 2-D array of axes) of `rows` x `cols` panels, each `width` x `height` inches."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * cols, height * rows))
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig, axes


def finish(ax, *, title: str | None = None, xlabel: str | None = None,
           ylabel: str | None = None, legend: bool = True) -> None:
    """The common look of a panel: labels, a light grid, a small legend when it has one."""
    if title:
        ax.set_title(title, fontsize=10)
    if xlabel:
        ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if legend and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def bars(ax, labels: list[str], series: dict[str, list[float]], *, colors=None,
         rotate: bool = False) -> None:
    """Grouped bars: one group per label, one bar per series (name -> a value per label)."""
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(labels))]
        ax.bar(xs, values, width, label=name,
               color=None if colors is None else colors[i % len(colors)])
    ax.set_xticks(range(len(labels)), labels, rotation=30 if rotate else 0,
                  ha="right" if rotate else "center")


def log_y(ax) -> None:
    """A log y axis whose ticks read as plain numbers (12, 40, 300), not powers of ten."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def target_marks(ax, targets: list[tuple[int, int, float]], groups: int, series: int) -> None:
    """A short black line over bar (group, series) at its target: (group, series, target)
    triples, for bars drawn by `bars` with `groups` groups of `series` bars."""
    width = 0.8 / max(1, series)
    for n, (g, i, target) in enumerate(targets):
        x = g + (i - (series - 1) / 2) * width
        ax.hlines(target, x - width / 2, x + width / 2, color="black", linewidth=2,
                  label="target" if n == 0 else None)


def empty(ax, text: str) -> None:
    """A panel with nothing to show says why instead of drawing empty axes."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=9,
            wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])


def save(fig, png: str | Path) -> Path:
    png = Path(png)
    fig.tight_layout()
    fig.savefig(png, dpi=DPI)
    return png


def short(model: str, width: int = 22) -> str:
    """A model's file name as a label: no folder, no suffixes, at most `width` characters."""
    name = Path(model).name.split(".")[0]
    return name if len(name) <= width else name[:width - 1] + "~"


def png_for(json_path: str | Path) -> Path:
    """Where the figure of a JSON goes: the same path with a .png suffix."""
    return Path(json_path).with_suffix(".png")


def render(result: dict, png: str | Path, bench: str | None = None) -> Path:
    """Draw a result with its eval's `plot` (the eval `bench`, else the one its "bench" key
    names) into `png`."""
    name = bench or result.get("bench")
    if name not in BENCHES:
        raise PlotError(f"no eval named {name!r} (the JSON's \"bench\" key, or --bench): "
                        f"one of {', '.join(BENCHES)}")
    module = importlib.import_module(f"skippy.evals.{name}")
    return save(module.plot(result), png)


def write(result: dict, path: str | Path | None, bench: str, *, out=None) -> Path | None:
    """Name the eval in `result["bench"]`, then write the result as JSON to `path` and its
    figure next to it (returns the PNG's path); `path` "-" prints the JSON on `out`
    (stdout) and draws nothing; None writes nothing."""
    result["bench"] = bench
    if path is None:
        return None
    text = json.dumps(result, indent=2, default=str) + "\n"
    if str(path) == "-":
        (out or sys.stdout).write(text)
        return None
    Path(path).write_text(text)
    return render(result, png_for(path), bench)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m skippy.evals.plots",
                                description="Draw an eval's stored JSON again, as PNG.")
    p.add_argument("json", nargs="+", type=Path, help="a JSON an eval wrote with --json")
    p.add_argument("--bench", choices=BENCHES,
                   help="the eval that wrote it (default: the JSON's \"bench\" key)")
    args = p.parse_args(argv)
    for path in args.json:
        try:
            result = json.loads(path.read_text())
            if not isinstance(result, dict):
                raise PlotError("not an eval's JSON (an object with a \"bench\" key)")
            print(render(result, png_for(path), args.bench))
        except (OSError, ValueError, PlotError) as e:
            print(f"plots: {path}: {e}", file=sys.stderr)
            return 2
        except (KeyError, TypeError, IndexError) as e:  # a shape its eval no longer writes
            print(f"plots: {path}: not the shape {args.bench or result.get('bench')} "
                  f"writes ({type(e).__name__}: {e})", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))
