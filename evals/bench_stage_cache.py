"""Warm cache hits: our cached stage vs llama.cpp's warm slot, same GGUF, one run.

    python -m skippy.evals.bench_stage_cache [--family smollm2 ...] [--runtime torch ...]
                                             [--repeats 5] [--json PATH|-]

Follows the reference's method (skippy-cache README, "Benchmark Evidence"): a 128-token
prefix, one generated token, one lane, the same GGUF on both sides, 2 threads each. Rows:

- exact_repeat: the same 128-token prompt again. Ours: the last stage's exact-result
  cache. llama.cpp: llama-cpp-python's `create_completion` with the prompt still in its
  context (it samples from the live logits, or re-runs the last token).
- changed_tail: the cached 128-token prefix + a new 16-token tail, a new tail each time.
  Ours: restore the prefix from the stage cache into a fresh lane (ResidentKv copy or
  KvRecurrent import), prefill the tail (padded to one chunk). llama.cpp: its context
  holds the previous request (the prefix + the previous tail), as a server slot would;
  on a dense model it cuts the KV back to the prefix and runs only the tail, on a
  recurrent or hybrid model the recurrent state cannot be cut back, so llama-cpp-python
  reprocesses the whole prompt (measured as it is, not assumed).
- changed_tail_1024 (hybrid families): the same with a 1024-token prefix.

Families: smollm2 and gemma3-270m are the real shipped models (dense); lfm2 and
falcon-h1 are synthesized with stages.synth at a realistic shape (hidden 1024, 16
layers, f16 weights, SmolLM2's tokenizer; a tiny model would measure only overhead) and
kept under `model_home()/synth`, so reruns are free. The shape is printed.

Ours runs in each runtime given (`--runtime`, both by default): the torch runtime in one
stage and the llama.cpp runtime (one whole-model stage). Every timed answer of ours is
checked against the same prompt computed without the cache (a fresh runtime lane, no
cache involved): the next token must be equal, or the bench fails (a bench that measures
a wrong answer is worthless); whether the logits are also bitwise equal is reported
(`exact` column). `reused` is the fewest prompt tokens our cache served in a timed run:
the whole prompt on exact_repeat, the whole prefix on a changed-tail hit.
Medians of --repeats after one warm-up; targets (from the issue): dense families at
least 1.2x llama.cpp on exact_repeat, hybrid families at least 8x on changed_tail.
On a recurrent model llama.cpp is also timed running only the tail after a freshly
computed prefix (untimed): the `ceiling` column, llama.cpp ms / that, is the speedup of
a cache that leaves nothing but the tail to compute in llama.cpp's kernels. On 2 CPU
cores prefill is compute-bound, so a 16-row tail costs about 1/7 of 144 rows there.
`--json P` also draws P.png: the speedup per family and row against its target, and the
changed-tail latency by prefix length, ours and llama.cpp.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from skippy.cache.config import CacheConfig
from skippy.evals import plots
from skippy.evals.reference import _quiet_stderr
from skippy.mesh.control.local import InProcessEngine
from skippy.mesh.progress import Console, tracked
from skippy.stages.chain import StageChain
from skippy.stages.runtime_kind import RUNTIMES as RUNTIME_KINDS, runtime_kind
from skippy.evals.entry import guarded

PREFIX, LONG_PREFIX, TAIL = 128, 1024, 16
THREADS = 2
N_CTX = 2048  # room for the long prefix + tail on both sides
RUNTIMES = tuple(RUNTIME_KINDS)  # our runtimes, by name
# The prefill chunk C: a tail shorter than C is padded to C rows (DESIGN.md §5.3), so
# the changed-tail rows cost a C-row prefill. The serving default unless --chunk says.
CHUNK = CacheConfig().chunk
TARGETS = {("dense", "exact_repeat"): 1.2, ("hybrid", "changed_tail"): 8.0}


class ExactnessError(AssertionError):
    """A cached answer's next token differs from the uncached answer's."""


@dataclass(frozen=True)
class Shape:
    """The shape of a synthesized bench model (stages.synth.write_synthetic arguments)."""

    arch: str
    layers: int = 16
    hidden: int = 1024
    heads: int = 16
    kv_heads: int = 8
    ff: int = 4096
    dtype: str = "f16"
    seed: int = 1
    # the arch's other synth knobs (stages/synth_table.py), e.g. (("variant", "a4b"),)
    settings: tuple[tuple[str, object], ...] = ()

    def file_name(self) -> str:
        from skippy.stages.synth import SYNTH_VERSION
        from skippy.stages.synth_table import knob_suffix
        arch = self.arch + knob_suffix(self.settings)
        return (f"bench-{arch}-L{self.layers}-h{self.hidden}-a{self.heads}"
                f"-kv{self.kv_heads}-ff{self.ff}-{self.dtype}-s{self.seed}-v{SYNTH_VERSION}.gguf")

    def describe(self) -> str:
        from skippy.stages.synth import synth_description
        text = (f"synthesized {self.arch}: {self.layers} layers, hidden {self.hidden}, "
                f"{self.heads} heads (kv {self.kv_heads}), ff {self.ff}, {self.dtype} weights")
        extra = synth_description(self.arch, self.layers, **dict(self.settings))
        return text + (f", {extra}" if extra else "")


@dataclass(frozen=True)
class Family:
    name: str
    kind: str                  # "dense" or "hybrid"
    model: str | None = None   # a shipped model (resolve_model spec) ...
    shape: Shape | None = None  # ... or a synthesized one

    def path(self, synth_dir: Path | None = None) -> Path:
        from skippy.mesh.models import model_home, resolve_model
        if self.model is not None:
            return resolve_model(self.model)
        from skippy.stages.synth import write_synthetic
        folder = Path(synth_dir) if synth_dir is not None else model_home() / "synth"
        out = folder / self.shape.file_name()
        if not out.exists():  # deterministic in its arguments: an existing file is the same
            folder.mkdir(parents=True, exist_ok=True)
            s = self.shape
            write_synthetic(s.arch, layers=s.layers, seed=s.seed, out=out,
                            tokenizer_from=resolve_model("smollm2"), hidden=s.hidden,
                            ff=s.ff, heads=s.heads, kv_heads=s.kv_heads, dtype=s.dtype,
                            **dict(s.settings))
        return out

    def describe(self) -> str:
        return self.shape.describe() if self.shape else f"shipped model {self.model}"


def _hybrids() -> dict[str, Family]:
    """The registry's hybrid families with a synthetic table, at the bench's shape."""
    from skippy.topology.families import FAMILIES
    return {name: Family(name, "hybrid", shape=Shape(name)) for name, fam in FAMILIES.items()
            if fam.cache_policy == "KvRecurrent" and fam.synth is not None}


FAMILIES = {
    "smollm2": Family("smollm2", "dense", model="smollm2"),
    "gemma3-270m": Family("gemma3-270m", "dense", model="gemma3-270m"),
    **_hybrids(),
}


@dataclass(frozen=True)
class Row:
    name: str
    prefix: int
    tail: int  # 0: the exact prefix again
    target: float | None = None  # the speedup the issue asks for on this row, if any

    def prompts(self, repeats: int) -> list[list[int]]:
        """Warm-up + `repeats` prompts: the same prefix, and a new tail each time."""
        prefix = token_ids(self.prefix, salt=0)
        if not self.tail:
            return [prefix] * (repeats + 1)
        return [prefix + token_ids(self.tail, salt=r + 1) for r in range(repeats + 1)]


def token_ids(n: int, salt: int) -> list[int]:
    """Deterministic ids spread over [100, 30100): valid in every vocabulary used here."""
    return [(i * 7919 + salt * 104729) % 30000 + 100 for i in range(n)]


def rows_for(kind: str, prefix: int = PREFIX, long_prefix: int = LONG_PREFIX,
             tail: int = TAIL) -> list[Row]:
    rows = [Row(name, prefix, t, TARGETS.get((kind, name)))
            for name, t in (("exact_repeat", 0), ("changed_tail", tail))]
    if kind == "hybrid":
        rows.append(Row(f"changed_tail_{long_prefix}", long_prefix, tail))
    return rows


def _ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


# -- our side ---------------------------------------------------------------------------------
def _uncached(pipe: StageChain, ids: list[int]) -> torch.Tensor:
    """The prompt's next-token logits on fresh runtime lanes, no cache involved."""
    lanes = [s.alloc_lane() for s in pipe.stages]
    try:
        return pipe.prefill(lanes, ids).clone()
    finally:
        for stage, lane in zip(pipe.stages, lanes):
            stage.free_lane(lane)


