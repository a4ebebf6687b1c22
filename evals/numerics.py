"""Our torch stages against llama.cpp: logits at every position, on the same GGUF.

    python -m skippy.evals.numerics [--model smollm2 --model gemma3-270m] [--format f16]
        [--data ../shared/data/usecases.jsonl] [--json PATH]

For each model: requantize to --format (F16 by default: with Q8_0 llama.cpp also
quantizes activations), take the last 256 tokens of the first 2 prompts of each use case,
and compare logits at every position: top-1 agreement and the final-position cosine.
Then decode a few greedy steps and compare them with a full recompute (not bitwise:
decode rows run at another shape than prefill rows). `--json P` also draws P.png.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from skippy.evals import plots
from skippy.evals.reference import LlamaCppReference
from skippy.evals.routing_margins import RoutingMargins
from skippy.stages.runtime import StageSpec
from skippy.stages.torch_runtime import TorchStageRuntime
from skippy.topology.gguf_file import GGUFFile
from skippy.topology.model_config import ModelConfig
from skippy.evals.entry import guarded

WINDOW = 256
DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "usecases.jsonl"


def whole_model(path, **spec) -> TorchStageRuntime:
    n = ModelConfig.from_gguf(GGUFFile(path)).n_layers
    return TorchStageRuntime(StageSpec(str(path), 0, n, n_ctx=1024, **spec))


def first_of_each_use_case(records: list[dict], n: int = 2) -> list[dict]:
    seen: dict[str, int] = {}
    out = []
    for r in records:
        if seen.get(r["use_case"], 0) < n:
            seen[r["use_case"]] = seen.get(r["use_case"], 0) + 1
            out.append(r)
    return out


def read_corpus(path, per_use_case: int | None = None) -> list[dict]:
    """The corpus records (JSON lines); only the first `per_use_case` of each use case when
    given. FileNotFoundError where the corpus is absent."""
    records = [json.loads(l) for l in Path(path).read_text().splitlines() if l.strip()]
    return records if per_use_case is None else first_of_each_use_case(records, per_use_case)


def prompt_ids(ref: LlamaCppReference, record: dict, window: int = WINDOW) -> list[int]:
    """The last `window` tokens of the prompt's text (BOS kept first where the model adds one)."""
    text = "".join(m["content"] for m in record["messages"])
    ids = ref.llm.tokenize(text.encode(), add_bos=True, special=True)
    bos = ref.llm.token_bos()
    if ids and ids[0] == bos:
        return [bos] + ids[1:][-(window - 1):]
    return ids[-window:]


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def compare_on_corpus(path, records: list[dict], window: int = WINDOW) -> dict:
    """Every position's logits of each record's last `window` prompt tokens, ours against
    llama.cpp's."""
    ref = LlamaCppReference(path)
    rt = whole_model(path)
    agree = total = 0
    final_cos, max_delta = [], 0.0
    for record in records:
        ids = prompt_ids(ref, record, window)
        expected = ref.logits(ids)
        lane = rt.alloc_lane()
        got = rt.prefill(lane, torch.tensor(ids), logits="all").logits.numpy()
        rt.free_lane(lane)
        agree += int((got.argmax(-1) == expected.argmax(-1)).sum())
        total += len(ids)
        final_cos.append(float(cosine(got[-1], expected[-1])))
        max_delta = max(max_delta, float(np.abs(got - expected).max()))
    return {"model": Path(path).name, "prompts": len(records), "positions": total,
            "top1": agree / total, "min_final_cosine": min(final_cos),
            "max_abs_delta": max_delta}


def margin_agreement(rt, ref: LlamaCppReference, prompts: list[list[int]],
                     margin: float = 1e-3) -> dict:
    """The f32 bar for synthetic families: max |Δlogit| over every position, and whether
    top-1 agrees wherever llama.cpp's top-2 margin exceeds `margin` (elsewhere summation
    order alone may flip a near-tie)."""
    worst, checked, decided, agree = 0.0, 0, 0, True
    for ids in prompts:
        expected = ref.logits(ids)
        lane = rt.alloc_lane()
        got = rt.prefill(lane, torch.tensor(ids), logits="all").logits.numpy()
        rt.free_lane(lane)
        worst = max(worst, float(np.abs(got - expected).max()))
        n, ok = _clear_top1(got, expected, margin)
        agree &= ok
        checked += len(ids)
        decided += n
    return {"max_abs_delta": worst, "positions": checked, "decided": decided,
            "top1_where_clear": agree}


def _clear_top1(got: np.ndarray, expected: np.ndarray, margin: float) -> tuple[int, bool]:
    """(rows whose llama.cpp top-2 margin exceeds `margin`, top-1 agrees on all of them)."""
    clear, same = _top1_rows(got, expected, margin)
    return int(clear.sum()), bool(same[clear].all())


