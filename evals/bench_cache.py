"""Prefix-cache lookup cost as resident entries grow (DESIGN.md §5.2: "longest-prefix
lookup must stay cheap as entries grow").

At each size (64, 1024, 4096 resident entries by default) the cache holds entries of
`--tokens` tokens (2048) built like agent/tool traffic: every prompt starts with one
common system prefix (`--system`, a quarter of the tokens by default), and each later
prompt either starts a new conversation after it or branches from an earlier prompt at a
random block boundary; token ids are random in [0, 49152). Queries, 32 distinct ones per
case, then diverge from that corpus at chosen depths:

- miss: the first block differs from every entry (nothing shared);
- early: shares only the first block (with every entry, through the system prefix);
- system: shares exactly the system prefix (a new conversation; every entry shares it);
- middle: copies one entry's first half, then diverges;
- late: copies one entry and changes only its last block;
- exact: one whole entry plus some new tokens (the entry is a full hit).

For each query three costs are timed separately, one call per sample:

- hashing: `PrefixIndex.prepare` — the query's token bytes and parent-chained block
  hashes (what `PrefixCache.lookup` computes before taking its lock), also per token;
- matching: `PrefixIndex.longest(prepared query)`, so hashing is excluded;
- lookup: end-to-end `PrefixCache.lookup` + `release` of the hit.

Plus recording: insert (`reserve` + `commit` of a new 2048-token prompt, no eviction) and
evict (the same into a cache at its entry cap, so each insert evicts the LRU entry).

Every sample is one `time.perf_counter_ns()` pair around one call (the pair's own cost is
reported as timer_overhead_ns and not subtracted), after untimed warm-up calls; the
garbage collector stays enabled, as in a server, so p99 includes its pauses. Every query's
match length is checked against what the corpus says it must be, so the figures are of
correct answers. Targets: matching p50 <= 20 us at the largest size (well under a flat
scan's cost there: evals/README.md), hashing <= 1 us per token.

    python -m skippy.evals.bench_cache                           # 64,1024,4096 entries
    python -m skippy.evals.bench_cache --entries 64 --repeats 20 --json -  # JSON on stdout

With `--json PATH` the figures are also written to PATH and a plot to PATH with a .png
suffix (matching p50 by resident entries; lookup p50 by the prefix a query shares); with
`--json -` the JSON goes to stdout and the table to stderr.
"""

from __future__ import annotations

import argparse
import gc
import platform
import random
import sys
import time
from array import array

from skippy.cache.identity import StageKey
from skippy.cache.index import PrefixIndex
from skippy.cache.prefix_cache import PrefixCache
from skippy.mesh.progress import Console, tracked
from skippy.evals import plots
from skippy.evals.entry import guarded

VOCAB = 49152
QUERIES_PER_CASE = 32
EXTRA_TOKENS = 100            # new tokens after a whole entry in the `exact` case
BYTES_PER_TOKEN = 1024        # nominal state size; only the LRU's byte accounting sees it
MATCH_P50_TARGET_US = 20.0
HASH_PER_TOKEN_TARGET_US = 1.0
CASES = ("miss", "early", "system", "middle", "late", "exact")
STAGE = StageKey(model_digest="bench-model", topology_digest="bench-topology", stage_index=0,
                 layer_start=0, layer_end=16, runtime_abi="bench/1", kv_layout="paged",
                 kv_dtype="f16", wire_dtype="f16", n_ctx=8192).digest

# One int object per token id: the corpus holds millions of token slots, and sharing the
# int objects keeps 4096 x 2048 tokens near 70 MB. Queries are built from fresh int
# objects (`_fresh`), as token ids decoded from a request would be, so no comparison
# between a query and an entry gets an identity shortcut.
_TOKEN_IDS = list(range(VOCAB))


def _fresh(tokens) -> list[int]:
    return array("i", tokens).tolist()


