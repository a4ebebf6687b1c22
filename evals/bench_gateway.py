"""Our OpenAI server (`skippy serve`) against llama-cpp-python's server, over HTTP.

Both serve the same GGUF (requantized to a llama.cpp fast path, Q4_0 by default) with the
same context and 2 threads; each runs as its own process, one server at a time (2 cores:
two servers at once would time each other). The same scenarios go to every server:

- repeat: one 128-token prompt sent again and again, max_tokens 1, temperature 0
  (the first request is a discarded warm-up);
- file_order: the corpus records in file order as chat requests, max_tokens 1;
- interleaved: the same records, the use cases round-robin (record i of each use case
  in turn), max_tokens 1;
- next_turn: the next chat turn, as an agent or a chat client sends it: a record's
  messages answered with max_tokens 32 (untimed), then those messages, that reply and a
  new user message, max_tokens 1 (timed): a server that kept the reply's rows computes
  only the new message;
- concurrent: 8 clients at once, each sending a few distinct short chat requests with
  max_tokens 16; aggregate completion tokens per second (`--clients 1,2,4,8`: each count
  in turn, fewer first; the largest is the one compared).

Records whose prompt does not fit the context (prompt + max_tokens + a margin, counted
with the model's own chat template and vocabulary) are skipped on every server alike.
Our server gets a fresh cache namespace (`cache_salt`) per scenario, so nothing one
scenario cached answers another; llama.cpp keeps only its last prompt anyway.

Our server runs three ways: one stage on the llama.cpp runtime (TARGETS apply to it), one
stage on the torch runtime (what `skippy serve` runs without --stages) and two stages on
the torch runtime (SPLIT_TARGETS apply). llama.cpp's server runs with flash attention,
at its fastest. Run it in a loopback-only namespace:

    unshare -n bash -c 'ip link set lo up; RAY_AUTH_MODE=disabled \\
        .venv/bin/python -m skippy.evals.bench_gateway --json gateway.json'

Servers run one after another, so a machine whose speed drifts (seen here: llama.cpp's
own one-token decode at 9.0 ms, then 15 ms twenty minutes later, nothing else running)
puts that drift into the ratios. Before each server and once at the end, with no server
up, the bench times a fixed piece of llama.cpp work in-process (`machine_speed`: one-token
decodes on the same file, the reference's own kernels) and prints each reading beside the
table, with their spread. `--rounds N` runs the whole bench N times, the servers in
turn, the order reversed each round (each server started afresh each round, ours in cache
namespaces of their own): a speedup is then the median of the rounds' ratios, each from a
pair that ran back to back, so the drift leaves it (evals/rounds.py merges the rest).
Servers are not kept up between their turns: an idle `skippy serve` (its Ray processes)
takes ~3 % of a core, which would slow whichever server runs beside it.

Servers listen on free loopback ports and are always killed (their whole process group)
when the bench ends, also on Ctrl-C or an error. `--json P` also draws P.png: speedup per
scenario and per corpus use case, and tokens/s by concurrent clients.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from skippy.mesh.progress import tracked
from skippy.evals import plots, rounds
from skippy.evals.ceiling import ceiling_line, concurrent_ceiling
from skippy.evals.entry import guarded

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "usecases.jsonl"
HOST = "127.0.0.1"
THREADS = 2
REPEAT_PROMPT_TOKENS = 128
CONTEXT_MARGIN = 16        # tokens kept free beyond prompt + max_tokens (template drift)
START_TIMEOUT_S = 900.0
REQUEST_TIMEOUT_S = 900.0

# speedup the single-stage llama.cpp-runtime server must reach per scenario (llama.cpp /
# ours for latency, ours / llama.cpp for tokens per second)
TARGETS = {"repeat": 1.5, "file_order": 1.2, "interleaved": 5.0, "concurrent": 2.0}
# ... and the split torch path (issue 18: the split path at llama.cpp's speed)
SPLIT_TARGETS = {"file_order": 1.0, "concurrent": 1.0}
SCENARIOS = ("repeat", "file_order", "interleaved", "next_turn", "concurrent", "stream",
             "long_stream")
LABELS = {"repeat": "(a) exact repeat 128 tok", "file_order": "(b) corpus, file order",
          "interleaved": "(c) corpus, interleaved", "concurrent": "(d) 8 clients, 16 tok",
          "stream": "(e) one stream, ms/token", "next_turn": "(f) the next chat turn",
          "long_stream": "(g) 256-token streams, ms/token"}
# (e): streamed chats alone, after one warm-up; 3 a server were too few to tell a 10 %
# difference apart on this VM (one chat's ms/token moves by 30 % from the next's)
STREAM_TOKENS, STREAMS = 64, 8
# (g): greedy 256-token answers to corpus records of these use cases, streamed one at a
# time (speculation pays where answers repeat their input: code; open chat must not lose)
LONG_TOKENS, LONG_RECORDS = 256, 2
LONG_USE_CASES = ("code_refinement", "issue_fixing", "open_chat")
# (f): records (round-robin over use cases), the reply's length, and the next message
NEXT_TURNS, REPLY_TOKENS = 8, 32
NEXT_MESSAGE = "Thanks. Now put that in one short sentence."
# what the concurrent scenario keeps of each smaller client count it ran first
SWEEP_KEYS = ("clients", "requests", "completion_tokens", "wall_s", "tokens_per_s",
              "median_ms", "p95_ms", "errors")

# distinct short questions for the concurrent scenario (a client/request tag keeps every
# prompt unique, so no server answers one from an earlier identical request)
QUESTIONS = (
    "Why do leaves change colour in autumn?", "How does a bicycle stay upright?",
    "What makes bread rise?", "Explain what a prime number is.",
    "Why is the sea salty?", "How do bees find flowers?",
    "What is the difference between weather and climate?", "How does a compass work?",
    "Why do we have seasons?", "What does a database index do?",
    "How do vaccines train the immune system?", "Why is the sky dark at night?",
    "What is a hash function used for?", "How does a refrigerator keep food cold?",
    "Why do cats purr?", "What causes thunder?",
)


# -- configurations ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ServerConfig:
    """One server to bench: ours with `stages` x `runtime`, or the reference."""
    key: str
    label: str
    ours: bool
    stages: int = 1
    runtime: str = "llama.cpp"
    targets: dict | None = None   # the speedups this configuration must reach
    extra: tuple[str, ...] = ()   # more of the server's own flags

    def command(self, model_path: Path, model_name: str, port: int, n_ctx: int) -> list[str]:
        if self.ours:
            return [sys.executable, "-m", "skippy.mesh.cli", "serve", "--model", str(model_path),
                    "--model-name", model_name, "--stages", str(self.stages),
                    "--runtime", self.runtime, "--host", HOST, "--port", str(port),
                    "--ctx", str(n_ctx), *self.extra]
        return [sys.executable, "-m", "llama_cpp.server", "--model", str(model_path),
                "--model_alias", model_name, "--n_ctx", str(n_ctx),
                "--n_threads", str(THREADS), "--n_threads_batch", str(THREADS),
                "--flash_attn", "true", "--host", HOST, "--port", str(port), *self.extra]

    @property
    def ready_path(self) -> str:
        return "/health" if self.ours else "/v1/models"


REFERENCE = ServerConfig("reference", "llama.cpp server", ours=False)
OURS = (ServerConfig("ours_1_llama.cpp", "ours 1 stage llama.cpp", True, 1, "llama.cpp",
                     TARGETS),
        ServerConfig("ours_1_torch", "ours 1 stage torch", True, 1, "torch"),
        ServerConfig("ours_2_torch", "ours 2 stages torch", True, 2, "torch", SPLIT_TARGETS))
# speculation's comparisons (--server KEY): llama.cpp's own prompt lookup, ours without it
REFERENCE_LOOKUP = ServerConfig("reference_lookup", "llama.cpp server, prompt lookup",
                                ours=False, extra=("--draft_model", "prompt-lookup-decoding",
                                                   "--draft_model_num_pred_tokens", "10"))
OURS_NO_SPECULATION = ServerConfig("ours_2_torch_nospec", "ours 2 stages torch, no "
                                   "speculation", True, 2, "torch", extra=("--speculate", "off"))
ALL = (REFERENCE, *OURS, REFERENCE_LOOKUP, OURS_NO_SPECULATION)


# -- scenarios (pure) -------------------------------------------------------------------------
def use_cases_in_order(records: Iterable[dict]) -> list[str]:
    """Use-case names in the order they first appear."""
    return list(dict.fromkeys(r["use_case"] for r in records))


def interleave(records: list[dict]) -> list[dict]:
    """Record 0 of each use case, then record 1 of each, ... (use cases in first-seen order;
    a use case with fewer records drops out of later rounds)."""
    groups: dict[str, list[dict]] = {name: [] for name in use_cases_in_order(records)}
    for r in records:
        groups[r["use_case"]].append(r)
    rounds = max((len(g) for g in groups.values()), default=0)
    return [g[i] for i in range(rounds) for g in groups.values() if i < len(g)]


def split_by_context(records: list[dict], count_tokens: Callable[[list[dict]], int],
                     n_ctx: int, max_tokens: int,
                     margin: int = CONTEXT_MARGIN) -> tuple[list[dict], list[dict]]:
    """(records that fit, records over the context): a record fits when its rendered chat
    prompt + max_tokens + margin <= n_ctx."""
    fit, over = [], []
    for r in records:
        (fit if count_tokens(r["messages"]) + max_tokens + margin <= n_ctx else over).append(r)
    return fit, over


def chat_body(model: str, messages: list[dict], max_tokens: int) -> dict:
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}


def concurrent_messages(clients: int, requests: int) -> list[list[list[dict]]]:
    """Per client, its requests' messages; every prompt differs from every other."""
    out = []
    for c in range(clients):
        mine = []
        for j in range(requests):
            q = QUESTIONS[(c * requests + j) % len(QUESTIONS)]
            mine.append([{"role": "user", "content": f"{q} (client {c}, question {j + 1})"}])
        out.append(mine)
    return out