def top2_margins(rows: np.ndarray) -> np.ndarray:
    """Per row of logits: its largest value less its second largest (torch's topk: a
    vocabulary-wide sort of every row takes ten times as long)."""
    top2 = torch.from_numpy(np.ascontiguousarray(rows)).topk(2, dim=-1).values.numpy()
    return top2[:, 0] - top2[:, 1]


def _top1_rows(got: np.ndarray, expected: np.ndarray,
               margin: float) -> tuple[np.ndarray, np.ndarray]:
    """Per row: whether llama.cpp's top-2 margin exceeds `margin`, whether top-1 agrees."""
    return top2_margins(expected) > margin, got.argmax(-1) == expected.argmax(-1)


def family_agreement(path, n_prompts: int = 2, length: int = 320, steps: int = 16,
                     margin: float = 1e-3, seed: int = 0, tolerance: float = 1e-3,
                     near_tie: float = 1e-3, **spec) -> dict:
    """A synthetic family's f32 file against llama.cpp: `n_prompts` prompts of `length`
    token ids (random but fixed by `seed`; random weights have no language to follow),
    every prompt row teacher-forced, then `steps` decode steps fed llama.cpp's own greedy
    tokens. Top-1 must agree wherever llama.cpp's top-2 margin exceeds `margin`
    (elsewhere summation order alone may flip a near-tie); max |Δlogit| over all rows.
    Expert choices that are near-ties in our run are teacher-forced too, as
    `teacher_forced` says; `flipped` lists them (prompt, row, layer, margin)."""
    rt = whole_model(path, **spec)
    ref = LlamaCppReference(path, n_ctx=length + steps + 16)
    rng = np.random.default_rng(seed)
    worst, rows, decided, agree, flipped = 0.0, 0, 0, True, []
    with RoutingMargins(rt) as routing:
        for p in range(n_prompts):
            ids = [int(i) for i in rng.integers(100, min(rt.cfg.vocab, 40000), length)]
            expected = ref.logits(ids)
            forced = ref.greedy_logits(ids, steps)
            tokens = [int(r.argmax()) for r in forced[:-1]]
            expected = np.concatenate([expected, forced[1:]])
            got, flips = teacher_forced(rt, routing, ids, tokens, expected, margin,
                                        tolerance, near_tie)
            worst = max(worst, float(np.abs(got - expected).max()))
            n, ok = _clear_top1(got, expected, margin)
            rows, decided, agree = rows + len(got), decided + n, agree and ok
            flipped += [(p, *f) for f in flips]
    return {"max_abs_delta": worst, "positions": rows, "decided": decided,
            "top1_where_clear": agree, "flipped": flipped}


def forced_rows(rt, ids: list[int], tokens: list[int]) -> np.ndarray:
    """Our logits at every row of the prompt `ids`, then after a decode step fed each of
    `tokens`: [len(ids) + len(tokens), vocab]."""
    lane = rt.alloc_lane()
    got = [rt.prefill(lane, torch.tensor(ids), logits="all").logits]
    got += [rt.decode([(lane, torch.tensor(t))])[0].logits[None] for t in tokens]
    rt.free_lane(lane)
    return torch.cat(got).numpy()


def teacher_forced(rt, routing: RoutingMargins, ids: list[int], tokens: list[int],
                   expected: np.ndarray, margin: float = 1e-3, tolerance: float = 1e-3,
                   near_tie: float = 1e-3, max_flips: int = 8):
    """Our logits for the prompt `ids` then a decode step per token of `tokens`, against
    `expected` (one row each), and the near-ties that had to go the other way: [(row,
    layer, margin)]. A near-tie (Routing.margin under `near_tie` in our run) may break the
    other way in llama.cpp, and then that row and the rows attending to it leave it by
    whole units: where the first row off the bar (|Δ| over `tolerance`, or top-1 differs
    where clear) has one, the prompt is run again with its smallest-margin choice made
    the other way, and every row is held to the bar again. A row off the bar whose every
    choice is clear is a disagreement: its logits are returned as they are."""
    flips: dict[tuple[int, int], float] = {}
    while True:
        routing.start(set(flips))
        got = forced_rows(rt, ids, tokens)
        clear, same = _top1_rows(got, expected, margin)
        off = np.flatnonzero((np.abs(got - expected).max(-1) > tolerance) | (clear & ~same))
        if not len(off) or len(flips) >= max_flips:
            break
        row, m = int(off[0]), routing.margins(len(got))
        ties = [(float(m[b, row]), b) for b in range(len(m))
                if m[b, row] < near_tie and (b, row) not in flips]
        if not ties:
            break
        tie, b = min(ties)
        flips[(b, row)] = tie
    return got, [(row, routing.layers[b], tie) for (b, row), tie in flips.items()]


