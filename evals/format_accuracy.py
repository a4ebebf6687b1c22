"""What each weight format costs in numbers: its logits against the fp32 computation of
the same file's weights, at every position of the last 256 tokens of the first 2 prompts
of each use case.

    python -m skippy.evals.format_accuracy [--model smollm2 --model gemma3-270m]
        [--file q4_0] [--weight-format bf16 --weight-format int4] [--json PATH]

--file picks the GGUF the runtimes load (llama.cpp requantization: q4_0 by default, the
file the runtime benchmark times; `none` for the shipped file). A format passes when its
top-1 agreement with fp32 is at least BAR; the fastest passing format is the serving
default (stages/runtime.py DEFAULT_WEIGHT_FORMAT).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from skippy.evals.numerics import DEFAULT_DATA, cosine, prompt_ids, read_corpus, whole_model
from skippy.evals.reference import LlamaCppReference
from skippy.stages.linear import WEIGHT_FORMATS

BAR = 0.99


def all_logits(rt, ids: list[int]) -> np.ndarray:
    lane = rt.alloc_lane()
    try:
        with torch.no_grad():
            return rt.prefill(lane, torch.tensor(ids), logits="all").logits.numpy()
    finally:
        rt.free_lane(lane)


def compare_format(path, fmt: str, prompts: list[list[int]], reference) -> dict:
    """Top-1 agreement and cosine of `fmt`'s logits against fp32 over every position."""
    rt = whole_model(path, weight_format=fmt)
    agree = total = 0
    cosines = []
    for ids in prompts:
        want = all_logits(reference, ids)
        got = all_logits(rt, ids)
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        total += len(ids)
        cosines.append(cosine(got.astype(np.float64), want.astype(np.float64)))
    cos = np.concatenate(cosines)
    return {"format": fmt, "positions": total, "top1": agree / total,
            "min_cosine": float(cos.min()), "mean_cosine": float(cos.mean()),
            "passes": agree / total >= BAR}


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
    p.add_argument("--json", help="also write the results to this path")
    args = p.parse_args(argv)
    records = read_corpus(args.data, per_use_case=2)
    formats = args.formats or [f for f in WEIGHT_FORMATS if f != "fp32"]
    results = []
    print(f"{'model':<40} {'format':<6} {'positions':>9} {'top-1':>8} {'min cos':>10} "
          f"{'mean cos':>10}  bar {BAR:.0%}", flush=True)
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
            print(f"{r['model']:<40} {fmt:<6} {r['positions']:>9} {r['top1']:>8.2%} "
                  f"{r['min_cosine']:>10.6f} {r['mean_cosine']:>10.6f}  "
                  f"{'pass' if r['passes'] else 'FAIL'}", flush=True)
        reference = None
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