def repeat_prompt(text: str, encode: Callable[[str], list[int]],
                  decode: Callable[[list[int]], str],
                  n: int = REPEAT_PROMPT_TOKENS) -> tuple[str, int]:
    """A prefix of `text` that encodes to n tokens (or as close as the vocabulary allows:
    decode/encode need not round-trip), and its token count."""
    ids = encode(text)
    while len(ids) < n + 8:
        text = text + "\n" + text
        ids = encode(text)
    special = len(encode("")) if encode("") else 0   # BOS the encoder adds, if any
    best: tuple[str, int] | None = None
    for k in range(n - special, n - special + 8):
        piece = decode(ids[special:special + k])
        got = len(encode(piece))
        if best is None or abs(got - n) < abs(best[1] - n):
            best = (piece, got)
        if got == n:
            break
    return best


# -- statistics (pure) ------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile: the smallest value with at least q % of values at or below."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def summarize(samples_ms: list[float]) -> dict:
    return {"n": len(samples_ms),
            "median_ms": statistics.median(samples_ms) if samples_ms else math.nan,
            "p95_ms": percentile(samples_ms, 95),
            "total_s": sum(samples_ms) / 1e3}


def speedup(scenario: str, ours: dict, reference: dict) -> float:
    """How many times better ours is: latency llama.cpp / ours; tokens/s ours / llama.cpp."""
    if scenario == "concurrent":
        a, b = ours.get("tokens_per_s", math.nan), reference.get("tokens_per_s", math.nan)
    else:
        a, b = reference.get("median_ms", math.nan), ours.get("median_ms", math.nan)
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def comparisons(servers: dict, configs: Iterable[ServerConfig] = OURS) -> list[dict]:
    """One row per scenario and configuration of ours that ran: figures, speedup, target."""
    ref = servers.get(REFERENCE.key, {}).get("scenarios", {})
    ref_rounds = servers.get(REFERENCE.key, {}).get("rounds") or []
    rows = []
    for scenario in SCENARIOS:
        if scenario == "long_stream":  # by use case, every server: its own table
            continue
        for cfg in configs:
            ours = servers.get(cfg.key, {}).get("scenarios", {}).get(scenario)
            if ours is None or scenario not in ref:
                continue
            ratio = speedup(scenario, ours, ref[scenario])
            # in rounds, the median of the rounds' ratios (each pair ran back to back)
            per_round = rounds.paired(lambda o, r, s=scenario: speedup(s, o[s], r[s]),
                                      servers[cfg.key].get("rounds") or [], ref_rounds)
            target = (cfg.targets or {}).get(scenario)
            row = {"scenario": scenario, "config": cfg.key, "label": cfg.label,
                   "ours": _headline(scenario, ours),
                   "reference": _headline(scenario, ref[scenario])}
            if len(per_round) > 1:
                ratio = statistics.median(per_round)
                row["round_speedups"] = per_round
            rows.append({**row, "speedup": ratio, "target": target,
                         "met": None if target is None else bool(ratio >= target)})
    return rows


