"""The specification's family table, reproduced on our files: every family we run.

    python -m skippy.evals.family_matrix [--family NAME ...] [--repeats 5]
        [--servers q4_0|q8_0] [--no-certify]
        [--json PATH] [--markdown PATH]        (PATH with .png: its plot, next to the JSON)

`--servers FMT` measures server to server, as the specification's table does: `skippy
serve` over HTTP against `python -m llama_cpp.server` on the family's file requantized to
FMT (evals/family_servers.py: a warm hit, changed tails of 16 and 64 tokens after a
512-token prefix, the next chat turn, and for hybrids a 1,024-token prompt diverging at
token 1,000). Without it, the rows below are measured in process.

Per family: the payload its cache stores (ResidentKv: attention KV; KvRecurrent: KV with
the recurrent state), `skippy certify` at 2 stages in fp32 and int4 (pass/fail), then the
warm-cache rows of evals/bench_stage_cache.py (the reference's method: a 128-token prefix,
one generated token, one lane, the same GGUF on both sides, 2 threads each) on our torch
stage against llama.cpp's warm slot — exact_repeat (the same prompt again) and
changed_tail (the prefix with a new 16-token tail) — and the bytes of the prefix's state
as the cache holds it (measured: the exported state's tensors).

The shipped models are real (smollm2, gemma3-270m); every other row is a synthetic file
the family registry names (topology/families.py, SynthCase) written by stages.synth at a
shape big enough that compute, not call overhead, is what is timed (BASE, with the case's
`bench` sizes and its knobs), kept under `model_home()/synth` so reruns are free. Every
timed answer of ours is checked against an uncached one (bench_stage_cache raises when a
next token differs).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from skippy.evals import plots
from skippy.evals.bench_stage_cache import PREFIX, TAIL, Family, Shape, bench
from skippy.mesh.progress import Console, tracked
from skippy.stages.certify import certify
from skippy.topology.families import synth_cases
from skippy.evals.entry import guarded

CERTIFY_FORMATS = ("fp32", "int4")
ROWS = ("exact_repeat", "changed_tail")


@dataclass(frozen=True)
class Entry:
    family: Family
    label: str                 # the family as the specification's table names it


# The bench shape of every synthetic row (a case's `bench` changes some sizes).
BASE = dict(layers=8, hidden=512, heads=8, kv_heads=4, ff=1536, dtype="f16", seed=1)
SHIPPED = {"smollm2": "Llama (SmolLM2-135M)", "gemma3-270m": "Gemma3 (270M)"}


def matrix() -> dict[str, Entry]:
    """Every row: the shipped models, then each synthetic file the registry names (asked
    when called, so a family registered later is listed)."""
    out = {name: Entry(Family(name, "dense", model=name), label)
           for name, label in SHIPPED.items()}
    for fam, case in synth_cases():
        kind = "hybrid" if fam.cache_policy == "KvRecurrent" else "dense"
        shape = Shape(fam.name, **{**BASE, **dict(case.bench)}, settings=case.settings)
        out[case.name] = Entry(Family(fam.name, kind, shape=shape), case.label)
    return out


def cache_bytes(path: Path, prefix: int = PREFIX) -> int:
    """Bytes of a `prefix`-token state as the cache holds it: the whole model's exported
    lane state (KV of every attention layer, plus recurrent state)."""
    from skippy.evals.numerics import whole_model
    rt = whole_model(path, weight_format="int4")
    lane = rt.alloc_lane()
    ids = torch.tensor([(i * 7919) % 30000 + 100 for i in range(prefix)])
    rt.prefill(lane, ids, logits="none")
    return rt.export_state(lane, prefix).nbytes


def run_family(name: str, repeats: int, say=print, *, servers: str | None = None,
               certify_formats: tuple[str, ...] = CERTIFY_FORMATS) -> dict:
    """One family's row of the table: certify in `certify_formats`, then the warm rows in
    process (bench_stage_cache), or with `servers` (a llama.cpp format, q4_0 or q8_0)
    server to server (family_servers)."""
    entry = matrix()[name]
    fam = entry.family
    path = fam.path()
    checks = {}
    for fmt in certify_formats:
        t = time.perf_counter()
        checks[fmt] = certify(path, 2, weight_format=fmt).passed
        say(f"{name}: certify 2 stages {fmt}: {'PASS' if checks[fmt] else 'FAIL'} "
            f"({time.perf_counter() - t:.0f} s)")
    if servers is not None:
        from skippy.evals.family_servers import serve_family
        from skippy.mesh.models import requantize
        served = requantize(path, servers)
        result = serve_family(served, servers, repeats=repeats, hybrid=fam.kind == "hybrid",
                              say=say)
        return {"family": name, "label": entry.label, "file": str(served),
                "shape": fam.describe(),
                "payload": "KvRecurrent" if fam.kind == "hybrid" else "ResidentKv",
                "certify": checks, "cache_bytes": cache_bytes(path), "servers": servers,
                "rows": result["rows"]}
    result = bench(fam, repeats=repeats, runtimes=("torch",), say=say)
    rows = {r["row"]: r for r in result["rows"] if r["row"] in ROWS}
    return {"family": name, "label": entry.label, "file": str(path),
            "shape": result["shape_text"],
            "payload": "KvRecurrent" if fam.kind == "hybrid" else "ResidentKv",
            "certify": checks, "cache_bytes": cache_bytes(path),
            "rows": {k: {"prefix_tokens": r["prefix_tokens"],
                         "request_tokens": r["prefix_tokens"] + r["tail_tokens"],
                         "llama_cpp_ms": r["llama_cpp_ms"], "ours_ms": r["ours_ms"],
                         "speedup": r["speedup"], "bitwise": r["ours"]["logits_bitwise"]}
                     for k, r in rows.items()}}


def _bytes(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def markdown(families: list[dict]) -> str:
    lines = ["| family | payload | certify (2 stages fp32 / int4) | row | prefix tokens | "
             "request tokens | llama.cpp ms | ours ms | speedup | cache bytes |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for f in families:
        cert = " / ".join({True: "pass", False: "FAIL", None: "-"}[f["certify"].get(k)]
                          for k in CERTIFY_FORMATS)
        for row, r in f["rows"].items():
            lines.append(f"| {f['label']} | `{f['payload']}` | {cert} | {row} | "
                         f"{r['prefix_tokens']} | {r['request_tokens']} | "
                         f"{r['llama_cpp_ms']:.1f} | {r['ours_ms']:.1f} | "
                         f"**{r['speedup']:.2f}x** | {_bytes(f['cache_bytes'])} |")
    return "\n".join(lines)


def plot(result: dict):
    """The warm-cache speedup per family, one bar per row (left; a family whose certify
    failed is marked FAIL under its name), and the bytes of its prefix's state (right)."""
    families = result["families"]
    names = [f["label"] + ("" if all(f["certify"].values()) else "\n(certify FAIL)")
             for f in families]
    fig, ((speed, size),) = plots.figure(1, 2, width=max(6.0, 0.6 * len(names)), height=4.5)
    rows = list(dict.fromkeys(row for f in families for row in f["rows"]))
    plots.bars(speed, names, {row.replace("_", " "): [f["rows"].get(row, {}).get("speedup", 0)
                                                     for f in families] for row in rows},
               rotate=True)
    speed.axhline(1.0, color="black", linewidth=0.8)
    plots.finish(speed, ylabel="llama.cpp ms / ours ms (warm cache)",
                 title=f"Warm-cache speedup per family ({PREFIX}-token prefix, {TAIL}-token "
                       "tail)")
    for payload, color in (("ResidentKv", "tab:cyan"), ("KvRecurrent", "tab:purple")):
        mine = [i for i, f in enumerate(families) if f["payload"] == payload]
        size.bar(mine, [families[i]["cache_bytes"] / 2**20 for i in mine], color=color,
                 label=payload)
    size.set_xticks(range(len(names)), names, rotation=30, ha="right")
    plots.finish(size, ylabel="MiB", title=f"state of a {PREFIX}-token prefix as cached")
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m skippy.evals.family_matrix")
    p.add_argument("--family", action="append", choices=sorted(matrix()),
                   help="repeatable; default: every family")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--servers", choices=("q4_0", "q8_0"),
                   help="compare server to server (skippy serve against llama_cpp.server) "
                        "on the file requantized to this format, ours holding it as int4 "
                        "or int8 (evals/family_servers.py)")
    p.add_argument("--no-certify", action="store_true", help="skip the certify columns")
    p.add_argument("--json", help="write the results to PATH (and its plot: PATH with .png)")
    p.add_argument("--markdown", help="write the markdown table to PATH")
    args = p.parse_args(argv)
    say = Console()  # on stderr; a bar of the families done on a terminal
    started = time.perf_counter()
    formats = () if args.no_certify else CERTIFY_FORMATS
    families = [run_family(name, args.repeats, say, servers=args.servers,
                           certify_formats=formats)
                for name in tracked(args.family or list(matrix()), "family_matrix", "family")]
    table = markdown(families)
    print(table)
    for f in families:
        say(f"{f['label']}: {f['shape']}")
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    plots.write({"families": families, "repeats": args.repeats, "servers": args.servers,
                 "seconds": time.perf_counter() - started}, args.json, "family_matrix")
    ok = all(all(f["certify"].values()) for f in families)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(guarded(main))
