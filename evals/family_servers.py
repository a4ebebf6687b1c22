"""The family table server to server, as the specification's table measures it: `skippy
serve` over HTTP against `python -m llama_cpp.server` on the same file (Q4_0 held as int4
on our side, or Q8_0 as int8), one family at a time, both servers up and the requests
alternated between them.

    python -m skippy.evals.family_matrix --servers [--family NAME ...] [--repeats 3]

Rows (`/v1/completions`, temperature 0, 1 token; each repeat with prompts of its own, so
that nothing but the row's shared part is ever cached):
- warm_hit: a 128-token prefix seen once (untimed), then the prefix and 1 new token.
- changed_tail_16, changed_tail_64: a 512-token prefix seen once, then new 16- and
  64-token tails.
- next_turn: a 256-token prompt answered with 32 tokens (untimed), then the prompt, that
  reply and 16 new tokens (each server continues its own reply).
- diverge_1000 (hybrid and recurrent families): a 1,024-token prompt seen once, then its
  first 1,000 tokens and 24 new ones.
A prompt is text of words that are one token each with their space before them, so that
both servers (one vocabulary) cut it into the same tokens at every word. No timed request
asks for log-probabilities (llama-cpp-python then spends hundreds of milliseconds on its
own); after each timed answer of ours the prompt is asked again with its log-probability
(answered from the timed request's logits, which the last stage keeps as the prompt's
result) and in a cache namespace of its own (`cache_salt`), where nothing is cached: the
token and its log-probability must be the same bits, or the run fails. The speedup is
llama.cpp's median over ours.
"""

from __future__ import annotations

import random
import re
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from skippy.evals.bench_gateway import HOST, REFERENCE, ServerConfig, ServerProcess, free_port

REPLY = 32
# row -> (shared prefix tokens, request tokens); next_turn's reply counted at its length
ROW_TOKENS = {"warm_hit": (128, 129), "changed_tail_16": (512, 528),
              "changed_tail_64": (512, 576), "next_turn": (256 + REPLY, 256 + REPLY + 16),
              "diverge_1000": (1000, 1024)}
ROWS = tuple(ROW_TOKENS)
N_CTX = 2048
TIMEOUT_S = 600.0
OURS = ServerConfig("ours_1_torch", "ours 1 stage torch", True, 1, "torch")
FORMATS = {"q4_0": "int4", "q8_0": "int8"}  # the file's format -> ours held as


class Mismatch(AssertionError):
    """A warm answer of ours differs from the same prompt computed cold."""


@dataclass(frozen=True)
class Timed:
    """One timed request: its prompt, and what must be sent first (untimed) so that the
    row's shared part is warm."""
    row: str
    warm: tuple[str, ...]   # prompts sent before, untimed (next_turn: answered at length)
    prompt: str             # next_turn: "{reply}" stands where each server's reply goes


class Words:
    """Words that are one token with a space before them, drawn by a seeded generator."""

    def __init__(self, vocab: list[str], seed: int):
        self.vocab, self.rng = vocab, random.Random(seed)

    def text(self, n: int) -> str:
        return "".join(" " + self.rng.choice(self.vocab) for _ in range(n))


def one_token_words(encode: Callable[[str], list[int]], decode: Callable[[int], str],
                    vocab_size: int, limit: int = 2000) -> list[str]:
    """Lower-case words of 3-8 letters that `encode` turns into exactly one token each,
    with a space before them."""
    out = []
    for i in range(vocab_size):
        w = decode(i).strip()
        if re.fullmatch(r"[a-z]{3,8}", w) and encode(" " + w) == [i]:
            out.append(w)
            if len(out) == limit:
                break
    if len(out) < 50:
        raise RuntimeError(f"the vocabulary has only {len(out)} one-token words")
    return out


def plan(words: Words, repeats: int, hybrid: bool) -> list[list[Timed]]:
    """The timed requests of each repeat, every row once per repeat."""
    repeats_out = []
    for _ in range(repeats):
        p128, p512, p256, p1024 = (words.text(n) for n in (128, 512, 256, 1024))
        head1000 = " ".join(p1024.split(" ")[:1001])  # 1,000 words after the leading ""
        rows = [Timed("warm_hit", (p128 + words.text(1),), p128 + words.text(1)),
                Timed("changed_tail_16", (p512 + words.text(16),), p512 + words.text(16)),
                Timed("changed_tail_64", (p512 + words.text(64),), p512 + words.text(64)),
                Timed("next_turn", (p256,), p256 + "{reply}" + words.text(16))]
        if hybrid:
            rows.append(Timed("diverge_1000", (p1024,), head1000 + words.text(24)))
        repeats_out.append(rows)
    return repeats_out