def ours(path: Path, runtime: str, rows: list[Row], repeats: int,
         chunk: int = CHUNK) -> dict[str, dict]:
    """Per row: timed warm hits of our cached pipeline, each checked against an uncached
    answer. Raises ExactnessError when a next token differs."""
    kind = runtime_kind(runtime)
    engine = InProcessEngine(path, 1, wire_dtype="f16", n_ctx=N_CTX, threads=THREADS,
                             runtime=kind, cache=CacheConfig(admit_after=1, chunk=chunk))
    pipe = StageChain(path, 1, wire_dtype="f16", n_ctx=N_CTX, threads=THREADS,
                         runtime=kind, chunk=chunk)  # the uncached references
    torch.set_num_threads(THREADS)

    def one(ids: list[int]) -> tuple[float, torch.Tensor, int]:
        """A one-token request on the served path; then the warm lanes go, so the next
        hit must come from the cache entries."""
        t = time.perf_counter()
        step = engine.complete(ids, 1, logits=True)[0]
        dt = time.perf_counter() - t
        for s in engine.servers:
            s.loop.call(s.cache.drop_warm_lanes)
        return dt, step.logits, step.cached_tokens

    out = {}
    try:
        for row in rows:
            prompts = row.prompts(repeats)
            cold, _, _ = one(prompts[0][:row.prefix])  # first sight: computes and records
            samples, reused, bitwise = [], [], True
            references: dict[tuple[int, ...], torch.Tensor] = {}
            for i, ids in enumerate(prompts):
                dt, logits, r = one(ids)
                key = tuple(ids)
                if key not in references:
                    references[key] = _uncached(pipe, ids)
                ref = references[key]
                if int(logits.argmax()) != int(ref.argmax()):
                    raise ExactnessError(
                        f"{path.name} {runtime} {row.name}: cached next token "
                        f"{int(logits.argmax())} != uncached {int(ref.argmax())}")
                bitwise &= torch.equal(logits, ref)
                if i:  # the first is the warm-up
                    samples.append(dt)
                    reused.append(r)
            out[row.name] = {"ms": _ms(samples), "samples_ms": [s * 1e3 for s in samples],
                             "cold_ms": cold * 1e3, "reused_tokens": min(reused),
                             "next_token_exact": True, "logits_bitwise": bitwise}
    finally:
        for stage in [*pipe.stages, *(s.runtime for s in engine.servers)]:
            close = getattr(stage, "close", None)
            if close is not None:
                close()
    return out


