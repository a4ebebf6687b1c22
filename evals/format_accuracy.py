"""What each weight format costs in numbers: its logits against the fp32 computation of
the same file's weights, at every position of the last 256 tokens of the first 2 prompts
of each use case: the first half of each window computed by prefill chunks, the second
half by teacher-forced decode steps (formats may use other kernels for the two).

    python -m skippy.evals.format_accuracy [--model smollm2 --model gemma3-270m]
        [--file q4_0] [--weight-format bf16 --weight-format int4] [--json PATH]

--file picks the GGUF the runtimes load (llama.cpp requantization: q4_0 by default, the
file the runtime benchmark times; `none` for the shipped file). A format passes when its
top-1 agreement with fp32 is at least BAR; the fastest passing format is the serving
default (stages/runtime.py DEFAULT_WEIGHT_FORMAT). `--json P` also draws P.png: top-1
agreement per format (prefill and decode rows) against the bar, and the cosine distance.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

from skippy.evals import plots
from skippy.evals.numerics import (DEFAULT_DATA, WINDOW, cosine, prompt_ids, read_corpus,
                                   whole_model)
from skippy.evals.reference import LlamaCppReference
from skippy.stages.linear import WEIGHT_FORMATS
from skippy.evals.entry import guarded

# llama.cpp's own Q4_0 arithmetic (rows quantized to 8 bits per block of 32, as ours)
# agrees with the fp32 computation at 97.1 % (SmolLM2) and 97.4 % (Gemma 3): `python -m
# skippy.evals.numerics --format q4_0`. A format passes at llama.cpp's level.
BAR = 0.97


def all_logits(rt, ids: list[int]) -> np.ndarray:
    lane = rt.alloc_lane()
    try:
        with torch.no_grad():
            return rt.prefill(lane, torch.tensor(ids), logits="all").logits.numpy()
    finally:
        rt.free_lane(lane)


def served_logits(rt, ids: list[int], prefill: int) -> tuple[np.ndarray, int]:
    """Logits at every position the way serving computes them: the first `prefill` rows
    by a prefill (whole chunks), the rest by teacher-forced decode steps, one token each
    (a format may use other kernels for decode rows than for prefill chunks).
    Returns (logits, rows computed by prefill)."""
    prefill = min(prefill, len(ids))
    lane = rt.alloc_lane()
    try:
        with torch.no_grad():
            rows = [rt.prefill(lane, torch.tensor(ids[:prefill]), logits="all").logits]
            for tok in ids[prefill:]:
                rows.append(rt.decode([(lane, torch.tensor(tok))])[0].logits[None])
        return torch.cat(rows).numpy(), prefill
    finally:
        rt.free_lane(lane)


def compare_format(path, fmt: str, prompts: list[list[int]], reference,
                   prefill: int = WINDOW // 2) -> dict:
    """Top-1 agreement and cosine of `fmt`'s logits against fp32 prefill logits over every
    position: the first `prefill` positions from prefill chunks, the rest from decode."""
    rt = whole_model(path, weight_format=fmt)
    agree = [0, 0]  # prefill rows, decode rows
    total = [0, 0]
    cosines = []
    for ids in prompts:
        want = all_logits(reference, ids)
        got, n_pre = served_logits(rt, ids, prefill)
        same = got.argmax(-1) == want.argmax(-1)
        agree[0] += int(same[:n_pre].sum())
        agree[1] += int(same[n_pre:].sum())
        total[0] += n_pre
        total[1] += len(ids) - n_pre
        cosines.append(cosine(got.astype(np.float64), want.astype(np.float64)))
    cos = np.concatenate(cosines)
    top1 = sum(agree) / sum(total)
    return {"format": fmt, "positions": sum(total), "top1": top1,
            "top1_prefill_rows": agree[0] / max(total[0], 1),
            "top1_decode_rows": agree[1] / max(total[1], 1),
            "min_cosine": float(cos.min()), "mean_cosine": float(cos.mean()),
            "passes": top1 >= BAR}


def line(r: dict) -> str:
    """One model x format's row of the printed table."""
    return (f"{r['model']:<40} {r['format']:<6} {r['positions']:>9} {r['top1']:>8.2%} "
            f"{r['top1_prefill_rows']:>8.2%} {r['top1_decode_rows']:>8.2%} "
            f"{r['min_cosine']:>10.6f} {r['mean_cosine']:>10.6f}  "
            f"{'pass' if r['passes'] else 'FAIL'}")


