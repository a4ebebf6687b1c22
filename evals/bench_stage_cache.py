"""Warm cache hits: our cached stage vs llama.cpp's warm slot, same GGUF, one run.

    python -m skippy.evals.bench_stage_cache [--model smollm2 ...] [--repeats 5] [--json PATH]

Follows the reference's method (skippy-cache README, "Benchmark Evidence"): a 128-token
prefix, one generated token, one lane. Rows:
- exact repeat: the same 128-token prompt again (ours: the exact-result cache; llama.cpp:
  the prompt kept in its context, `create_completion` reuses it and re-runs the last token);
- changed tail: the cached 128-token prefix + a new 16-token tail (ours: restore the prefix,
  prefill one chunk; llama.cpp: the prefix is still in its context, only the tail is run).
Both sides time one request end to end (prompt ids in, one token id out), median of
--repeats after a warm-up, 2 threads each. Ours is the torch runtime in one stage.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from skippy.cache.config import CacheConfig
from skippy.evals.reference import _quiet_stderr
from skippy.mesh.pipeline import LocalPipeline

PREFIX, TAIL = 128, 16


def _ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def ours(path, prefix: list[int], tails: list[list[int]], repeats: int) -> dict:
    pipe = LocalPipeline(path, 1, wire_dtype="f16", n_ctx=1024,
                         cache=CacheConfig(admit_after=1))

    def one(ids):
        lanes = pipe.alloc()
        t = time.perf_counter()
        logits, _, _ = pipe.first_logits(lanes, ids)
        int(logits.argmax())
        dt = time.perf_counter() - t
        pipe.free(lanes)
        return dt

    cold = one(prefix)            # first sight: computes and records
    exact = [one(prefix) for _ in range(repeats)]
    pipe._idle.clear()                  # no warm lane: the hit must come from the cache
    tail = []
    for t in tails[:repeats]:
        tail.append(one(prefix + t))
        pipe._idle.clear()
    return {"cold_ms": cold * 1e3, "exact_repeat_ms": _ms(exact), "changed_tail_ms": _ms(tail)}


def llama(path, prefix: list[int], tails: list[list[int]], repeats: int) -> dict:
    import llama_cpp
    with _quiet_stderr():
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=1024, n_threads=2,
                              n_threads_batch=2, verbose=False)

    def one(ids):
        t = time.perf_counter()
        llm.create_completion(ids, max_tokens=1, temperature=0)
        return time.perf_counter() - t

    llm.reset()
    cold = one(prefix)
    exact = [one(prefix) for _ in range(repeats)]
    tail = []
    for t in tails[:repeats]:
        one(prefix)               # the slot holds the prefix again
        tail.append(one(prefix + t))
    return {"cold_ms": cold * 1e3, "exact_repeat_ms": _ms(exact), "changed_tail_ms": _ms(tail)}


def bench(path, repeats: int) -> dict:
    torch.set_num_threads(2)
    prefix = [(i * 7919) % 30000 + 100 for i in range(PREFIX)]
    tails = [[(r * 131 + j * 17) % 30000 + 100 for j in range(TAIL)] for r in range(repeats)]
    a, b = ours(path, prefix, tails, repeats), llama(path, prefix, tails, repeats)
    rows = {k: {"ours_ms": a[k], "llama_cpp_ms": b[k], "speedup": b[k] / a[k]}
            for k in ("cold_ms", "exact_repeat_ms", "changed_tail_ms")}
    return {"model": Path(path).name, "prefix_tokens": PREFIX, "tail_tokens": TAIL, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    from skippy.mesh.models import resolve_model
    p = argparse.ArgumentParser(prog="python -m skippy.evals.bench_stage_cache")
    p.add_argument("--model", action="append")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args(argv)
    results = []
    print(f"{'model':<36} {'row':<16} {'ours ms':>9} {'llama.cpp ms':>13} {'speedup':>8}")
    for name in args.model or ["smollm2"]:
        r = bench(resolve_model(name), args.repeats)
        results.append(r)
        for row, v in r["rows"].items():
            print(f"{r['model']:<36} {row[:-3]:<16} {v['ours_ms']:>9.2f} "
                  f"{v['llama_cpp_ms']:>13.2f} {v['speedup']:>7.2f}x", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
