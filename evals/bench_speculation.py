"""Speculative decoding through a pipeline whose hops cost time: ms per token with it on
and off, what the measured acceptance and step costs predict, and the answers compared.

The model's stages run in this process (mesh/control/local.py), `--stages` of them,
each stage-to-stage message delayed `--hop-ms` one way (a network between hosts: with 3
stages, a token's way down and back crosses 4 such delays). Greedy answers of
`--tokens` new tokens to corpus records of `--use-case` (chat template applied), one at a
time, first with speculation off, then on; every answer must be the same tokens. Times
run from an answer's first token to its last (the decode steps; the prompt's prefill,
which speculation leaves alone, is not in them).

The prediction: a step costs its stages' compute, the hops, and a fixed part (sessions,
links, the driver: measured in the run without speculation, as its wall time less its
compute and hops per step); speculation divides the steps by the tokens each step emits.
From the run with speculation on, predicted ms/token = (the stages' decode seconds per
step + 2 x hop x (stages - 1) + the fixed part) / tokens per step, set beside the measured
ms/token (the issue asks them within 1.1x of each other).

    python -m skippy.evals.bench_speculation --hop-ms 0 --hop-ms 10 --json spec.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from skippy.cache.config import CacheConfig
from skippy.evals import plots
from skippy.mesh.control.engine import GenerationRequest
from skippy.mesh.control.local import InProcessEngine
from skippy.mesh.models import resolve_model
from skippy.mesh.tokenizer import Tokenizer
from skippy.evals.entry import guarded

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "usecases.jsonl"
USE_CASES = ("code_refinement", "issue_fixing", "open_chat")


def prompts(path: Path, data: Path, use_cases, per_case: int) -> list[tuple[str, tuple]]:
    """(use case, prompt ids) of the first `per_case` records of each use case."""
    from skippy.mesh.front.chat import encode_chat, load_chat_template
    tok = Tokenizer(path)
    template = load_chat_template(tok)
    out, seen = [], {u: 0 for u in use_cases}
    for line in data.read_text().splitlines():
        r = json.loads(line)
        u = r["use_case"]
        if u in seen and seen[u] < per_case:
            seen[u] += 1
            out.append((u, tuple(encode_chat(template, tok, r["messages"]))))
    return out


def decode_figures(engine: InProcessEngine) -> tuple[float, int]:
    """The stages' decode seconds summed, and the last stage's decode steps."""
    stats = [s.stats() for s in engine.servers]
    return sum(s["seconds"]["decode"] for s in stats), stats[-1]["steps"]["decode"]


def run(engine: InProcessEngine, work, tokens: int, speculate: bool) -> dict:
    rows, answers = [], []
    for use_case, prompt in work:
        seconds0, steps0 = decode_figures(engine)
        spec0 = dict(engine.servers[-1].speculation)
        out, wall = _timed(engine, prompt, tokens, speculate)
        seconds1, steps1 = decode_figures(engine)
        spec1 = engine.servers[-1].speculation
        answers.append([s.token for s in out])
        rows.append({"use_case": use_case, "tokens": len(out) - 1, "wall_s": wall,
                     "ms_per_token": wall / (len(out) - 1) * 1e3, "steps": steps1 - steps0,
                     "decode_s": seconds1 - seconds0,
                     **{k: spec1[k] - spec0[k] for k in spec1}})
    return {"rows": rows, "answers": answers}


def _timed(engine: InProcessEngine, prompt, tokens: int, speculate: bool):
    """The answer's steps, and the seconds from its first token to its last: the decode
    steps alone (the prompt's prefill, which speculation does not touch, left out)."""
    request = GenerationRequest(tuple(prompt), tokens, speculate=speculate)

    async def go():
        out, first = [], None
        async for step in engine.generate(request):
            out.append(step)
            first = first or time.perf_counter()
        return out, time.perf_counter() - first
    return asyncio.run(go())


def overhead(rows: list[dict], hop_s: float, stages: int) -> float:
    """Seconds a step costs beyond its stages' compute and its hops (the sessions, the
    links, the driver), from a run without speculation: one token a step."""
    steps = sum(r["steps"] for r in rows)
    hops = 2 * hop_s * (stages - 1) * steps
    return (sum(r["wall_s"] for r in rows) - sum(r["decode_s"] for r in rows) - hops) / steps


def predicted(rows: list[dict], hop_s: float, stages: int, fixed_s: float) -> float:
    """ms/token from the run's own step costs and acceptance (see the docstring)."""
    steps = sum(r["steps"] for r in rows)
    toks = sum(r["tokens"] for r in rows)
    per_step = sum(r["decode_s"] for r in rows) / steps + 2 * hop_s * (stages - 1) + fixed_s
    return per_step / (toks / steps) * 1e3


def summary(hop_ms: float, use_case: str, off: list[dict], on: list[dict]) -> dict:
    """One (hop, use case) row: medians of ms/token off and on, acceptance, tokens a step."""
    a = [r for r in off if r["use_case"] == use_case]
    b = [r for r in on if r["use_case"] == use_case]
    return {"hop_ms": hop_ms, "use_case": use_case,
            "off_ms": statistics.median(r["ms_per_token"] for r in a),
            "on_ms": statistics.median(r["ms_per_token"] for r in b),
            "accepted": sum(r["accepted_tokens"] for r in b) / max(
                1, sum(r["proposed_tokens"] for r in b)),
            "tokens_per_step": sum(r["tokens"] for r in b) / max(1, sum(r["steps"]
                                                                        for r in b))}


def line(r: dict) -> str:
    return (f"hop {r['hop_ms']:g} ms  {r['use_case']:<16} off {r['off_ms']:6.1f} ms/token  "
            f"on {r['on_ms']:6.1f}  ({r['off_ms'] / r['on_ms']:.2f}x; {r['accepted']:.0%} of "
            f"proposals accepted, {r['tokens_per_step']:.2f} tokens a step)")


def plot(result: dict):
    """ms/token with speculation off and on, per use case, at each hop delay (left);
    measured against predicted ms/token with speculation, per hop delay (right)."""
    fig, ((bars, pred),) = plots.figure(1, 2, title=(
        f"speculation through {result['stages']} stages ({result['model']}, "
        f"{result['tokens']} greedy tokens)"))
    rows = result["results"]
    labels = [f"{r['use_case'].split('_')[0]}\n{r['hop_ms']:g} ms" for r in rows]
    plots.bars(bars, labels, {"off": [r["off_ms"] for r in rows],
                              "on": [r["on_ms"] for r in rows]},
               colors=[plots.REFERENCE, plots.OURS])
    plots.finish(bars, title="ms per token", ylabel="ms")
    runs = result["runs"]
    plots.bars(pred, [f"hop {r['hop_ms']:g} ms" for r in runs],
               {"measured": [r["measured_ms"] for r in runs],
                "predicted": [r["predicted_ms"] for r in runs]})
    plots.finish(pred, title="with speculation: measured vs predicted", ylabel="ms/token")
    return fig


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m skippy.evals.bench_speculation")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--hop-ms", type=float, action="append", dest="hops",
                   help="one-way delay per stage-to-stage message (again for more; "
                        "default 0 and 10)")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--records", type=int, default=2, help="records per use case")
    p.add_argument("--use-case", action="append", dest="use_cases")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--json", help="also write the result as JSON here (and its figure)")
    args = p.parse_args(argv)
    path = resolve_model(args.model)
    work = prompts(path, args.data, args.use_cases or USE_CASES, args.records)
    result = {"model": args.model, "stages": args.stages, "tokens": args.tokens,
              "runs": [], "results": []}
    for hop_ms in args.hops or [0.0, 10.0]:
        result["runs"].append(_one(path, args, work, hop_ms))
        entry = result["runs"][-1]
        print(f"hop {hop_ms:g} ms, {args.stages} stages, answers the same: {entry['same']}")
        for use_case in dict.fromkeys(u for u, _ in work):
            result["results"].append(summary(hop_ms, use_case, entry["off"], entry["on"]))
            print("  " + line(result["results"][-1]))
        print(f"  all, on: measured {entry['measured_ms']:.1f} ms/token, predicted "
              f"{entry['predicted_ms']:.1f} ({entry['measured_ms'] / entry['predicted_ms']:.2f}x"
              f"; a step's cost beyond compute and hops: {entry['overhead_ms']:.1f} ms)")
    plots.write(result, args.json, "bench_speculation")
    return result


def _one(path: Path, args, work, hop_ms: float) -> dict:
    """Speculation off, then on, at one hop delay: both runs and their comparison."""
    engine = InProcessEngine(path, args.stages, weight_format="int4", n_ctx=4096,
                             cache=CacheConfig(enabled=False), hop_s=hop_ms / 1e3)
    try:
        off = run(engine, work, args.tokens, False)
        on = run(engine, work, args.tokens, True)
    finally:
        engine._stop()
    entry = {"hop_ms": hop_ms, "off": off["rows"], "on": on["rows"],
             "same": off["answers"] == on["answers"],
             "overhead_ms": overhead(off["rows"], hop_ms / 1e3, args.stages) * 1e3,
             "measured_ms": sum(r["wall_s"] for r in on["rows"]) / sum(
                 r["tokens"] for r in on["rows"]) * 1e3}
    entry["predicted_ms"] = predicted(on["rows"], hop_ms / 1e3, args.stages,
                                      entry["overhead_ms"] / 1e3)
    return entry


if __name__ == "__main__":
    guarded(main)