def _ask(client: httpx.Client, url: str, prompt: str, max_tokens: int,
         salt: str | None = None, logprobs: bool = False) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if logprobs:
        body["logprobs"] = 1
    if salt is not None:
        body["cache_salt"] = salt
    r = client.post(url + "/v1/completions", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
    return r.json()


def _answer(reply: dict) -> tuple:
    """What must be bitwise equal: the text and the log-probability of each token."""
    choice = reply["choices"][0]
    return choice["text"], tuple((choice.get("logprobs") or {}).get("token_logprobs") or ())


def run_rows(urls: dict[str, str], repeats: list[list[Timed]], say=print) -> dict:
    """Each repeat's rows on every server in turn (the order alternating per repeat); ms
    per timed request by server and row, and our answers checked against cold ones."""
    ms = {key: {row: [] for row in ROWS} for key in urls}
    with httpx.Client(timeout=TIMEOUT_S) as client:
        for i, rows in enumerate(repeats):
            order = list(urls) if i % 2 == 0 else list(urls)[::-1]
            for t in rows:
                for key in order:
                    url = urls[key]
                    reply = ""
                    for w in t.warm:
                        got = _ask(client, url, w, REPLY if "{reply}" in t.prompt else 1)
                        reply = got["choices"][0]["text"]
                    prompt = t.prompt.replace("{reply}", reply)
                    start = time.perf_counter()
                    got = _ask(client, url, prompt, 1)
                    ms[key][t.row].append((time.perf_counter() - start) * 1e3)
                    if key == OURS.key:  # the timed logits, kept as the prompt's result
                        warm = _ask(client, url, prompt, 1, logprobs=True)
                        cold = _ask(client, url, prompt, 1, uuid.uuid4().hex, logprobs=True)
                        if _answer(warm) != _answer(cold) or \
                                got["choices"][0]["text"] != warm["choices"][0]["text"]:
                            raise Mismatch(f"{t.row}: warm {_answer(warm)} != cold "
                                           f"{_answer(cold)}")
            say(f"  repeat {i + 1}/{len(repeats)} done")
    return ms


def serve_family(path: Path, fmt: str, *, repeats: int, hybrid: bool, seed: int = 1,
                 say=print) -> dict:
    """Both servers on `path` (a GGUF in `fmt`), the rows alternated between them; medians
    and speedups per row."""
    from skippy.mesh.tokenizer import Tokenizer

    tok = Tokenizer(path)
    try:
        vocab = one_token_words(lambda s: tok.encode(s, add_special=False),
                                lambda i: tok.decode([i]), tok.vocab_size)
    finally:
        tok.close()
    repeats_plan = plan(Words(vocab, seed), repeats, hybrid)
    servers, urls = {}, {}
    env = {"RAY_AUTH_MODE": "disabled"}
    try:
        for cfg in (REFERENCE, OURS):
            port = free_port()
            command = cfg.command(path, "m", port, N_CTX)
            if cfg.ours:
                command += ["--weight-format", FORMATS[fmt]]
            servers[cfg.key] = ServerProcess(command, f"http://{HOST}:{port}",
                                             cfg.ready_path, env)
            say(f"  [{cfg.label}] ready in {servers[cfg.key].start():.1f} s")
            urls[cfg.key] = servers[cfg.key].url
        ms = run_rows(urls, repeats_plan, say)
    finally:
        for s in servers.values():
            s.stop()
    rows = {}
    for row in ROWS:
        ref, ours = ms[REFERENCE.key][row], ms[OURS.key][row]
        if ref and ours:
            r, o = statistics.median(ref), statistics.median(ours)
            shared, n = ROW_TOKENS[row]
            rows[row] = {"prefix_tokens": shared, "request_tokens": n,
                         "llama_cpp_ms": r, "ours_ms": o, "speedup": r / o,
                         "llama_cpp_samples": ref, "ours_samples": ours, "bitwise": True}
    return {"format": fmt, "ours_format": FORMATS[fmt], "rows": rows}