# -- llama.cpp's warm slot --------------------------------------------------------------------
def llama(path: Path, rows: list[Row], repeats: int) -> tuple[dict[str, dict], bool]:
    """Per row: llama-cpp-python's warm slot, the prefix kept in its context. Also
    whether llama.cpp sees the model as recurrent or hybrid."""
    import llama_cpp
    with _quiet_stderr():
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=N_CTX, n_threads=THREADS,
                              n_threads_batch=THREADS, verbose=False)
    recurrent = bool(llm._is_recurrent or llm._is_hybrid)

    def one(ids: list[int]) -> float:
        t = time.perf_counter()
        llm.create_completion(ids, max_tokens=1, temperature=0)
        return time.perf_counter() - t

    def tail_only(prompts: list[list[int]], prefix: int) -> list[float]:
        """llama.cpp running only the tail, its prefix freshly computed (untimed): what
        the tail costs in llama.cpp's own kernels, so the most any cache can save."""
        samples = []
        for ids in prompts:
            llm.reset()
            llm.eval(ids[:prefix])
            t = time.perf_counter()
            llm.eval(ids[prefix:])
            samples.append(time.perf_counter() - t)
        return samples

    out = {}
    try:
        for row in rows:
            prompts = row.prompts(repeats)
            llm.reset()
            cold = one(prompts[0][:row.prefix])
            samples = []
            for i, ids in enumerate(prompts):
                # The slot holds the previous request (the prefix + its tail), as a
                # server's slot would: no untimed reset to the bare prefix.
                dt = one(ids)
                if i:
                    samples.append(dt)
            out[row.name] = {"ms": _ms(samples), "samples_ms": [s * 1e3 for s in samples],
                             "cold_ms": cold * 1e3}
            if recurrent and row.tail:
                out[row.name]["tail_only_ms"] = _ms(tail_only(prompts[1:], row.prefix))
    finally:
        llm.close()
    return out, recurrent