def _headline(scenario: str, s: dict) -> dict:
    keys = ("tokens_per_s", "median_ms", "p95_ms") if scenario == "concurrent" \
        else ("median_ms", "p95_ms")
    return {k: s.get(k, math.nan) for k in keys}


def table(result: dict) -> str:
    s = result["settings"]
    lines = [
        f"gateway bench: {s['model']} ({Path(s['file']).name}), context {s['n_ctx']}, "
        f"{THREADS} threads per server, one server at a time"
        + (f", in turn for {s['rounds']} rounds" if s.get("rounds", 1) > 1 else ""),
        f"records: {s['records']} ({s['over_context']} over the context skipped on every "
        f"server); repeat: {s['repeats']} after 1 warm-up; concurrent: {s['clients']} "
        f"clients x {s['requests_per_client']} requests",
        "latency in ms (median, p95 per request); (d): aggregate completion tokens/s; "
        "speedup: llama.cpp/ours for latency, ours/llama.cpp for tokens/s",
        "",
        f"{'scenario':<26} {'server':<24} {'ours p50':>9} {'p95':>8} {'llama.cpp p50':>14} "
        f"{'p95':>8} {'speedup':>8} {'target':>7} {'met':>4}",
    ]
    for row in result["comparisons"]:
        o, r = row["ours"], row["reference"]
        if row["scenario"] == "concurrent":
            cells = (f"{o['tokens_per_s']:>7.1f}/s", f"{'':>8}", f"{r['tokens_per_s']:>12.1f}/s",
                     f"{'':>8}")
        else:
            cells = (f"{o['median_ms']:>9.1f}", f"{o['p95_ms']:>8.1f}",
                     f"{r['median_ms']:>14.1f}", f"{r['p95_ms']:>8.1f}")
        target = f"{row['target']:.1f}x" if row["target"] else "-"
        met = "-" if row["met"] is None else ("yes" if row["met"] else "NO")
        lines.append(f"{LABELS[row['scenario']]:<26} {row['label']:<24} {' '.join(cells)} "
                     f"{row['speedup']:>7.2f}x {target:>7} {met:>4}")
    in_rounds = [r for r in result["comparisons"] if len(r.get("round_speedups") or []) > 1]
    if in_rounds:
        lines += ["", f"in {result['settings']['rounds']} rounds, the servers in turn: a "
                  "speedup is the median of the rounds' below (figures: samples pooled, "
                  "tokens/s the rounds' median)"]
        lines += [f"  {LABELS[r['scenario']]:<26} {r['label']:<24} "
                  + " / ".join(f"{x:.2f}" for x in r["round_speedups"]) for r in in_rounds]
    if result.get("ceiling"):
        lines.append(ceiling_line(result["ceiling"]))
    lines += long_stream_lines(result["servers"])
    errors = [f"{key} {name}: {sc['errors']}" for key, srv in result["servers"].items()
              for name, sc in srv.get("scenarios", {}).items() if sc.get("errors")]
    if errors:
        lines += ["", "failed requests (left out of the figures): " + "; ".join(errors)]
    failed = [f"{key}: {srv['error']}" for key, srv in result["servers"].items()
              if srv.get("error")]
    if failed:
        lines += ["", "servers that failed: " + "; ".join(failed)]
    lines.append(f"load average before/after: {result['loadavg_before']} / "
                 f"{result['loadavg_after']} (2 cores: above ~1 the figures are noisy)")
    speed = speed_line(result)
    if speed:
        lines.append(speed)
    return "\n".join(lines)


