"""The disk tier under eviction pressure: time to first token of conversations coming
back after the RAM cap pushed their state out, with the disk tier and without it.

    python -m skippy.evals.bench_cold_tier [--model smollm2 --model gemma3-270m]
                                           [--conversations 8] [--prefix 1024] [--json P]

One stage on an embedded Ray. Each conversation is a prefix of `--prefix` corpus tokens
(each its own) plus a new message of 32 tokens per turn; every conversation takes a turn,
then every one takes another, and so on (`--rounds`). The RAM cap holds `--ram-entries`
prefixes, so most conversations come back to find their state evicted: without the disk
tier they recompute it, with it they restore it from the node's disk (zstd) and promote
it back. Entries are admitted at first sight here (`admit_after` 1) so that the RAM cap,
not admission, decides. p50 and p95 TTFT of the returning turns (every round after the
first), per model, side by side; every returning answer's first token is checked equal
between the two runs. `--json P` writes P and P.png (TTFT p50 / p95 with and without
the disk tier; the disk tier's logical and physical bytes).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from skippy.cache.config import CacheConfig
from skippy.evals import plots
from skippy.mesh.control.engine import GenerationRequest
from skippy.mesh.control.ray_engine import RayEngine
from skippy.mesh.models import pull
from skippy.mesh.progress import Console, tracked
from skippy.mesh.tokenizer import Tokenizer
from skippy.topology.model_config import ModelConfig
from skippy.topology.model_package import open_model

from .bench_cluster import DEFAULT_DATA, corpus_ids
from skippy.evals.entry import guarded

MESSAGE = 32


def kv_bytes_per_token(path: Path) -> int:
    f = open_model(path)
    try:
        cfg = ModelConfig.from_gguf(f)
    finally:
        f.close()
    return cfg.n_layers * cfg.n_kv_heads * (cfg.head_dim + cfg.v_head_dim) * 4


def p95(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))]


def run_model(path: Path, args, cold: bool) -> dict:
    tok = Tokenizer(path)
    per_token = kv_bytes_per_token(path)
    cache = replace(CacheConfig(), admit_after=1,
                    max_bytes=int(args.ram_entries * (args.prefix + 64) * per_token),
                    cold_max_bytes=CacheConfig().cold_max_bytes if cold else 0)
    n_ctx = args.prefix + args.rounds * (MESSAGE + 8) + 128
    ids = corpus_ids(tok, args.data, args.conversations * (args.prefix + args.rounds * MESSAGE))
    step = args.prefix + args.rounds * MESSAGE
    convs = [ids[i * step:(i + 1) * step] for i in range(args.conversations)]
    engine = RayEngine(path, 1, n_ctx=n_ctx, cache=cache, weight_format=args.weight_format)

    async def turns():
        back, firsts = [], []
        for r in range(args.rounds):
            for c in convs:
                prompt = c[:args.prefix] + c[args.prefix + r * MESSAGE:
                                             args.prefix + (r + 1) * MESSAGE]
                t = time.perf_counter()
                async for s in engine.generate(GenerationRequest(tuple(prompt), 1)):
                    if r:
                        back.append(time.perf_counter() - t)
                        firsts.append(s.token)
                    break
        return back, firsts
    try:
        back, firsts = asyncio.run(turns())
        stats = engine.stats()["stages"][0]
    finally:
        asyncio.run(engine.close())
    return {"cold": cold, "p50_s": statistics.median(back), "p95_s": p95(back),
            "ttft_s": back, "first_tokens": firsts,
            "ram_evictions": stats["prefix"]["counters"]["evictions"],
            "disk_hits": stats.get("cold", {}).get("counters", {}).get("hits", 0),
            "disk_bytes": stats.get("cold_blocks", {}).get("node_physical_bytes", 0),
            "disk_logical_bytes": stats.get("cold_blocks", {}).get("logical_bytes", 0)}


def line(row: dict) -> str:
    """One model's figures, as the command prints them."""
    off, on = row["off"], row["on"]
    return (f"{row['model']}: returning TTFT p50 {off['p50_s']:.3f} -> {on['p50_s']:.3f} s, "
            f"p95 {off['p95_s']:.3f} -> {on['p95_s']:.3f} s with the disk tier "
            f"({on['disk_hits']} disk hits, {off['ram_evictions']} RAM evictions, "
            f"{on['disk_bytes'] / 2**20:.1f} MiB on disk for "
            f"{on['disk_logical_bytes'] / 2**20:.1f} MiB of state)")


def plot(result: dict):
    """Returning conversations' TTFT p50 / p95, RAM only vs RAM + disk tier, per model
    (left); the state the disk tier held, logical vs physical (zstd) bytes (right)."""
    rows = result["rows"]
    fig, ((ttft, disk),) = plots.figure(1, 2, title=(
        f"{result['conversations']} conversations of {result['prefix']}-token prefixes, "
        f"RAM for {result['ram_entries']}"))
    labels = [plots.short(r["model"]) for r in rows]
    plots.bars(ttft, labels, {f"{name} {q}": [r[side][f"{q}_s"] for r in rows]
                              for side, name in (("off", "RAM only"), ("on", "RAM + disk"))
                              for q in ("p50", "p95")},
               colors=["tab:red", "salmon", "tab:green", "lightgreen"])
    plots.finish(ttft, title="returning conversations", ylabel="TTFT (s)")
    plots.bars(disk, [f"{m}\n{r['on']['disk_hits']} disk hits" for m, r in zip(labels, rows)], {
        "logical (state)": [r["on"]["disk_logical_bytes"] / plots.MIB for r in rows],
        "physical (on disk)": [r["on"]["disk_bytes"] / plots.MIB for r in rows]})
    plots.finish(disk, title="disk tier: bytes held", ylabel="MiB")
    return fig


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m skippy.evals.bench_cold_tier",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", help="model name or GGUF (repeatable)")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--prefix", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--ram-entries", type=int, default=2)
    p.add_argument("--weight-format", default="fp32")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    rows, say = [], Console(sys.stdout)  # lines that keep clear of the bar on stderr
    for name in tracked(args.model or ["smollm2", "gemma3-270m"], "bench_cold_tier", "model"):
        path = Path(name) if Path(name).is_file() else pull(name)
        off, on = run_model(path, args, cold=False), run_model(path, args, cold=True)
        if off["first_tokens"] != on["first_tokens"]:
            raise SystemExit(f"{path.name}: the disk tier changed an answer")
        rows.append({"model": path.stem, "prefix": args.prefix, "off": off, "on": on})
        say(line(rows[-1]))
    plots.write({"conversations": args.conversations, "prefix": args.prefix,
                 "rounds": args.rounds, "ram_entries": args.ram_entries,
                 "weight_format": args.weight_format, "rows": rows}, args.json,
                "bench_cold_tier")
    return rows


if __name__ == "__main__":
    guarded(main)
