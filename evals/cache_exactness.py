"""Cache on vs cache off on real prompts: identical tokens, bitwise-equal first logits.

    python -m skippy.evals.cache_exactness [--model smollm2 ...] [--stages 1 --stages 2]
        [--runtime torch|llama.cpp] [--data ../shared/data/usecases.jsonl]
        [--per-use-case N] [--cap 512] [--json PATH]

Prompts are rendered with the model's chat template (plain concatenation where it has
none), capped at --cap tokens (their first tokens, so the shared stems stay shared), and
sent one after another through a cached pipeline and an uncached one; each must give
the same 8 greedy tokens and bitwise the same first-token logits. Records of one use
case share long stems, so later prompts hit what earlier ones recorded. `--json P` also
draws P.png: the share of prompt tokens the cache served per use case, the time with the
cache on and off, and the block store's logical vs physical bytes per stage.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from skippy.cache.config import CacheConfig
from skippy.evals import plots
from skippy.evals.numerics import first_of_each_use_case
from skippy.mesh.control.local import InProcessEngine
from skippy.evals.entry import guarded

STEPS = 8
DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "usecases.jsonl"


def prompt_ids(tokenizer, path, record: dict, cap: int) -> list[int]:
    from skippy.mesh.front.chat import ChatTemplateMissing, render_chat
    from skippy.topology.errors import RequestError
    try:
        text = render_chat(path, record["messages"])
    except (ChatTemplateMissing, RequestError):  # no template, or it refuses the turns
        text = "".join(m["content"] for m in record["messages"])
    return tokenizer.encode(text)[:cap]


def run_one(engine: InProcessEngine, ids: list[int]):
    """(first logits, greedy tokens, prompt tokens reused) of one request on the served
    path."""
    steps = engine.complete(ids, STEPS, logits=True)
    return steps[0].logits, [s.token for s in steps], steps[0].cached_tokens


def cache_pair(path, stages: int, config: CacheConfig, **options):
    """The same split with its caches off and on."""
    off = InProcessEngine(path, stages, cache=dataclasses.replace(config, enabled=False),
                          **options)
    return off, InProcessEngine(path, stages, cache=config, **options)


def compare(path, records: list[dict], stages: int, cap: int = 512,
            config: CacheConfig | None = None, runtime: str = "torch") -> dict:
    from skippy.stages.runtime_kind import runtime_kind
    from skippy.mesh.tokenizer import Tokenizer
    tok = Tokenizer(path)
    config = config or CacheConfig()
    off, on = cache_pair(path, stages, config, wire_dtype="f16", n_ctx=cap + 64,
                         runtime=runtime_kind(runtime))
    rows, t_on, t_off = [], 0.0, 0.0
    for r in records:
        ids = prompt_ids(tok, path, r, cap)
        t = time.perf_counter()
        want_logits, want_tokens, _ = run_one(off, ids)
        t_off += time.perf_counter() - t
        t = time.perf_counter()
        got_logits, got_tokens, reused = run_one(on, ids)
        t_on += time.perf_counter() - t
        rows.append({"id": r["id"], "use_case": r["use_case"], "tokens": len(ids),
                     "reused": reused, "same_tokens": got_tokens == want_tokens,
                     "bitwise_logits": bool(torch.equal(got_logits, want_logits))})
    exact = all(x["same_tokens"] and x["bitwise_logits"] for x in rows)
    return {"model": Path(path).name, "stages": stages, "runtime": runtime,
            "prompts": len(rows), "exact": exact,
            "reused_tokens": sum(x["reused"] for x in rows),
            "prompt_tokens": sum(x["tokens"] for x in rows),
            "seconds_cache_on": t_on, "seconds_cache_off": t_off,
            "cache": on.stats()["stages"], "rows": rows}


def line(r: dict) -> str:
    """One model x split's figures, as the command prints them."""
    return (f"{r['model']} x{r['stages']} {r['runtime']}: {r['prompts']} prompts, "
            f"exact={r['exact']}, reused {r['reused_tokens']}/{r['prompt_tokens']} prompt "
            f"tokens, cache on {r['seconds_cache_on']:.1f} s vs off "
            f"{r['seconds_cache_off']:.1f} s")