def speculation_figures(base_url: str) -> dict:
    """Our server's verify steps and the tokens they proposed and accepted, summed over
    every scenario it ran (its /metrics)."""
    text = httpx.get(base_url + "/metrics", timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("skippy_speculation_") and "_total" in line:
            name = line.split("{")[0].split(" ")[0][len("skippy_speculation_"):-len("_total")]
            out[name] = out.get(name, 0) + float(line.rsplit(" ", 1)[1])
    return out


def long_stream_lines(servers: dict) -> list[str]:
    """(g): each server's median ms per token by use case, and each one's speculation
    figures where it reports them."""
    ran = {srv["label"]: srv["scenarios"]["long_stream"]["by_use_case"]
           for srv in servers.values() if "long_stream" in srv.get("scenarios", {})}
    if not ran:
        return []
    lines = ["", f"{LABELS['long_stream']} (greedy, {LONG_RECORDS} records per use case, "
             f"median ms/token)", f"{'server':<40} " + " ".join(
                 f"{u:>16}" for u in LONG_USE_CASES)]
    for label, cases in ran.items():
        lines.append(f"{label:<40} " + " ".join(
            f"{cases.get(u, {}).get('median_ms', math.nan):>16.1f}" for u in LONG_USE_CASES))
    for srv in servers.values():
        sp = srv.get("speculation") or {}
        if sp.get("proposed_tokens"):
            lines.append(f"{srv['label']}: {sp['accepted_tokens']:.0f} of "
                         f"{sp['proposed_tokens']:.0f} proposed tokens accepted "
                         f"({sp['accepted_tokens'] / sp['proposed_tokens']:.0%}) in "
                         f"{sp['verify_steps']:.0f} verify steps")
    return lines


# -- plot ---------------------------------------------------------------------------------------
def _by_use_case(ours: dict, reference: dict) -> dict[str, float]:
    """llama.cpp's median ms / ours per use case, from the samples' tags."""
    def medians(s: dict) -> dict[str, float]:
        groups: dict[str, list[float]] = {}
        for tag, ms in zip(s.get("tags") or [], s["samples_ms"]):
            groups.setdefault(tag, []).append(ms)
        return {k: statistics.median(v) for k, v in groups.items()}
    a, b = medians(ours), medians(reference)
    return {k: b[k] / a[k] for k in a if k in b and a[k] > 0}


def plot(result: dict):
    """Speedup per scenario and server, targets marked (top left); per use case, in file
    order and interleaved (top right, bottom left); tokens/s by concurrent clients, every
    server (bottom right)."""
    fig, ((scen, order), (inter, tput)) = plots.figure(2, 2, width=6.8, height=4.2, title=(
        f"gateway bench: {result['settings']['model']} ({Path(result['settings']['file']).name})"
        ", ours vs llama.cpp's server over HTTP"))
    rows = result["comparisons"]
    scenarios = list(dict.fromkeys(r["scenario"] for r in rows))
    labels = list(dict.fromkeys(r["label"] for r in rows))
    by = {(r["scenario"], r["label"]): r for r in rows}
    # one colour per server in every panel; orange is the reference's
    color = {REFERENCE.label: plots.REFERENCE,
             **{c.label: f"C{i}" for i, c in zip((0, 2, 3), OURS)}}
    plots.bars(scen, [LABELS[s] for s in scenarios],
               {lb: [by[(s, lb)]["speedup"] if (s, lb) in by else 0 for s in scenarios]
                for lb in labels}, rotate=True, colors=[color[lb] for lb in labels])
    plots.target_marks(scen, [(scenarios.index(s), labels.index(lb), r["target"])
                              for (s, lb), r in by.items() if r["target"]],
                       len(scenarios), len(labels))
    scen.axhline(1.0, color="grey", linewidth=0.8)
    plots.finish(scen, title="speedup per scenario",
                 ylabel="x llama.cpp (latency: theirs/ours, tok/s: ours/theirs)")
    servers = result["servers"]
    ref = servers.get(REFERENCE.key, {}).get("scenarios", {})
    for ax, scenario in ((order, "file_order"), (inter, "interleaved")):
        per = {cfg.label: _by_use_case(servers[cfg.key]["scenarios"][scenario], ref[scenario])
               for cfg in OURS if scenario in ref
               and scenario in servers.get(cfg.key, {}).get("scenarios", {})}
        cases = list(dict.fromkeys(c for v in per.values() for c in v))
        if not cases:
            plots.empty(ax, f"no {LABELS[scenario]} samples tagged by use case")
            continue
        plots.bars(ax, cases, {lb: [v.get(c, 0) for c in cases] for lb, v in per.items()},
                   rotate=True, colors=[color[lb] for lb in per])
        ax.axhline(1.0, color="grey", linewidth=0.8)
        plots.finish(ax, title=f"speedup per use case, {LABELS[scenario]}",
                     ylabel="llama.cpp median ms / ours")
    counts = set()
    for key, srv in servers.items():
        c = srv.get("scenarios", {}).get("concurrent")
        if c:
            points = sorted([*c.get("sweep", []), c], key=lambda p: p["clients"])
            counts |= {p["clients"] for p in points}
            tput.plot([p["clients"] for p in points], [p["tokens_per_s"] for p in points],
                      "s--" if key == REFERENCE.key else "o-", label=srv["label"],
                      color=color.get(srv["label"]))
    tput.set_xticks(sorted(counts))
    plots.finish(tput, title=f"concurrent clients, each sending "
                              f"{result['settings']['requests_per_client']} chat(s) of 16 tokens",
                 xlabel="clients", ylabel="completion tokens/s (all clients)")
    return fig


# -- servers ------------------------------------------------------------------------------------
def free_port(host: str = HOST) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _children_by_parent() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        out.setdefault(ppid, []).append(int(name))
    return out


def descendants(root: int) -> set[int]:
    """Every live process below `root` (Linux /proc; empty elsewhere)."""
    if not os.path.isdir("/proc"):
        return set()
    tree, found, todo = _children_by_parent(), set(), [root]
    while todo:
        for child in tree.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _running(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@dataclass
class ServerProcess:
    """A server as a subprocess in its own process group, logging to a file."""
    command: list[str]
    url: str
    ready_path: str
    env: dict = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    _known: set = field(default_factory=set)

    def start(self, timeout: float = START_TIMEOUT_S) -> float:
        """Start and wait until `ready_path` answers 200; seconds it took."""
        fd, name = tempfile.mkstemp(prefix="bench-gateway-", suffix=".log")
        self.log_path = Path(name)
        t0 = time.monotonic()
        with os.fdopen(fd, "wb") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         env={**os.environ, **self.env})
        deadline = t0 + timeout
        with httpx.Client(timeout=5.0) as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the server exited with code {self.proc.returncode} "
                                       f"before it was ready:\n{self.log_tail()}")
                try:
                    if client.get(self.url + self.ready_path).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the server was not ready after {timeout:.0f} s:\n"
                                       f"{self.log_tail()}")
                time.sleep(0.5)
        self._known |= descendants(self.proc.pid)
        return time.monotonic() - t0

    def log_tail(self, lines: int = 20) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, grace: float = 20.0) -> None:
        """SIGINT to the server (ours then closes its engine and Ray), then SIGKILL to its
        process group and to every process it started, wherever they went."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        pids = self._known | descendants(proc.pid)
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGINT)
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        pids |= descendants(proc.pid)
        for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL),
                     *(lambda p=p: os.kill(p, signal.SIGKILL) for p in pids)):
            try:
                kill()
            except (ProcessLookupError, PermissionError):
                pass
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 10   # SIGKILL lands asynchronously
        while any(_running(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> ServerProcess:  # noqa: PYI034
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# -- clients --------------------------------------------------------------------------------------
def post(client: httpx.Client, url: str, body: dict) -> tuple[float, dict | None, str | None]:
    """(seconds, response JSON or None, error or None) for one non-streaming request."""
    t = time.perf_counter()
    try:
        r = client.post(url, json=body)
    except httpx.HTTPError as e:
        return time.perf_counter() - t, None, f"{type(e).__name__}: {e}"
    dt = time.perf_counter() - t
    if r.status_code != 200:
        return dt, None, f"HTTP {r.status_code}: {r.text[:200]}"
    return dt, r.json(), None


def run_sequential(base_url: str, path: str, bodies: list[dict], *, warmup: int = 0,
                   tags: list[str] | None = None) -> dict:
    """The bodies one after another; latency per request (warm-ups untimed). With `tags`
    (one per body, e.g. its use case), `tags` in the result names each timed sample's."""
    samples, errors, prompt_tokens, completion_tokens, first_error = [], 0, 0, 0, None
    kept = []
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        for i, body in enumerate(bodies):
            dt, reply, error = post(client, base_url + path, body)
            if i < warmup:
                continue
            if error:
                errors += 1
                first_error = first_error or error
                continue
            samples.append(dt * 1e3)
            kept.append(None if tags is None else tags[i])
            usage = reply.get("usage") or {}
            prompt_tokens += usage.get("prompt_tokens", 0)
            completion_tokens += usage.get("completion_tokens", 0)
    out = summarize(samples)
    out.update(samples_ms=samples, errors=errors, first_error=first_error,
               prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
    if tags is not None:
        out["tags"] = kept
    return out


def run_streams(base_url: str, bodies: list[dict], *, warmup: int = 1) -> dict:
    """Streamed chats one at a time: the time per token after the first (the gap between
    the first and the last content event over the events between them)."""
    per_token, errors, first_error = [], 0, None
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        for i, body in enumerate(bodies):
            try:
                times = _content_times(client, base_url + "/v1/chat/completions", body)
            except (httpx.HTTPError, ValueError) as e:
                errors += 1
                first_error = first_error or f"{type(e).__name__}: {e}"
                continue
            if i >= warmup and len(times) > 1:
                per_token.append((times[-1] - times[0]) / (len(times) - 1) * 1e3)
    out = summarize(per_token)
    out.update(samples_ms=per_token, errors=errors, first_error=first_error)
    return out


def _content_times(client: httpx.Client, url: str, body: dict) -> list[float]:
    times = []
    with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise ValueError(f"HTTP {r.status_code}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                times.append(time.perf_counter())
    return times


def run_concurrent(base_url: str, per_client: list[list[dict]]) -> dict:
    """One thread per client, all released together, each sending its bodies in turn;
    aggregate completion tokens over the wall time from release to the last answer."""
    latencies: list[float] = []
    tokens, prompt, errors, first_error = [0], [0], [0], [None]
    lock = threading.Lock()
    barrier = threading.Barrier(len(per_client) + 1)

    def client_loop(bodies: list[dict]) -> None:
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
            barrier.wait()
            for body in bodies:
                dt, reply, error = post(client, base_url + "/v1/chat/completions", body)
                with lock:
                    if error:
                        errors[0] += 1
                        first_error[0] = first_error[0] or error
                    else:
                        latencies.append(dt * 1e3)
                        usage = reply.get("usage") or {}
                        tokens[0] += usage.get("completion_tokens", 0)
                        prompt[0] += usage.get("prompt_tokens", 0)

    threads = [threading.Thread(target=client_loop, args=(b,), daemon=True) for b in per_client]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    out = summarize(latencies)
    out.update(clients=len(per_client), requests=sum(len(b) for b in per_client),
               completion_tokens=tokens[0], prompt_tokens=prompt[0], wall_s=wall,
               tokens_per_s=tokens[0] / wall if wall > 0 else math.nan,
               samples_ms=latencies, errors=errors[0], first_error=first_error[0])
    return out


def run_next_turns(base_url: str, model: str, records: list[dict], salt=lambda b: b) -> dict:
    """Per record: its messages answered (REPLY_TOKENS, untimed), then the next turn
    (1 token, timed); `cached_tokens` per timed request where the server reports it."""
    samples, cached, errors, first_error = [], [], 0, None
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        for r in records:
            url = base_url + "/v1/chat/completions"
            _, reply, error = post(client, url, salt(chat_body(model, r["messages"],
                                                               REPLY_TOKENS)))
            if error is None:
                answer = reply["choices"][0]["message"].get("content") or ""
                messages = [*r["messages"], {"role": "assistant", "content": answer},
                            {"role": "user", "content": NEXT_MESSAGE}]
                dt, reply, error = post(client, url, salt(chat_body(model, messages, 1)))
            if error:
                errors += 1
                first_error = first_error or error
                continue
            samples.append(dt * 1e3)
            details = (reply.get("usage") or {}).get("prompt_tokens_details") or {}
            cached.append(details.get("cached_tokens"))
    out = summarize(samples)
    out.update(samples_ms=samples, cached_tokens=cached, errors=errors,
               first_error=first_error)
    return out


@dataclass(frozen=True)
class Workload:
    """What every server is sent: the same prompts, in the same order."""
    model: str
    repeat_text: str
    repeats: int
    file_order: list[dict]
    interleaved: list[dict]
    concurrent: list[list[list[dict]]]
    sweep: tuple[int, ...] = ()  # fewer clients to run the concurrent scenario with first
    next_turn: tuple[dict, ...] = ()  # records whose next turn fits the context
    streams: int = STREAMS  # (e)'s timed chats


def run_scenarios(base_url: str, work: Workload, *, ours: bool,
                  scenarios: Iterable[str] = SCENARIOS, say=print, round_tag: str = "") -> dict:
    """Every scenario against one running server; ours gets a cache namespace per scenario
    (and per round: `round_tag`, so that no round answers from another's cache)."""

    def salted(body: dict, scenario: str) -> dict:
        return {**body, "cache_salt": f"bench-{scenario}{round_tag}"} if ours else body

    out = {}
    for scenario in tracked(list(scenarios), "scenarios", "scenario", say=say):
        say(f"  {scenario} ...")
        if scenario == "repeat":
            body = {"model": work.model, "prompt": work.repeat_text, "max_tokens": 1,
                    "temperature": 0}
            out[scenario] = run_sequential(base_url, "/v1/completions",
                                           [salted(body, scenario)] * (work.repeats + 1),
                                           warmup=1)
        elif scenario in ("file_order", "interleaved"):
            records = work.file_order if scenario == "file_order" else work.interleaved
            bodies = [salted(chat_body(work.model, r["messages"], 1), scenario)
                      for r in records]
            out[scenario] = run_sequential(base_url, "/v1/chat/completions", bodies,
                                           tags=[r["use_case"] for r in records])
            out[scenario]["ids"] = [r.get("id") for r in records]
        elif scenario == "next_turn":
            out[scenario] = run_next_turns(base_url, work.model, list(work.next_turn),
                                           lambda b: salted(b, scenario))
        elif scenario == "concurrent":
            def run(clients: list[list[list[dict]]], salt: str) -> dict:
                return run_concurrent(base_url, [[salted(chat_body(work.model, m, 16), salt)
                                                  for m in msgs] for msgs in clients])
            # fewer clients first, each count in a namespace of its own (no shared hits)
            sweep = [run(concurrent_messages(n, len(work.concurrent[0])), f"{scenario}-{n}")
                     for n in work.sweep if n < len(work.concurrent)]
            out[scenario] = run(work.concurrent, scenario)
            out[scenario]["sweep"] = [{k: r[k] for k in SWEEP_KEYS} for r in sweep]
        elif scenario == "long_stream":
            by = {}
            for use_case in LONG_USE_CASES:
                records = [r for r in work.file_order if r["use_case"] == use_case]
                bodies = [{**chat_body(work.model, r["messages"], LONG_TOKENS),
                           "stream": True} for r in records[:LONG_RECORDS]]
                by[use_case] = run_streams(base_url, [salted(b, scenario) for b in bodies],
                                           warmup=0)
            out[scenario] = {"by_use_case": by,
                             "errors": sum(r["errors"] for r in by.values()),
                             "first_error": next((r["first_error"] for r in by.values()
                                                  if r["first_error"]), None)}
        elif scenario == "stream":
            questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(work.streams + 1)]
            bodies = [{**chat_body(work.model, [{"role": "user", "content": q}],
                                   STREAM_TOKENS), "stream": True} for q in questions]
            out[scenario] = run_streams(base_url, [salted(b, scenario) for b in bodies])
        else:
            raise ValueError(f"unknown scenario {scenario!r}")
    return out


# -- the benchmark ------------------------------------------------------------------------------
SPEED_TOKENS = 32  # one-token decodes timed by machine_speed, after a 32-token prompt


def machine_speed(path: Path, tokens: int = SPEED_TOKENS) -> float:
    """llama.cpp's in-process ms per one-token decode on `path` (bench_runtime's llama.cpp
    side: 2 threads, flash attention), the median of `tokens`: how fast this machine is
    right now."""
    from skippy.evals.bench_runtime import LlamaCpp

    side = LlamaCpp(path, THREADS, n_ctx=256)
    try:
        side.prefill(list(range(100, 132)))
        return statistics.median(side.decode([42] * tokens)) * 1e3
    finally:
        side.close()


def speed_line(result: dict) -> str | None:
    """The machine-speed readings taken before each server and at the end, and their
    spread (max / min): a spread well over 1 is drift in every ratio between servers."""
    readings = [(srv["label"], srv["machine_ms"]) for srv in result["servers"].values()
                if srv.get("machine_ms")]
    if result.get("machine_ms_after"):
        readings.append(("at the end", result["machine_ms_after"]))
    if not readings:
        return None
    values = [v for _, v in readings]
    return ("machine speed (llama.cpp in-process one-token decode, ms) before each server: "
            + " · ".join(f"{label} {v:.1f}" for label, v in readings)
            + f"; spread {max(values) / min(values):.2f}x")


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages: on 2 cores, above ~1 the figures are noisy."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def emit(result: dict, text: str, json_path: str | None, bench: str) -> None:
    """The table on stdout (stderr when the JSON goes to stdout: `json_path` "-"), and the
    figures as JSON to `json_path` when given, with the eval `bench`'s plot beside them."""
    print(text, file=sys.stderr if json_path == "-" else sys.stdout, flush=True)
    plots.write(result, json_path, bench)


def build_workload(path: Path, model_name: str, data: Path, *, n_ctx: int,
                   limit: int | None, repeats: int, clients: list[int],
                   requests: int, streams: int = STREAMS) -> tuple[Workload, dict]:
    from skippy.evals.numerics import read_corpus
    from skippy.mesh.front.chat import load_chat_template
    from skippy.mesh.tokenizer import Tokenizer

    tok = Tokenizer(path)
    template = load_chat_template(tok)
    records = read_corpus(data, per_use_case=limit)
    fit, over = split_by_context(records, lambda m: len(tok.encode(template.render(m))),
                                 n_ctx, max_tokens=1)
    text = "\n\n".join(m["content"] for m in records[0]["messages"]) if records else \
        " ".join(QUESTIONS)
    repeat_text, repeat_tokens = repeat_prompt(text, tok.encode, tok.decode)
    # the next turn adds the reply and a message: room for them and the margin
    turns, _ = split_by_context(interleave(fit), lambda m: len(tok.encode(template.render(m))),
                                n_ctx, max_tokens=REPLY_TOKENS + 64)
    tok.close()
    work = Workload(model_name, repeat_text, repeats, fit, interleave(fit),
                    concurrent_messages(max(clients), requests), tuple(sorted(clients)[:-1]),
                    tuple(turns[:NEXT_TURNS]), streams)
    facts = {"records": len(fit), "over_context": len(over),
             "over_context_ids": [r.get("id") for r in over],
             "repeat_prompt_tokens": repeat_tokens}
    return work, facts


def bench(args) -> dict:
    from skippy.mesh.models import requantize, resolve_model
    from skippy.mesh.progress import Console

    say = Console()  # progress, on stderr
    src = resolve_model(args.model)
    path = src if args.format == "shipped" else requantize(src, args.format)
    work, facts = build_workload(path, args.model, args.data, n_ctx=args.ctx, limit=args.limit,
                                 repeats=args.repeats, clients=args.clients,
                                 requests=args.requests, streams=args.streams)
    configs = [c for c in ALL if c.key in args.servers]
    result = {"settings": {"model": args.model, "file": str(path), "n_ctx": args.ctx,
                           "threads": THREADS, "repeats": args.repeats, "limit": args.limit,
                           "rounds": args.rounds,
                           "clients": max(args.clients), "clients_sweep": args.clients,
                           "requests_per_client": args.requests,
                           **facts},
              "environment": where_it_runs(), "ours_env": dict(args.ours_env),
              "reference_env": dict(args.reference_env),
              "loadavg_before": loadavg(), "servers": {}}
    for r in range(args.rounds):
        if args.rounds > 1:
            say(f"round {r + 1} of {args.rounds}")
        for cfg in configs if r % 2 == 0 else configs[::-1]:
            entry = result["servers"].setdefault(cfg.key, {"label": cfg.label})
            if not entry.get("error"):
                _run(cfg, entry, path, work, args, say, f"-r{r}" if r else "")
    for entry in result["servers"].values():
        runs = entry.pop("rounds", [])
        if runs:
            entry["scenarios"] = runs[0] if args.rounds == 1 else rounds.merge(runs, summarize)
        if args.rounds > 1:
            entry["rounds"] = runs
    result["loadavg_after"] = loadavg()
    result["machine_ms_after"] = machine_speed(path)
    result["comparisons"] = comparisons(result["servers"])
    result["targets"] = {c.key: c.targets for c in OURS if c.targets}
    if args.runtime_json is not None:
        result["ceiling"] = ceiling_of(result["servers"], json.loads(args.runtime_json.read_text()))
    return result


def _run(cfg: ServerConfig, entry: dict, path: Path, work: Workload, args, say,
         round_tag: str = "") -> None:
    """One server's round: started, timed on every scenario, stopped; the figures go to
    the entry's rounds, a failure to its error (and it runs no more rounds)."""
    port = free_port()
    command = cfg.command(path, args.model, port, args.ctx)
    if cfg.ours:
        command += args.ours_args
    env = {"RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
           **dict(args.ours_env if cfg.ours else args.reference_env)}
    server = ServerProcess(command, f"http://{HOST}:{port}", cfg.ready_path, env)
    speed = machine_speed(path)
    entry.setdefault("machine_ms", speed)
    entry["command"] = server.command
    say(f"[{cfg.label}] starting on port {port} (machine speed {speed:.1f} ms/token) ...")
    try:
        started = server.start()
        entry.setdefault("start_s", started)
        say(f"[{cfg.label}] ready in {started:.1f} s")
        entry.setdefault("rounds", []).append(run_scenarios(
            server.url, work, ours=cfg.ours, scenarios=args.scenarios, say=say,
            round_tag=round_tag))
        if cfg.ours:
            entry["speculation"] = speculation_figures(server.url)
    except RuntimeError as e:
        entry["error"] = str(e).splitlines()[0]
        say(f"[{cfg.label}] failed: {e}")
    finally:
        server.stop()


def ceiling_of(servers: dict, runtime: dict) -> dict | None:
    """The concurrent scenario's ceiling (ceiling.py) for the first of ours that ran it,
    against the reference's measured tokens/s where it ran too."""
    ours = next((s["scenarios"]["concurrent"] for key, s in servers.items()
                 if key != REFERENCE.key and "concurrent" in s.get("scenarios", {})), None)
    if ours is None:
        return None
    ref = servers.get(REFERENCE.key, {}).get("scenarios", {}).get("concurrent", {})
    return concurrent_ceiling(runtime, {**ours, "reference_tok_s": ref.get("tokens_per_s")})


def where_it_runs() -> dict:
    """The CPU and what our torch stages and llama.cpp compute with here (bench_runtime's
    record; the servers' own variables, ours_env / reference_env, may restrict them)."""
    from skippy.evals.bench_runtime import environment
    from skippy.stages.runtime import DEFAULT_WEIGHT_FORMAT

    return environment([DEFAULT_WEIGHT_FORMAT], None)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m skippy.evals.bench_gateway",
                                description="Our OpenAI server vs llama-cpp-python's server.")
    p.add_argument("--model", default="smollm2", help="shipped model name (default smollm2)")
    p.add_argument("--format", choices=("q4_0", "q8_0", "shipped"), default="q4_0",
                   help="the GGUF both serve: requantized to a llama.cpp fast path, or the "
                        "shipped file (default q4_0)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="corpus JSONL")
    p.add_argument("--ctx", type=int, default=4096, help="context of every server (4096)")
    p.add_argument("--limit", type=int, help="records per use case (default: all)")
    p.add_argument("--repeats", type=int, default=20, help="timed exact repeats (20)")
    p.add_argument("--clients", type=_counts, default=[8],
                   help="concurrent clients (8); a comma list such as 1,2,4,8 runs the "
                        "scenario with each count, fewer first (tokens/s vs clients)")
    p.add_argument("--requests", type=int, default=4, help="requests per client (4)")
    p.add_argument("--streams", type=int, default=STREAMS,
                   help=f"(e)'s streamed chats a server, after one warm-up ({STREAMS})")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the bench this many times, the servers in turn (the order "
                        "reversed each round); a speedup is then the median of the rounds' "
                        "(default 1)")
    p.add_argument("--server", action="append", dest="servers",
                   choices=[c.key for c in ALL],
                   help="bench only these servers (repeatable; default: all four)")
    p.add_argument("--ours-arg", action="append", dest="ours_args", default=[],
                   metavar="ARG", help="one more `skippy serve` argument for our servers "
                   "(repeatable), e.g. --ours-arg=--lane-batch=4")
    p.add_argument("--reference-env", action="append", dest="reference_env", default=[],
                   type=lambda kv: tuple(kv.split("=", 1)), metavar="KEY=VALUE",
                   help="one more environment variable for llama.cpp's server, e.g. "
                        "PYTHONPATH=DIR for the AVX2-only build `make llama-avx2` installs")
    p.add_argument("--ours-env", action="append", dest="ours_env", default=[],
                   type=lambda kv: tuple(kv.split("=", 1)), metavar="KEY=VALUE",
                   help="one more environment variable for our servers (repeatable), e.g. "
                        "PYTHONPATH=DIR to bench another checkout's code (before/after)")
    p.add_argument("--scenario", action="append", dest="scenarios", choices=SCENARIOS,
                   help="run only these scenarios (repeatable; default: all)")
    p.add_argument("--runtime-json", type=Path, metavar="PATH",
                   help="a bench_runtime JSON of the same file on this CPU (with its batched "
                        "decode): prints the concurrent scenario's ceiling (ceiling.py)")
    p.add_argument("--json", metavar="PATH", help="also write everything as JSON to PATH "
                                                  "('-': JSON on stdout, table on stderr)")
    args = p.parse_args(argv)
    if args.repeats < 1 or min(args.clients) < 1 or args.requests < 1 or args.ctx < 64 \
            or args.rounds < 1 or args.streams < 1 or (args.limit is not None and args.limit < 1):
        p.error("--repeats, --clients, --requests, --limit, --rounds, --streams must be >= 1, "
                "--ctx >= 64")
    args.servers = args.servers or [c.key for c in (REFERENCE, *OURS)]
    args.scenarios = [s for s in SCENARIOS if s in (args.scenarios or SCENARIOS)]
    return args


def _counts(text: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of client counts: {text!r}")
    if not values:
        raise argparse.ArgumentTypeError(f"no client count in {text!r}")
    return values


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # so that every server is stopped on the way out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    result = bench(args)
    emit(result, table(result), args.json, "bench_gateway")
    return result


if __name__ == "__main__":
    guarded(main)
