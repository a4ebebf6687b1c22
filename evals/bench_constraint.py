"""Constrained decoding: llguidance vs xgrammar on our vocabularies, against a decode step.

    python -m skippy.evals.bench_constraint [--schemas 10] [--steps 64] [--scaling]
                                            [--conformance 50] [--json PATH|-]
    python -m skippy.evals.bench_constraint --plot PATH.json     # its PNG again

For each grammar engine and vocabulary (SmolLM2's 49k tokens, Gemma 3's 262k, both read
from the GGUF by llama.cpp as the stages read it; with --scaling also Gemma's first 16k,
32k, 65k and 131k tokens):

- tokenizer_s: building the engine's view of the vocabulary, once per model.
- compile_ms: compiling one JSON schema (a fresh engine cache each time, so a repeated
  schema costs the same as a new one), median over --schemas generated schemas
  (evals/json_schemas.py: nested objects, enums, arrays, numbers, bounded lengths).
- mask_us / apply_us: per token, computing the next-token mask and applying it to a
  float32 logits row (-inf where forbidden), median and p95 over every step of every
  schema. The tokens are what a greedy pick of seeded random logits under the mask gives
  (the same rows for both engines), at most --steps per schema: the mask is computed on
  states a real constrained reply passes through, strings and numbers included.
  llguidance's row is our serving path (mesh/token_mask.py TokenMask: mask, apply,
  advance); xgrammar's is its own bitmask fill and apply_token_bitmask_inplace.

The same run times one decode step of SmolLM2 (one stage, serve's weight format, the
median of 32 steps) and prints each engine's per-token cost (mask + apply + advance) on
SmolLM2's vocabulary as a share of that step: the issue's target is under 10 %.

--conformance N runs N generated schemas through the real gateway (SmolLM2, greedy,
max_tokens 256, one in-process stage) and counts the replies that finish with "stop" and
validate against their schema (jsonschema): the issue asks for at least 48 of 50.
tests/test_constraint.py runs the first few of the same schemas in CI.

--json writes everything as JSON, and a PNG of per-token cost against vocabulary size
next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

import torch

from skippy.evals import plots
from skippy.evals.json_schemas import schemas as generated_schemas
from skippy.evals.entry import guarded

MODELS = {"smollm2": "smollm2", "gemma3": "gemma3-270m"}
SCALING = (16384, 32768, 65536, 131072)  # prefixes of Gemma's vocabulary
SEPARATORS = (", ", ": ")  # mesh/constraint.py JSON_OPTIONS, the same output on both
TARGET = 0.10  # mask cost / decode step, SmolLM2 (the issue)


class Vocab:
    """One model's tokens as bytes (llama.cpp's pieces, specials spelled out), its
    end-of-generation ids, and llama.cpp's vocabulary (for llguidance's tokenizer)."""

    def __init__(self, spec: str, size: int | None = None):
        from skippy.mesh.tokenizer import Tokenizer
        from skippy.mesh.models import resolve_model
        self.tokenizer = Tokenizer(resolve_model(spec))
        n = self.tokenizer.vocab_size
        self.size = min(size or n, n)
        self.full = self.size == n
        self.pieces = [self.tokenizer.piece(i, special=True) for i in range(self.size)]
        self.ends = sorted(i for i in self.tokenizer.eog_ids if i < self.size)


# -- the engines: each fills the same bitmask layout; the apply is ours for both ------------
class Llguidance:
    """What the stages run (mesh/token_mask.py)."""
    name = "llguidance"

    def __init__(self, vocab: Vocab):
        t = time.perf_counter()
        if vocab.full:  # as the stages build it
            from llguidance.llamacpp import lltokenizer_from_vocab
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                self.tok = lltokenizer_from_vocab(vocab.tokenizer.llama_vocab,
                                                  eos_token=vocab.ends)
        else:
            self.tok = _llg_prefix_tokenizer(vocab)
        self.tokenizer_s = time.perf_counter() - t

    def compile(self, schema: dict):
        import llguidance
        from skippy.mesh.constraint import json_schema
        return llguidance.LLMatcher(self.tok, json_schema(schema).grammar(), log_level=0)

    def fill(self, m, words: torch.Tensor) -> None:
        m.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)

    def advance(self, m, token: int) -> None:
        if not m.consume_token(token):
            raise AssertionError(f"llguidance refused token {token} its own mask allowed")

    def done(self, m) -> bool:
        return m.is_stopped()


def _llg_prefix_tokenizer(vocab: Vocab):
    """llguidance's tokenizer over the first vocab.size tokens (the scaling rows)."""
    import llguidance
    from llguidance import TokenizerWrapper
    ids = {p: i for i, p in enumerate(vocab.pieces) if p}

    class Prefix:
        eos_token_id, bos_token_id = vocab.ends[0] if vocab.ends else 0, None
        tokens = vocab.pieces

        def __call__(self, text):  # greedy longest match: only hints use it
            data, out, i = text if isinstance(text, bytes) else text.encode(), [], 0
            while i < len(data):
                for j in range(min(len(data), i + 16), i, -1):
                    if data[i:j] in ids:
                        out.append(ids[data[i:j]])
                        i = j
                        break
                else:
                    i += 1
            return out
    return llguidance.LLTokenizer(TokenizerWrapper(Prefix()), eos_token=vocab.ends or None)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, vocab: Vocab):
        import xgrammar as xgr
        self.xgr = xgr
        t = time.perf_counter()
        info = xgr.TokenizerInfo(vocab.pieces, xgr.VocabType.RAW, vocab_size=vocab.size,
                                 stop_token_ids=vocab.ends or None)
        # no cache: every schema compiles as a new one would
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.tokenizer_s = time.perf_counter() - t

    def compile(self, schema: dict):
        grammar = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                    separators=SEPARATORS)
        return self.xgr.GrammarMatcher(grammar)

    def fill(self, m, words: torch.Tensor) -> None:
        m.fill_next_token_bitmask(words.view(1, -1))

    def advance(self, m, token: int) -> None:
        if not m.accept_token(token):
            raise AssertionError(f"xgrammar refused token {token} its own mask allowed")

    def done(self, m) -> bool:
        return m.is_terminated()