# -- one family, all rows ---------------------------------------------------------------------
def bench(family: Family, *, repeats: int = 5, runtimes: tuple[str, ...] = RUNTIMES,
          prefix: int = PREFIX, long_prefix: int = LONG_PREFIX, tail: int = TAIL,
          chunk: int = CHUNK, synth_dir: Path | None = None,
          say: Callable[[str], None] = lambda _: None) -> dict:
    """Both sides on one family's GGUF; rows with our figure per runtime, llama.cpp's,
    the speedup (llama.cpp ms / ours ms) and the target where the issue sets one."""
    path = family.path(synth_dir)
    rows = rows_for(family.kind, prefix, long_prefix, tail)
    say(f"{family.name}: {family.describe()} ({path.name})")
    theirs, recurrent = llama(path, rows, repeats)
    result_rows, skipped = [], {}
    for runtime in runtimes:
        try:
            mine = ours(path, runtime, rows, repeats, chunk)
        except ExactnessError:
            raise
        except Exception as e:  # a runtime that cannot serve this family: say so, go on
            skipped[runtime] = f"{type(e).__name__}: {e}"
            say(f"{family.name}: {runtime} runtime skipped: {skipped[runtime]}")
            continue
        for row in rows:
            a, b = mine[row.name], theirs[row.name]
            target, speedup = row.target, b["ms"] / a["ms"]
            result_rows.append({
                "row": row.name, "prefix_tokens": row.prefix, "tail_tokens": row.tail,
                "runtime": runtime, "ours_ms": a["ms"], "llama_cpp_ms": b["ms"],
                "speedup": speedup, "target": target,
                # llama.cpp ms / its own tail-only ms: the speedup a cache that leaves
                # only the tail to compute, in llama.cpp's kernels, would reach.
                "ceiling": b["ms"] / b["tail_only_ms"] if "tail_only_ms" in b else None,
                "met": None if target is None else speedup >= target,
                "ours": a, "llama_cpp": b})
    return {"family": family.name, "kind": family.kind, "file": str(path),
            "shape": asdict(family.shape) if family.shape else None,
            "shape_text": family.describe(), "llama_cpp_recurrent": recurrent, "chunk": chunk,
            "rows": result_rows, "skipped_runtimes": skipped}


# -- the command ------------------------------------------------------------------------------
HEADER = (f"{'family':<12} {'row':<18} {'ours':<10} {'ours ms':>9} {'llama.cpp ms':>13} "
          f"{'speedup':>8} {'ceiling':>8} {'target':>7}  met  {'reused':>6}  exact")


def format_row(family: str, r: dict) -> str:
    target = f"{r['target']:.1f}x" if r["target"] else "-"
    met = "-" if r["met"] is None else ("yes" if r["met"] else "NO")
    exact = "bitwise" if r["ours"]["logits_bitwise"] else "token"
    ceiling = f"{r['ceiling']:.2f}x" if r.get("ceiling") else "-"
    return (f"{family:<12} {r['row']:<18} {r['runtime']:<10} {r['ours_ms']:>9.2f} "
            f"{r['llama_cpp_ms']:>13.2f} {r['speedup']:>7.2f}x {ceiling:>8} {target:>7}  {met:<4} "
            f"{r['ours']['reused_tokens']:>6}  {exact}")


def summary(families: list[dict], *, repeats: int, chunk: int = CHUNK,
            seconds: float = 0.0) -> dict:
    """The JSON of a run: its settings, targets and whether all were met, and each
    family's `bench` result."""
    checked = [r["met"] for f in families for r in f["rows"] if r["met"] is not None]
    return {"prefix_tokens": PREFIX, "long_prefix_tokens": LONG_PREFIX, "tail_tokens": TAIL,
            "threads": THREADS, "repeats": repeats, "n_ctx": N_CTX, "chunk": chunk,
            "targets": {f"{k}/{row}": v for (k, row), v in TARGETS.items()},
            "targets_met": bool(checked) and all(checked), "families": families,
            "seconds": seconds}


