"""Is the q8 wire accurate enough to offer? Logits with a lossy wire vs the f32 wire.

    python -m skippy.evals.wire_accuracy [--model smollm2] [--stages 2] [--wire q8]
        [--data ../shared/data/usecases.jsonl] [--per-use-case 2] [--cap 256] [--json PATH]

Every prompt (chat-templated, first --cap tokens) is prefilled through an N-stage
pipeline once with the f32 wire (exact: bitwise the unsplit model) and once with each
--wire dtype, with logits at every position. Reported: top-1 agreement over all
positions, and the lowest and mean cosine of a position's logits. A wire dtype is
accepted when its top-1 agreement is at least 99 %. `--json P` also draws P.png: top-1
agreement per use case and each prompt's lowest cosine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from skippy.evals import plots
from skippy.evals.cache_exactness import prompt_ids
from skippy.evals.numerics import DEFAULT_DATA, cosine, read_corpus
from skippy.stages.chain import StageChain
from skippy.evals.entry import guarded

ACCEPT_TOP1 = 0.99


def all_logits(pipe: StageChain, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] logits, one row per prompt position."""
    lanes = pipe.alloc()
    try:
        return pipe.prefill(lanes, ids, logits="all")
    finally:
        pipe.free(lanes)


def compare_wire(path, prompts: list[list[int]], wire: str = "q8", stages: int = 2) -> dict:
    """Top-1 agreement and cosine of `wire` against the f32 wire over every position."""
    n_ctx = max(len(p) for p in prompts) + 64
    exact = StageChain(path, stages, wire_dtype="f32", n_ctx=n_ctx)
    lossy = StageChain(path, stages, wire_dtype=wire, n_ctx=n_ctx)
    per_prompt = []
    for ids in prompts:
        want, got = all_logits(exact, ids), all_logits(lossy, ids)
        cos = cosine(want.double().numpy(), got.double().numpy())
        per_prompt.append({"tokens": len(ids),
                           "top1_agree": int((want.argmax(-1) == got.argmax(-1)).sum()),
                           "min_cosine": float(cos.min()), "sum_cosine": float(cos.sum())})
    positions = sum(p["tokens"] for p in per_prompt)
    top1 = sum(p["top1_agree"] for p in per_prompt) / positions
    return {"model": Path(path).name, "stages": stages, "wire": wire,
            "prompts": len(prompts), "positions": positions, "top1": top1,
            "min_cosine": min(p["min_cosine"] for p in per_prompt),
            "mean_cosine": sum(p["sum_cosine"] for p in per_prompt) / positions,
            "accepted": top1 >= ACCEPT_TOP1, "per_prompt": per_prompt}


def line(r: dict) -> str:
    """One wire's figures and verdict, as the command prints them."""
    verdict = "ACCEPTED" if r["accepted"] else "NOT accepted"
    return (f"{r['model']} x{r['stages']} {r['wire']} vs f32 wire: {r['prompts']} prompts, "
            f"{r['positions']} positions: top-1 agreement {100 * r['top1']:.2f} %, "
            f"min cosine {r['min_cosine']:.6f}, mean cosine {r['mean_cosine']:.6f}\n"
            f"{r['wire']}: {verdict} (needs top-1 agreement >= {100 * ACCEPT_TOP1:.0f} %)")


def plot(result: dict):
    """Top-1 agreement with the f32 wire per use case, one bar per lossy wire, the overall
    figure and the acceptance bar as lines (left); each prompt's lowest cosine (right)."""
    runs = result["results"]
    fig, ((top1, cos),) = plots.figure(1, 2, title=(
        f"lossy wire vs f32 wire: {plots.short(runs[0]['model'])} x{runs[0]['stages']}, "
        f"{runs[0]['prompts']} prompts"))
    cases = list(dict.fromkeys(p.get("use_case", "?") for r in runs for p in r["per_prompt"]))

    def agree(r: dict, case: str) -> float:
        mine = [p for p in r["per_prompt"] if p.get("use_case", "?") == case]
        return 100 * sum(p["top1_agree"] for p in mine) / max(1, sum(p["tokens"] for p in mine))
    series = {r["wire"]: [agree(r, c) for c in cases] for r in runs}
    plots.bars(top1, cases, series, rotate=True)
    top1.set_ylim(min([100 * ACCEPT_TOP1 - 1] + [v - 1 for vs in series.values() for v in vs]),
                  100.2)
    for k, r in enumerate(runs):
        top1.axhline(100 * r["top1"], color=f"C{k}", linestyle=":", linewidth=1,
                     label=f"{r['wire']} overall {100 * r['top1']:.2f} %")
    top1.axhline(100 * ACCEPT_TOP1, color="black", linestyle="--", linewidth=1,
                 label=f"accepted at {100 * ACCEPT_TOP1:.0f} %")
    plots.finish(top1, title="top-1 agreement per use case", ylabel="%")
    for k, r in enumerate(runs):
        cos.plot(range(1, len(r["per_prompt"]) + 1),
                 [1 - p["min_cosine"] for p in r["per_prompt"]], "o", color=f"C{k}",
                 label=r["wire"])
    cos.set_yscale("log")
    plots.finish(cos, title="1 - the lowest cosine of a position's logits", xlabel="prompt",
                 ylabel="log")
    return fig


def main(argv: list[str] | None = None) -> int:
    from skippy.mesh.models import resolve_model
    from skippy.mesh.tokenizer import Tokenizer

    p = argparse.ArgumentParser(prog="python -m skippy.evals.wire_accuracy")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--wire", action="append", help="lossy wire dtype(s) to check (q8)")
    p.add_argument("--data", default=str(DEFAULT_DATA))
    p.add_argument("--per-use-case", type=int, default=2)
    p.add_argument("--cap", type=int, default=256)
    p.add_argument("--json")
    args = p.parse_args(argv)
    try:
        records = read_corpus(args.data, args.per_use_case)
    except FileNotFoundError:
        print(f"corpus not found: {args.data}", file=sys.stderr)
        return 2
    path = resolve_model(args.model)
    tok = Tokenizer(path)
    prompts = [prompt_ids(tok, path, r, args.cap) for r in records]
    results = []
    for wire in args.wire or ["q8"]:
        r = compare_wire(path, prompts, wire, args.stages)
        for row, rec in zip(r["per_prompt"], records):
            row.update(id=rec["id"], use_case=rec["use_case"])
        results.append(r)
        print(line(r), flush=True)
    plots.write({"cap": args.cap, "results": results}, args.json, "wire_accuracy")
    return 0 if all(r["accepted"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(guarded(main))