class Corpus:
    """Resident prompts: one shared system prefix, then conversations that branch."""

    def __init__(self, n: int, tokens: int, block: int, system: int, rng: random.Random):
        self.tokens, self.block, self.system = tokens, block, system
        self.rng = rng
        self.system_prefix = tuple(rng.choices(_TOKEN_IDS, k=system))
        self.entries: list[tuple[int, ...]] = []
        for _ in range(n):
            self.entries.append(self.new_prompt())

    def new_prompt(self) -> tuple[int, ...]:
        """A new conversation after the system prefix (1 in 4), or a branch of an earlier
        prompt at a random block boundary past the system prefix."""
        rng, b = self.rng, self.block
        if not self.entries or rng.random() < 0.25:
            head = self.system_prefix
        else:
            parent = self.entries[rng.randrange(len(self.entries))]
            depth = rng.randrange(self.system // b + 1, self.tokens // b) * b
            head = parent[:depth]
        return head + tuple(rng.choices(_TOKEN_IDS, k=self.tokens - len(head)))

    def random(self, n: int) -> list[int]:
        return self.rng.choices(_TOKEN_IDS, k=n)


def _queries(corpus: Corpus, case: str, n: int) -> list[tuple[list[int], int]]:
    """(query tokens, the match length it must get) for `n` queries of one case."""
    T, b, rng = corpus.tokens, corpus.block, corpus.rng
    out = []
    for _ in range(n):
        entry = list(corpus.entries[rng.randrange(len(corpus.entries))])
        if case == "miss":
            first = corpus.system_prefix[0]
            q = [(first + 1 + rng.randrange(VOCAB - 1)) % VOCAB] + corpus.random(T - 1)
            want = 0
        elif case == "early":
            q = list(corpus.system_prefix[:b]) + corpus.random(T - b)
            want = b
        elif case == "system":
            q = list(corpus.system_prefix) + corpus.random(T - corpus.system)
            want = corpus.system
        elif case == "middle":
            want = (T // 2) // b * b
            q = entry[:want] + corpus.random(T - want)
        elif case == "late":
            want = T - b
            q = entry[:want] + corpus.random(b)
        elif case == "exact":
            q, want = entry + corpus.random(EXTRA_TOKENS), T
        else:
            raise ValueError(case)
        # A random block equals a recorded one only with probability ~49152^-64.
        out.append((_fresh(q), want))
    return out


def _percentiles(samples_ns: list[int]) -> dict:
    """Nearest-rank percentiles, in microseconds."""
    s = sorted(samples_ns)

    def rank(p: int) -> int:
        return s[min(len(s) - 1, max(0, -(-p * len(s) // 100) - 1))]

    return {"p50_us": rank(50) / 1e3, "p99_us": rank(99) / 1e3,
            "mean_us": sum(s) / len(s) / 1e3, "min_us": s[0] / 1e3, "samples": len(s)}


def _warm_up(seconds: float = 0.3) -> None:
    """Hash for a moment first, so the first figure is not the one paying for a cold
    interpreter and a CPU still clocking up."""
    tokens, index = _fresh(range(2048)), PrefixIndex(64)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        index.prepare(STAGE, tokens)


def _timer_overhead_ns() -> int:
    now = time.perf_counter_ns
    samples = []
    for _ in range(10_000):
        t0 = now()
        samples.append(now() - t0)
    return sorted(samples)[len(samples) // 2]


def _timed(call, n_queries: int, warmup: int, repeats: int) -> list[int]:
    """Samples (ns) of `call(i)`, one call each, cycling i over the queries."""
    now, samples = time.perf_counter_ns, []
    gc.collect()
    for i in range(warmup + repeats):
        t0 = now()
        call(i % n_queries)
        t1 = now()
        if i >= warmup:
            samples.append(t1 - t0)
    return samples


def _lookup_release(cache: PrefixCache, query: list[int]) -> None:
    hit = cache.lookup(STAGE, query)
    if hit is not None:
        cache.release(hit)


def _time_case(index: PrefixIndex, cache: PrefixCache, queries: list, chains: list,
               warmup: int, repeats: int) -> tuple[list[int], list[int], list[int]]:
    """Hashing, matching and lookup samples for one case's queries."""
    # One pass per cost, each cycling through the same queries, so all three see equally
    # warm CPU caches (one pass right after another would hand the second the entries
    # the first just read).
    n = len(queries)
    hash_ns = _timed(lambda i: index.prepare(STAGE, queries[i][0]), n, warmup, repeats)
    match_ns = _timed(lambda i: index.longest(chains[i]), n, warmup, repeats)
    lookup_ns = _timed(lambda i: _lookup_release(cache, queries[i][0]), n, warmup, repeats)
    return hash_ns, match_ns, lookup_ns


def _bench_size(n: int, args, rng: random.Random, say) -> dict:
    t_build = time.perf_counter()
    corpus = Corpus(n, args.tokens, args.block, args.system, rng)
    nbytes = args.tokens * BYTES_PER_TOKEN
    cache = PrefixCache(block=args.block, max_entries=n + 1, max_bytes=(n + 1) * nbytes)
    index = PrefixIndex(args.block)   # the same entries, for matching with a given chain
    through: dict[bytes, int] = {}   # block hash -> entries whose prefix it covers
    for tokens in corpus.entries:
        r = cache.reserve(STAGE, tokens, nbytes)
        assert r is not None and not r.evicted and cache.commit(r)
        prepared = index.prepare(STAGE, tokens)
        index.insert(r.entry_id, prepared)
        for h in prepared.chain:
            through[h] = through.get(h, 0) + 1
    build_s = time.perf_counter() - t_build
    say(f"  {n} entries built in {build_s:.1f} s")

    warmup, repeats, now = args.warmup, args.repeats, time.perf_counter_ns
    result = {"entries": n, "build_s": build_s, "cases": {}}
    for case in CASES:
        queries = _queries(corpus, case, QUERIES_PER_CASE)
        chains = [index.prepare(STAGE, q) for q, _ in queries]
        # How many entries hold the matched prefix: the candidates a lookup must rank.
        counts = sorted(through.get(c.chain[want // args.block - 1], 0) if want else 0
                        for c, (_, want) in zip(chains, queries))
        candidates = counts[len(counts) // 2]
        for q, want in queries:  # correctness first: the figures are of right answers
            m = index.longest(index.prepare(STAGE, q))
            assert (m.length if m else 0) == want, (case, m, want)
            hit = cache.lookup(STAGE, q)
            assert (hit.length if hit else 0) == want, (case, hit, want)
            if hit:
                cache.release(hit)
        hash_ns, match_ns, lookup_ns = _time_case(index, cache, queries, chains,
                                                  warmup, repeats)
        hashed = len(queries[0][0]) // args.block * args.block
        h = _percentiles(hash_ns)
        h["tokens"] = hashed
        h["us_per_token"] = h["p50_us"] / hashed
        result["cases"][case] = {"matched_tokens": queries[0][1], "candidates": candidates,
                                 "hash": h, "match": _percentiles(match_ns),
                                 "lookup": _percentiles(lookup_ns)}
        say(f"  {n} entries, {case}: match p50 {result['cases'][case]['match']['p50_us']:.1f} us")

    # insert: reserve + commit below the caps; the new entry is removed again, untimed.
    fresh = [corpus.new_prompt() for _ in range(warmup + repeats)]
    samples = []
    for i, tokens in enumerate(fresh):
        t0 = now()
        r = cache.reserve(STAGE, tokens, nbytes)
        ok = r is not None and cache.commit(r)
        t1 = now()
        assert ok and not r.evicted
        cache.remove(r.entry_id)
        if i >= warmup:
            samples.append(t1 - t0)
    result["insert"] = _percentiles(samples)

    # evict: the cache sits at its entry cap, so every insert evicts the LRU entry.
    cache = PrefixCache(block=args.block, max_entries=n, max_bytes=(n + 1) * nbytes)
    for tokens in corpus.entries:
        r = cache.reserve(STAGE, tokens, nbytes)
        assert r is not None and cache.commit(r)
    fresh = [corpus.new_prompt() for _ in range(warmup + repeats)]
    samples = []
    for i, tokens in enumerate(fresh):
        t0 = now()
        r = cache.reserve(STAGE, tokens, nbytes)
        ok = r is not None and cache.commit(r)
        t1 = now()
        assert ok and len(r.evicted) == 1
        if i >= warmup:
            samples.append(t1 - t0)
    result["evict"] = _percentiles(samples)
    assert cache.stats().entries == n
    return result


def _verdict(sizes: list[dict]) -> dict:
    largest = max(sizes, key=lambda s: s["entries"])
    worst_case, worst = max(((c, v["match"]["p50_us"]) for c, v in largest["cases"].items()),
                            key=lambda cv: cv[1])
    worst_tok = max(((s["entries"], c, v["hash"]["us_per_token"])
                     for s in sizes for c, v in s["cases"].items()), key=lambda x: x[2])
    return {
        "match_p50": {"target_us": MATCH_P50_TARGET_US, "at_entries": largest["entries"],
                      "worst_case": worst_case, "worst_p50_us": worst,
                      "failing_cases": [c for c, v in largest["cases"].items()
                                        if v["match"]["p50_us"] > MATCH_P50_TARGET_US],
                      "pass": worst <= MATCH_P50_TARGET_US},
        "hash_per_token": {"target_us": HASH_PER_TOKEN_TARGET_US, "worst_entries": worst_tok[0],
                           "worst_case": worst_tok[1], "worst_us_per_token": worst_tok[2],
                           "pass": worst_tok[2] <= HASH_PER_TOKEN_TARGET_US},
    }


def _table(result: dict) -> str:
    c = result["config"]
    lines = [(f"prefix cache lookup, {c['tokens']}-token entries, block {c['block']}, "
              f"system prefix {c['system']} tokens, {c['repeats']} samples per figure "
              f"(p50 / p99 in us; timer pair {c['timer_overhead_ns']} ns, not subtracted)"),
             (f"{'entries':>7}  {'case':<7} {'match':>5} {'cands':>5}  "
              f"{'hash p50/p99':>15} {'us/tok':>7}  {'match p50/p99':>17}  "
              f"{'lookup p50/p99':>17}")]
    for s in result["sizes"]:
        for case, v in s["cases"].items():
            h, m, lk = v["hash"], v["match"], v["lookup"]
            cands = str(v["candidates"])
            lines.append(f"{s['entries']:>7}  {case:<7} {v['matched_tokens']:>5} {cands:>5}  "
                         f"{h['p50_us']:>7.1f}/{h['p99_us']:<7.1f} {h['us_per_token']:>7.4f}  "
                         f"{m['p50_us']:>8.1f}/{m['p99_us']:<8.1f}  "
                         f"{lk['p50_us']:>8.1f}/{lk['p99_us']:<8.1f}")
        for op in ("insert", "evict"):
            v = s[op]
            lines.append(f"{s['entries']:>7}  {op:<7} reserve+commit p50/p99 "
                         f"{v['p50_us']:.1f}/{v['p99_us']:.1f} us")
    v = result["verdict"]
    m, h = v["match_p50"], v["hash_per_token"]
    failing = f"; failing: {', '.join(m['failing_cases'])}" if m["failing_cases"] else ""
    lines.append(f"target matching p50 <= {m['target_us']:g} us at {m['at_entries']} entries: "
                 f"{'PASS' if m['pass'] else 'FAIL'} (worst: {m['worst_case']} "
                 f"{m['worst_p50_us']:.1f} us{failing})")
    lines.append(f"target hashing <= {h['target_us']:g} us/token: "
                 f"{'PASS' if h['pass'] else 'FAIL'} (worst: {h['worst_case']} at "
                 f"{h['worst_entries']} entries, {h['worst_us_per_token']:.4f} us/token)")
    return "\n".join(lines)


def plot(result: dict):
    """Matching p50 per case as entries grow, against the target (left); end-to-end lookup
    p50 by the tokens a query shares with the cache, one line per size (right)."""
    fig, (row,) = plots.figure(1, 2, title=f"prefix cache, {result['config']['tokens']}-token "
                                             f"entries, block {result['config']['block']}")
    match, lookup = row
    sizes = result["sizes"]
    entries = [s["entries"] for s in sizes]
    for case in sizes[0]["cases"]:
        match.plot(entries, [s["cases"][case]["match"]["p50_us"] for s in sizes], "o-",
                   label=case)
    match.axhline(MATCH_P50_TARGET_US, color="black", linestyle="--", linewidth=1,
                  label=f"target {MATCH_P50_TARGET_US:g} us")
    match.set_xscale("log", base=2)
    match.set_xticks(entries, [str(n) for n in entries])
    plots.log_y(match)
    plots.finish(match, title="matching (PrefixIndex.longest) p50", xlabel="resident entries",
                 ylabel="us")
    for s in sizes:
        cases = sorted(s["cases"].values(), key=lambda v: v["matched_tokens"])
        lookup.plot([v["matched_tokens"] for v in cases], [v["lookup"]["p50_us"] for v in cases],
                    "o-", label=f"{s['entries']} entries")
    lookup.set_ylim(0, None)
    plots.finish(lookup, title="lookup + release p50 (hashing included)",
                 xlabel="prefix tokens the query shares", ylabel="us")
    return fig


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON and a plot "
                   "(PATH with .png); '-': JSON on stdout")
    p.add_argument("--entries", default="64,1024,4096",
                   help="comma-separated resident entry counts (default 64,1024,4096)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per entry (default 2048)")
    p.add_argument("--block", type=int, default=64, help="index block in tokens (default 64)")
    p.add_argument("--system", type=int, default=None,
                   help="shared system prefix in tokens (default: a quarter of --tokens)")
    p.add_argument("--repeats", type=int, default=200, help="timed samples per figure")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first "
                   "(default: a tenth of --repeats, at least 5)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.entries = [int(x) for x in args.entries.split(",") if x.strip()]
    if args.system is None:
        args.system = args.tokens // 4 // args.block * args.block
    if args.warmup is None:
        args.warmup = max(5, args.repeats // 10)
    b = args.block
    if not (b >= 1 and args.tokens % b == 0 and args.tokens >= 4 * b
            and b < args.system < args.tokens // 2 // b * b and args.system % b == 0):
        p.error("need block | tokens, tokens >= 4 blocks, and a block-aligned system prefix "
                "longer than one block and shorter than half the tokens")
    if not args.entries or min(args.entries) < 1 or args.repeats < 1:
        p.error("--entries and --repeats must be positive")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print the table, write JSON if asked; returns the JSON figures."""
    args = parse_args(argv)
    out = sys.stderr if args.json == "-" else sys.stdout
    say = Console()  # progress, on stderr
    rng = random.Random(args.seed)
    _warm_up()
    sizes = []
    for n in tracked(args.entries, "bench_cache", "size", say=say):
        sizes.append(_bench_size(n, args, rng, say))
        gc.collect()
    result = {
        "config": {"entries": args.entries, "tokens": args.tokens, "block": args.block,
                   "system": args.system, "repeats": args.repeats, "warmup": args.warmup,
                   "queries_per_case": QUERIES_PER_CASE, "vocab": VOCAB, "seed": args.seed,
                   "timer_overhead_ns": _timer_overhead_ns(), "gc": "enabled",
                   "python": platform.python_version()},
        "sizes": sizes,
    }
    result["verdict"] = _verdict(sizes)
    print(_table(result), file=out, flush=True)
    plots.write(result, args.json, "bench_cache")
    return result


if __name__ == "__main__":
    guarded(main)