def plot(result: dict):
    """Speedup (llama.cpp ms / ours ms) per family, runtime and row, targets marked (left);
    the changed-tail rows' ms by prefix length, ours solid and llama.cpp dashed (right)."""
    fig, ((speed, latency),) = plots.figure(1, 2, width=6.8, title=(
        f"warm cache hits vs llama.cpp's warm slot ({result['tail_tokens']}-token tails, "
        f"{result['threads']} threads, medians of {result['repeats']})"))
    groups = [(f["family"], rt) for f in result["families"]
              for rt in dict.fromkeys(r["runtime"] for r in f["rows"])]
    names = list(dict.fromkeys(r["row"] for f in result["families"] for r in f["rows"]))
    by = {(f["family"], r["runtime"], r["row"]): r for f in result["families"]
          for r in f["rows"]}
    plots.bars(speed, [f"{fam}\n{rt}" for fam, rt in groups],
               {n: [by[(*g, n)]["speedup"] if (*g, n) in by else 0 for g in groups]
                for n in names}, rotate=len(groups) > 4)
    plots.target_marks(speed, [(j, i, by[(*g, n)]["target"]) for i, n in enumerate(names)
                               for j, g in enumerate(groups) if by.get((*g, n), {}).get("target")],
                       len(groups), len(names))
    speed.axhline(1.0, color="grey", linewidth=0.8)
    plots.finish(speed, title="speedup per family", ylabel="llama.cpp ms / ours ms")
    for k, f in enumerate(result["families"]):
        tails = [r for r in f["rows"] if r["tail_tokens"]]
        color = f"C{k}"
        for rt in dict.fromkeys(r["runtime"] for r in tails):
            mine = sorted((r for r in tails if r["runtime"] == rt),
                          key=lambda r: r["prefix_tokens"])
            latency.plot([r["prefix_tokens"] for r in mine], [r["ours_ms"] for r in mine],
                         "o-" if rt == "torch" else "^-.", color=color,
                         label=f"{f['family']} ours ({rt})")
        ref = sorted({r["prefix_tokens"]: r for r in tails}.values(),
                     key=lambda r: r["prefix_tokens"])
        latency.plot([r["prefix_tokens"] for r in ref], [r["llama_cpp_ms"] for r in ref],
                     "s--", color=color, label=f"{f['family']} llama.cpp")
    plots.log_y(latency)
    plots.finish(latency, title="prefix + new tail: ms to the first token",
                 xlabel="cached prefix tokens", ylabel="ms (log)")
    return fig


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m skippy.evals.bench_stage_cache")
    p.add_argument("--family", "--model", action="append", choices=sorted(FAMILIES),
                   help="repeatable; default: all four")
    p.add_argument("--runtime", action="append", choices=RUNTIMES,
                   help="our runtime(s); repeatable; default: both")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--chunk", type=int, default=CHUNK,
                   help=f"our prefill chunk C (default {CHUNK}); a tail is padded to C rows")
    p.add_argument("--json", help="write the results to PATH and a plot to PATH with .png "
                                  "('-': JSON on stdout, the table on stderr)")
    args = p.parse_args(argv)
    table = sys.stderr if args.json == "-" else sys.stdout

    say = Console(table)  # the table's lines keep clear of the bar on stderr

    started = time.perf_counter()
    families = []
    for name in tracked(args.family or list(FAMILIES), "bench_stage_cache", "family"):
        f = bench(FAMILIES[name], repeats=args.repeats, chunk=args.chunk,
                  runtimes=tuple(args.runtime or RUNTIMES), say=say)
        families.append(f)
        for r in f["rows"]:
            say(format_row(f["family"], r))
    say(f"\n{PREFIX}-token prefix, {TAIL}-token tails, 1 generated token, 1 lane, "
        f"{THREADS} threads each side, chunk {args.chunk}, medians of {args.repeats}; "
        "speedup = llama.cpp ms / ours ms; ceiling (recurrent models) = llama.cpp ms / "
        "llama.cpp computing only the tail after a fresh prefix: the most a cache saves")
    for f in families:
        say(f"{f['family']}: {f['shape_text']}")
    say(HEADER)
    for f in families:
        for r in f["rows"]:
            say(format_row(f["family"], r))
    result = summary(families, repeats=args.repeats, chunk=args.chunk,
                     seconds=time.perf_counter() - started)
    checked = [r["met"] for f in families for r in f["rows"] if r["met"] is not None]
    say(f"targets met: {sum(checked)}/{len(checked)}")
    plots.write(result, args.json, "bench_stage_cache")
    return result


if __name__ == "__main__":
    guarded(main)
    sys.exit(0)