def plot(result: dict):
    """Per use case, the prompt tokens the cache served (left; a red x marks a use case
    with an answer that differed); cache on vs off seconds (middle); the block store's
    logical and physical bytes per stage (right); one series per model x split."""
    runs = result["results"]
    fig, ((reuse, secs, store),) = plots.figure(1, 3, width=5.0, title=(
        f"cache on vs off: {sum(r['prompts'] for r in runs)} prompts ({result['runtime']}, "
        f"first {result['cap']} tokens each), "
        f"{'every answer exact' if all(r['exact'] for r in runs) else 'NOT all exact'}"))
    names = [f"{plots.short(r['model'])} x{r['stages']}" for r in runs]
    cases = list(dict.fromkeys(x["use_case"] for r in runs for x in r["rows"]))

    def share(r: dict, case: str) -> float:
        mine = [x for x in r["rows"] if x["use_case"] == case]
        return sum(x["reused"] for x in mine) / max(1, sum(x["tokens"] for x in mine))
    plots.bars(reuse, cases, {n: [100 * share(r, c) for c in cases]
                              for n, r in zip(names, runs)}, rotate=True)
    for r in runs:
        bad = [cases.index(x["use_case"]) for x in r["rows"]
               if not (x["same_tokens"] and x["bitwise_logits"])]
        reuse.scatter(bad, [0] * len(bad), marker="x", color=plots.FAIL, s=60, zorder=3)
    reuse.set_ylim(0, 100)
    plots.finish(reuse, title="prompt tokens served by the cache", ylabel="% of prompt tokens")
    plots.bars(secs, names, {"cache off": [r["seconds_cache_off"] for r in runs],
                             "cache on": [r["seconds_cache_on"] for r in runs]},
               colors=[plots.REFERENCE, plots.OURS], rotate=True)
    plots.finish(secs, title="time for every prompt", ylabel="s")
    stages = [(f"{n}\nstage {i}", s) for n, r in zip(names, runs)
              for i, s in enumerate(r["cache"])]
    plots.bars(store, [k for k, _ in stages], {
        "resident (RAM entries)": [s.get("resident_bytes", 0) / plots.MIB for _, s in stages],
        "block store, logical": [(s.get("blocks") or {}).get("logical_bytes", 0) / plots.MIB
                                 for _, s in stages],
        "block store, physical": [(s.get("blocks") or {}).get("physical_bytes", 0) / plots.MIB
                                  for _, s in stages]}, rotate=len(stages) > 2)
    plots.finish(store, title="what each stage's cache holds at the end", ylabel="MiB")
    return fig


def main(argv: list[str] | None = None) -> int:
    from skippy.mesh.models import resolve_model

    p = argparse.ArgumentParser(prog="python -m skippy.evals.cache_exactness")
    p.add_argument("--model", action="append")
    p.add_argument("--stages", type=int, action="append")
    from skippy.stages.runtime_kind import RUNTIMES
    p.add_argument("--runtime", choices=tuple(RUNTIMES), default="torch",
                   help="stage runtime (llama.cpp: one stage)")
    p.add_argument("--data", default=str(DEFAULT_DATA))
    p.add_argument("--per-use-case", type=int, default=1000)
    p.add_argument("--cap", type=int, default=512)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if not Path(args.data).exists():
        print(f"corpus not found: {args.data}", file=sys.stderr)
        return 2
    records = [json.loads(l) for l in Path(args.data).read_text().splitlines() if l.strip()]
    records = first_of_each_use_case(records, args.per_use_case)
    results, ok = [], True
    for name in args.model or ["smollm2"]:
        for stages in args.stages or [1, 2]:
            r = compare(resolve_model(name), records, stages, args.cap, runtime=args.runtime)
            results.append(r)
            ok &= r["exact"]
            print(line(r), flush=True)
    plots.write({"runtime": args.runtime, "cap": args.cap, "results": results}, args.json,
                "cache_exactness")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(guarded(main))