def greedy_logits(rt, lane: int, logits: torch.Tensor, steps: int) -> torch.Tensor:
    """`logits` (after a prefill), then the logits after each of `steps` greedy decode
    steps on the lane: [steps + 1, vocab]."""
    out = [logits]
    for _ in range(steps):
        out.append(rt.decode([(lane, torch.tensor(int(out[-1].argmax())))])[0].logits)
    return torch.stack(out)


def split_logits(path, n_stages: int, ids: list[int], wire: str = "f32",
                 steps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """(prefill logits at every position, logits of `steps` greedy decode steps) of the
    model cut into `n_stages` stages: the same at any split with the f32 wire."""
    from skippy.stages.chain import StageChain
    pipe = StageChain(path, n_stages, wire_dtype=wire, n_ctx=512)
    lanes = pipe.alloc()
    all_logits = pipe.prefill(lanes, ids, logits="all")
    decoded, token = [], int(all_logits[-1].argmax())
    for _ in range(steps):
        decoded.append(pipe.decode(lanes, token))
        token = int(decoded[-1].argmax())
    return all_logits, torch.stack(decoded)


def decode_vs_recompute(path, ids: list[int], steps: int = 8) -> dict:
    rt = whole_model(path)
    lane = rt.alloc_lane()
    logits = rt.prefill(lane, torch.tensor(ids)).logits
    tokens, decoded = [], []
    for _ in range(steps):
        tokens.append(int(logits.argmax()))
        logits = rt.decode([(lane, torch.tensor(tokens[-1]))])[0].logits
        decoded.append(logits)
    full = rt.alloc_lane()
    recomputed = rt.prefill(full, torch.tensor(ids + tokens), logits="all").logits[len(ids):]
    decoded = torch.stack(decoded)
    return {"steps": steps, "max_abs_delta": float((decoded - recomputed).abs().max()),
            "top1": float((decoded.argmax(-1) == recomputed.argmax(-1)).float().mean())}


def line(r: dict) -> str:
    """One model's figures, as the command prints them."""
    d = r["decode_vs_recompute"]
    return (f"{r['model']}: top-1 {r['top1']:.4f} over {r['positions']} positions, "
            f"min final cosine {r['min_final_cosine']:.7f}, max |dlogit| "
            f"{r['max_abs_delta']:.3g}; decode vs recompute ({d['steps']} steps): "
            f"max |d| {d['max_abs_delta']:.3g}, top-1 {d['top1']:.3f}")


def plot(result: dict):
    """Per model, top-1 agreement with llama.cpp at every position and of decode against a
    full recompute (left); the largest |logit difference| of each, and 1 - the lowest
    final-position cosine (right)."""
    runs = result["results"]
    fig, ((top1, delta),) = plots.figure(1, 2, title=(
        f"our torch stages vs llama.cpp on the same file ("
        f"{'as shipped' if result['format'] == 'none' else result['format']})"))
    labels = [plots.short(r["model"]) for r in runs]
    plots.bars(top1, labels, {
        "prefill, every position": [100 * r["top1"] for r in runs],
        "decode vs recompute": [100 * r["decode_vs_recompute"]["top1"] for r in runs]})
    top1.set_ylim(min([99.0] + [100 * r["top1"] - 0.5 for r in runs]), 100.05)
    plots.finish(top1, title="top-1 agreement", ylabel="%")
    plots.bars(delta, labels, {
        "max |dlogit| vs llama.cpp": [r["max_abs_delta"] for r in runs],
        "max |dlogit| decode vs recompute": [r["decode_vs_recompute"]["max_abs_delta"]
                                             for r in runs],
        "1 - min final cosine": [max(1 - r["min_final_cosine"], 1e-12) for r in runs]})
    delta.set_yscale("log")
    plots.finish(delta, title="how far apart (log)")
    return fig


def main(argv: list[str] | None = None) -> int:
    from skippy.mesh.models import requantize, resolve_model

    p = argparse.ArgumentParser(prog="python -m skippy.evals.numerics")
    p.add_argument("--model", action="append", help="name or .gguf (repeatable)")
    p.add_argument("--format", default="f16", help="requantize to this first: f16, q8_0, q4_0, none")
    p.add_argument("--data", default=str(DEFAULT_DATA))
    p.add_argument("--json", help="also write the results to this path")
    args = p.parse_args(argv)
    if not Path(args.data).exists():
        print(f"corpus not found: {args.data}", file=sys.stderr)
        return 2
    records = [json.loads(l) for l in Path(args.data).read_text().splitlines() if l.strip()]
    chosen = first_of_each_use_case(records)
    results = []
    for name in args.model or ["smollm2", "gemma3-270m"]:
        path = resolve_model(name)
        if args.format != "none":
            path = requantize(path, args.format)
        r = compare_on_corpus(path, chosen)
        ids = prompt_ids(LlamaCppReference(path), chosen[0], 128)
        r["decode_vs_recompute"] = decode_vs_recompute(path, ids)
        results.append(r)
        print(line(r), flush=True)
    plots.write({"format": args.format, "results": results}, args.json, "numerics")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))