def plot(result: dict):
    """Top-1 agreement with fp32 per weight format and model, prefill rows and decode rows
    apart, against the bar (left); the lowest cosine of a position's logits (right)."""
    runs = result["results"]
    fig, ((top1, cos),) = plots.figure(1, 2, title=(
        f"weight formats vs fp32 on the same file ("
        f"{'as shipped' if result['file'] == 'none' else result['file']})"))
    labels = [f"{plots.short(r['model'])}\n{r['format']}" for r in runs]
    plots.bars(top1, labels, {"all": [100 * r["top1"] for r in runs],
                              "prefill rows": [100 * r["top1_prefill_rows"] for r in runs],
                              "decode rows": [100 * r["top1_decode_rows"] for r in runs]},
               rotate=len(runs) > 4)
    top1.axhline(100 * BAR, color="black", linestyle="--", linewidth=1,
                 label=f"bar {BAR:.0%}")
    top1.set_ylim(min([100 * BAR - 2] + [100 * r["top1_decode_rows"] - 1 for r in runs]), 100)
    plots.finish(top1, title="top-1 agreement with fp32", ylabel="%")
    plots.bars(cos, labels, {"1 - min cosine": [1 - r["min_cosine"] for r in runs],
                             "1 - mean cosine": [1 - r["mean_cosine"] for r in runs]},
               rotate=len(runs) > 4)
    cos.set_yscale("log")
    plots.finish(cos, title="logits' distance from fp32 (lower is closer)", ylabel="log")
    return fig


def main(argv: list[str] | None = None) -> list[dict]:
    from skippy.mesh.models import requantize, resolve_model

    p = argparse.ArgumentParser(prog="python -m skippy.evals.format_accuracy")
    p.add_argument("--model", action="append", help="name or .gguf (repeatable)")
    p.add_argument("--file", default="q4_0", help="requantize to this first (q4_0, q8_0, "
                   "f16) or 'none' for the file as shipped")
    p.add_argument("--weight-format", action="append", dest="formats",
                   choices=[f for f in WEIGHT_FORMATS if f != "fp32"],
                   help="format to measure against fp32 (repeatable; default all)")
    p.add_argument("--data", default=str(DEFAULT_DATA))
    p.add_argument("--json", help="also write the results to this path (and a plot: the "
                   "path with .png)")
    args = p.parse_args(argv)
    records = read_corpus(args.data, per_use_case=2)
    formats = args.formats or [f for f in WEIGHT_FORMATS if f != "fp32"]
    results = []
    print(f"{'model':<40} {'format':<6} {'positions':>9} {'top-1':>8} {'prefill':>8} "
          f"{'decode':>8} {'min cos':>10} {'mean cos':>10}  bar {BAR:.0%}", flush=True)
    for name in args.model or ["smollm2", "gemma3-270m"]:
        path = resolve_model(name)
        if args.file != "none":
            path = requantize(path, args.file)
        ref = LlamaCppReference(path)
        prompts = [prompt_ids(ref, r) for r in records]
        ref.llm.close()
        reference = whole_model(path, weight_format="fp32")
        for fmt in formats:
            r = {"model": Path(path).name, **compare_format(path, fmt, prompts, reference)}
            results.append(r)
            print(line(r), flush=True)
        reference = None
    plots.write({"file": args.file, "bar": BAR, "results": results}, args.json,
                "format_accuracy")
    return results


if __name__ == "__main__":
    guarded(main, sys.argv[1:])