ENGINES = {"llguidance": Llguidance, "xgrammar": Xgrammar}


# -- measuring --------------------------------------------------------------------------------
class Clock:
    """Wall and this thread's CPU seconds per named part: on a shared machine the wall time
    of a short call is mostly other processes' turn; its CPU time is its own cost."""

    def __init__(self, *parts: str):
        self.wall = {p: [] for p in parts}
        self.cpu = {p: [] for p in parts}
        self._t = self._c = 0.0

    def start(self) -> None:
        self._t, self._c = time.perf_counter(), time.thread_time()

    def none(self, part: str) -> None:
        self.wall[part].append(0.0)
        self.cpu[part].append(0.0)

    def lap(self, part: str) -> None:
        t, c = time.perf_counter(), time.thread_time()
        self.wall[part].append(t - self._t)
        self.cpu[part].append(c - self._c)
        self._t, self._c = t, c


def walk(engine, vocab: Vocab, schema: dict, seed: int, steps: int, clock: Clock) -> int:
    """One reply: a greedy pick of seeded random logits under the mask, step by step;
    returns the tokens taken."""
    from skippy.mesh.token_mask import masked, unpack
    m = engine.compile(schema)
    words = torch.zeros((vocab.size + 31) // 32, dtype=torch.int32)
    gen = torch.Generator().manual_seed(seed)
    for n in range(steps):
        if engine.done(m):
            return n
        logits = torch.randn(vocab.size, generator=gen)
        clock.start()
        engine.fill(m, words)
        clock.lap("mask")
        row = masked(logits, unpack(words, vocab.size))
        clock.lap("apply")
        token = int(torch.argmax(row))  # the sampler's pick: not the mask's cost
        if token in vocab.ends:  # the reply ends: nothing to advance past
            clock.none("advance")
            return n
        clock.start()
        engine.advance(m, token)
        clock.lap("advance")
    return steps


def measure(engine_cls, vocab: Vocab, schemas: list[tuple[str, dict]], steps: int) -> dict:
    engine = engine_cls(vocab)
    clock, compile_s, tokens = Clock("mask", "apply", "advance"), [], []
    for i, (_, schema) in enumerate(schemas):
        t = time.perf_counter()
        engine.compile(schema)
        compile_s.append(time.perf_counter() - t)
        tokens.append(walk(engine, vocab, schema, i, steps, clock))
    per_token = {kind: [sum(parts) for parts in zip(*(getattr(clock, kind)[p] for p in
                                                         ("mask", "apply", "advance")))]
                 for kind in ("wall", "cpu")}
    row = {"engine": engine.name, "vocab": vocab.size, "tokenizer_s": engine.tokenizer_s,
           "compile_ms": 1e3 * statistics.median(compile_s),
           "compile_ms_max": 1e3 * max(compile_s),
           "tokens_per_reply": statistics.fmean(tokens), "steps": sum(tokens)}
    for part in ("mask", "apply", "advance"):
        row[f"{part}_us"] = _us(clock.wall[part])
        row[f"{part}_cpu_us"] = _us(clock.cpu[part])
    row["per_token_us"], row["per_token_cpu_us"] = _us(per_token["wall"]), _us(per_token["cpu"])
    # what one constrained reply of the mean length costs: its compile and its tokens
    row["reply_ms"] = row["compile_ms"] + row["tokens_per_reply"] * row["per_token_cpu_us"][
        "mean"] / 1e3
    return row


def _us(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"p50": 1e6 * statistics.median(xs), "p95": 1e6 * xs[int(0.95 * (len(xs) - 1))],
            "mean": 1e6 * statistics.fmean(xs)}


def decode_step() -> dict:
    """One SmolLM2 decode step (one stage, serve's weight format, torch's threads): the
    median of each of 5 rounds of 16 steps; the least contended round is the step's own
    cost (`ms`), the median of all is what this machine gave meanwhile (`median_ms`)."""
    from skippy.mesh.models import resolve_model
    from skippy.stages.chain import StageChain
    from skippy.stages.runtime import DEFAULT_WEIGHT_FORMAT
    chain = StageChain(resolve_model("smollm2"), 1, weight_format=DEFAULT_WEIGHT_FORMAT)
    lanes = chain.alloc()
    token = int(torch.argmax(chain.prefill(lanes, [1, 2, 3, 4, 5, 6, 7, 8])))
    rounds = []
    for _ in range(5):
        times = []
        for _ in range(16):
            t = time.perf_counter()
            token = int(torch.argmax(chain.decode(lanes, token)))
            times.append(time.perf_counter() - t)
        rounds.append(times)
    return {"ms": 1e3 * min(statistics.median(r) for r in rounds),
            "median_ms": 1e3 * statistics.median(t for r in rounds for t in r),
            "weight_format": DEFAULT_WEIGHT_FORMAT, "threads": torch.get_num_threads()}


def conformance(n: int) -> dict:
    """n generated schemas through the real gateway (SmolLM2, one in-process stage)."""
    import httpx

    from skippy.cache.config import CacheConfig
    from skippy.evals.json_schemas import conforms, request_body
    from skippy.mesh.control.local import InProcessEngine
    from skippy.mesh.front.gateway import BackgroundServer, create_app
    from skippy.mesh.models import resolve_model
    engine = InProcessEngine(resolve_model("smollm2"), 1, cache=CacheConfig(),
                             model_name="smollm2")
    rows, t0 = [], time.perf_counter()
    with BackgroundServer(create_app(engine, api_keys=())) as srv, \
            httpx.Client(base_url=srv.url, timeout=600) as client:
        for name, schema in generated_schemas(n):
            t = time.perf_counter()
            r = client.post("/v1/chat/completions", json=request_body(name, schema))
            r.raise_for_status()
            body = r.json()
            choice = body["choices"][0]
            text = choice["message"]["content"]
            rows.append({"schema": name, "finish_reason": choice["finish_reason"],
                         "valid": conforms(text, schema), "s": time.perf_counter() - t,
                         "tokens": body["usage"]["completion_tokens"], "reply": text})
    stopped = [r for r in rows if r["finish_reason"] == "stop"]
    return {"schemas": n, "stopped": len(stopped),
            "stopped_valid": sum(r["valid"] for r in stopped),
            "wall_s": time.perf_counter() - t0, "rows": rows}


def plot(result: dict):
    """Per token (left) and per schema compiled (right) against vocabulary size."""
    fig, ((left, right),) = plots.figure(1, 2, width=5, title=(
        "Constrained decoding: the mask's cost (SmolLM2 49k, Gemma 3 262k and its prefixes)"))
    for k, name in enumerate(ENGINES):
        rows = sorted((r for r in result["results"] if r["engine"] == name),
                      key=lambda r: r["vocab"])
        if not rows:
            continue
        x = [r["vocab"] / 1000 for r in rows]
        left.plot(x, [r["per_token_cpu_us"]["p50"] for r in rows], "o-", color=f"C{k}",
                  label=f"{name} p50")
        left.plot(x, [r["per_token_cpu_us"]["p95"] for r in rows], "^--", color=f"C{k}",
                  alpha=0.6, label=f"{name} p95")
        right.plot(x, [r["compile_ms"] for r in rows], "o-", color=f"C{k}", label=name)
    for ax in (left, right):
        plots.log_y(ax)
    plots.finish(left, title="Per token", xlabel="vocabulary (thousands of tokens)",
                 ylabel="mask + apply + advance per token (µs of CPU)")
    plots.finish(right, title="Per request", xlabel="vocabulary (thousands of tokens)",
                 ylabel="compiling one JSON schema (ms, median)")
    return fig


def line(r: dict) -> str:
    """One engine x vocabulary's row of the printed table (without the decode step's share)."""
    cpu = r["per_token_cpu_us"]
    return (f"{r['engine']:<11} {r['vocab']:>7} {r['tokenizer_s']:>11.2f} "
            f"{r['compile_ms']:>10.1f} {r['mask_cpu_us']['p50']:>8.0f} "
            f"{r['apply_cpu_us']['p50']:>8.0f} {r['advance_cpu_us']['p50']:>7.0f} "
            f"{cpu['p50']:>6.0f} {cpu['p95']:>6.0f} {r['per_token_us']['p50']:>6.0f} "
            f"{r['reply_ms']:>8.1f}")


def _importable(engine: str) -> bool:
    """xgrammar is not a dependency (it needs transformers and triton): without it the
    bench measures llguidance alone and says so."""
    try:
        __import__(engine)
    except ImportError:
        print(f"{engine} is not installed: not measured (pip install "
              f"{'xgrammar==0.2.8' if engine == 'xgrammar' else engine})", file=sys.stderr)
        return False
    return True


def table(results: list[dict], step: dict) -> str:
    lines = [f"SmolLM2 decode step: {step['ms']:.2f} ms (one stage, {step['weight_format']}, "
             f"{step['threads']} threads; {step['median_ms']:.2f} ms median under this "
             f"machine's load)", "per token: this thread's CPU time, p50 unless named", "",
             f"{'engine':<11} {'vocab':>7} {'tokenizer s':>11} {'compile ms':>10} "
             f"{'mask us':>8} {'apply us':>8} {'advance':>7} {'token':>6} {'p95':>6} "
             f"{'wall':>6} {'reply ms':>8} {'/ step':>7}"]
    for r in results:
        lines.append(f"{line(r)} {r['per_token_cpu_us']['p50'] / 1e3 / step['ms']:>6.1%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m skippy.evals.bench_constraint",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--schemas", type=int, default=10, help="schemas per vocabulary")
    p.add_argument("--steps", type=int, default=64, help="tokens per schema at most")
    p.add_argument("--engine", action="append", choices=list(ENGINES),
                   help="grammar engine (repeatable; default: both)")
    p.add_argument("--scaling", action="store_true",
                   help="also Gemma's vocabulary cut to 16k, 32k, 65k, 131k tokens")
    p.add_argument("--conformance", type=int, default=0, metavar="N",
                   help="also run N schemas through the gateway (SmolLM2, greedy)")
    p.add_argument("--json", help="write the results to PATH ('-': stdout) and a PNG next "
                                  "to it (`python -m skippy.evals.plots PATH` draws it again)")
    args = p.parse_args(argv)
    schemas = generated_schemas(args.schemas, seed=1)
    sizes = [("smollm2", None), ("gemma3", None)]
    if args.scaling:
        sizes += [("gemma3", n) for n in SCALING]
    results, engines = [], [e for e in args.engine or list(ENGINES) if _importable(e)]
    for model, size in sizes:
        vocab = Vocab(MODELS[model], size)
        for name in engines:
            r = measure(ENGINES[name], vocab, schemas, args.steps)
            results.append({"model": model, **r})
            print(f"{name} on {model} ({vocab.size} tokens): "
                  f"{r['per_token_cpu_us']['p50']:.0f} us per token", file=sys.stderr)
    results.sort(key=lambda r: (r["vocab"], r["engine"]))
    step = decode_step()
    out = {"decode_step": step, "target_share": TARGET, "loadavg": os.getloadavg(),
           "results": results,
           "shares": {r["engine"]: r["per_token_cpu_us"]["p50"] / 1e3 / step["ms"]
                      for r in results if r["model"] == "smollm2"}}
    print(table(results, step))
    for name, share in out["shares"].items():
        print(f"{name}: mask cost / SmolLM2 decode step = {share:.1%} (target < {TARGET:.0%}): "
              f"{'met' if share < TARGET else 'NOT met'}")
    if args.conformance:
        c = out["conformance"] = conformance(args.conformance)
        print(f"conformance: {c['stopped_valid']} of {c['schemas']} replies stopped and "
              f"validate ({c['stopped']} stopped), {c['wall_s']:.0f} s")
    plots.write(out, args.json, "bench_constraint")
    return out


if __name__ == "__main__":
    guarded(main)
