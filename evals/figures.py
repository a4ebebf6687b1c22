"""The README's figures, made by the evals themselves: each eval runs at its full size with
`--json evals/out/<eval>.json`, which also draws `evals/out/<eval>.png`, and that plot is
copied to `evals/figures/<eval>.png`, where README.md embeds it.

    make figures                                       # all, one after another
    python -m skippy.evals.figures bench_cache bench_cluster     # some of them
    python -m skippy.evals.figures --list              # each command, its time, what it shows

The evals time things: run them on an otherwise idle machine, one at a time (this command
never runs two at once). Those that start Ray or servers run in a loopback-only network
namespace where one can be had (DESIGN.md §9), as `make test` does.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from skippy.evals.entry import guarded

EVALS = Path(__file__).resolve().parent
OUT, FIGURES = EVALS / "out", EVALS / "figures"


@dataclass(frozen=True)
class Figure:
    args: tuple[str, ...]   # the eval's arguments, before --json
    minutes: int            # about how long it takes on 2 idle cores
    shows: str
    loopback: bool = False  # starts Ray or servers: run it in a loopback-only namespace


FIGURES_BY_EVAL = {
    "bench_runtime": Figure(
        ("--model", "smollm2", "--model", "gemma3-270m", "--tokens", "128,512,1024,2048,4096",
         "--repeats", "3"), 10,
        "latency vs prompt length, ours vs llama.cpp on the same Q4_0 file; decode steps"),
    "family_matrix": Figure(
        ("--servers", "q4_0", "--no-certify", "--repeats", "9"), 12,
        "warm-hit speedup per family, skippy serve against llama_cpp.server; state bytes",
        loopback=True),
    "bench_gateway": Figure(
        ("--clients", "1,2,4,8"), 35,
        "speedup per scenario and per corpus use case; tokens/s vs concurrent clients",
        loopback=True),
    "bench_cluster": Figure(
        (), 8,
        "TTFT local / remote hit / recompute by length; state bytes per node, logical vs "
        "physical; TTFT around a killed stage", loopback=True),
    "bench_cold_tier": Figure(
        (), 6, "TTFT of returning conversations with and without the disk tier; its bytes",
        loopback=True),
    "bench_speculation": Figure(
        (), 3, "ms/token with speculation off and on through 3 stages, hops of 0 and 10 "
        "ms; measured against predicted"),
    "bench_cache": Figure(
        (), 1, "prefix-cache matching and lookup cost by entries and by shared prefix"),
}


def command(name: str, out: Path) -> list[str]:
    """The eval's command line; in a loopback-only namespace where it needs one and one can
    be had."""
    fig = FIGURES_BY_EVAL[name]
    cmd = [sys.executable, "-m", f"skippy.evals.{name}", *fig.args, "--json", str(out)]
    if fig.loopback and subprocess.run(["unshare", "-n", "true"],
                                       capture_output=True).returncode == 0:
        return ["unshare", "-n", "bash", "-c", 'ip link set lo up; exec "$@"', "_", *cmd]
    return cmd


def make(name: str) -> Path:
    """Run one eval into evals/out and copy its plot to evals/figures."""
    OUT.mkdir(exist_ok=True)
    FIGURES.mkdir(exist_ok=True)
    out = OUT / f"{name}.json"
    t = time.monotonic()
    # an embedded Ray on loopback needs no token (as in make test)
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    done = subprocess.run(command(name, out), env=env)
    png = out.with_suffix(".png")
    if not png.is_file():  # an eval that found a fault may still have drawn its figures
        raise SystemExit(f"figures: {name} exited {done.returncode} and drew no {png}")
    shutil.copyfile(png, FIGURES / png.name)
    print(f"figures: {FIGURES / png.name} ({name}, {time.monotonic() - t:.0f} s, exit "
          f"{done.returncode})", flush=True)
    return FIGURES / png.name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m skippy.evals.figures",
                                description="Run the evals whose plots the README shows.")
    p.add_argument("evals", nargs="*", metavar="EVAL",
                   help=f"some of: {', '.join(FIGURES_BY_EVAL)} (default: all)")
    p.add_argument("--list", action="store_true", help="print each command and exit")
    args = p.parse_args(argv)
    unknown = [n for n in args.evals if n not in FIGURES_BY_EVAL]
    if unknown:
        p.error(f"no figure of {', '.join(unknown)}: one of {', '.join(FIGURES_BY_EVAL)}")
    names = args.evals or list(FIGURES_BY_EVAL)
    if args.list:
        for name in names:
            fig = FIGURES_BY_EVAL[name]
            print(f"{name} (~{fig.minutes} min): {fig.shows}\n    "
                  f"{shlex.join(command(name, OUT / f'{name}.json'))}")
        return 0
    for name in names:
        make(name)
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))
