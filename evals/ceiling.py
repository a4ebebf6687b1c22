"""The most `bench_gateway`'s concurrent clients can gain over llama-cpp-python's server on
this CPU, from what `bench_runtime` measured there (its JSON) and what the scenario asked
(prompt and completion tokens, requests).

llama-cpp-python's server runs one request at a time: each prompt's prefill, then each
token's decode, one after the other. Ours runs them together: the prompts' prefills (the
stage loop runs one at a time) and every decode step with up to `lanes` rows. Neither side
can be faster than its compute at bench_runtime's speeds: for ours, every prompt row at
its prefill's cost per row plus one `lanes`-row step per `lanes` decode tokens; for the
reference, every prompt row at its own cost per row plus one decode step per token. The
ratio of the two is the ceiling of the tokens/s speedup (HTTP, scheduling and partly
filled batches only lower ours; the reference's HTTP only lowers its own, so the ceiling
against its measured figure is higher).
"""

from __future__ import annotations

import math


def concurrent_ceiling(runtime: dict, scenario: dict) -> dict:
    """`runtime`: a bench_runtime JSON (its first run, with batched decode); `scenario`:
    bench_gateway's concurrent figures (requests, prompt and completion tokens). The
    bound of each side's tokens/s, their ratio, and that against the reference's
    measured tokens/s where the scenario has it."""
    run = runtime["runs"][0]
    prefill, batched = run["prefill"][0], run["batched_decode"]
    decode_ms = run["decode"]["reference_ms"]
    lanes, step_ms = batched["lanes"], batched["step_ms"]
    rows, done = scenario["prompt_tokens"], scenario["completion_tokens"]
    decoded = max(0, done - scenario["requests"])  # each request's first token: its prefill
    ours_s = (rows * prefill["ours_ms"] / prefill["tokens"]
              + math.ceil(decoded / lanes) * step_ms) / 1e3
    ref_s = (rows * prefill["reference_ms"] / prefill["tokens"] + decoded * decode_ms) / 1e3
    out = {"ours_tok_s": done / ours_s, "reference_tok_s": done / ref_s,
           "ceiling": ref_s / ours_s, "lanes": lanes, "step_ms": step_ms}
    if scenario.get("reference_tok_s"):
        out["ceiling_vs_measured"] = done / ours_s / scenario["reference_tok_s"]
    return out


def ceiling_line(c: dict) -> str:
    """The ceiling, as bench_gateway's table prints it under the concurrent row."""
    measured = f", {c['ceiling_vs_measured']:.2f}x against its measured tokens/s" \
        if "ceiling_vs_measured" in c else ""
    return (f"(d) ceiling on this CPU (bench_runtime): ours at most {c['ours_tok_s']:.0f} "
            f"tok/s ({c['lanes']}-row steps of {c['step_ms']:.1f} ms and every prompt row), "
            f"llama.cpp's server at most {c['reference_tok_s']:.0f}: {c['ceiling']:.2f}x"
            f"{measured}")
