"""Our torch stage runtime vs llama.cpp on the same GGUF file, side by side.

For each model and format, both runtimes load the same llama.cpp fast-path file (Q4_0 or
Q8_0, requantized from the shipped model; Q4_1 would be a slow path in llama.cpp and
flatter us) and time, on the same 128 token ids and the same thread count:

- prefill: a cold 128-token prompt, logits for the last row (ours: one whole-model stage,
  `prefill(start=0)`; llama.cpp: `reset()` + `eval(ids)`);
- decode: one more token right after that prefill.
- batched decode (ours, `--lanes N`, 8 by default, 0: off): N lanes holding the same
  prompt decode together in a runtime with a lane batch of N; aggregate tokens/s against
  the single lane's decode above (lane batch 1, the serving default), and whether a lane's
  logits are bitwise the same with 1 and with N lanes active.

Each repeat runs both sides, alternating which goes first so machine noise hits both;
one warm-up repeat is discarded; medians are reported with the ratio ours/llama.cpp.

Decode of one token is bound by memory bandwidth, so the table also gives the floor:
weight bytes read per decode step / the measured ~27 GB/s (MEASURED.md), for our working
weights (fp32 today) and for the llama.cpp file.

    python -m skippy.evals.bench_runtime                      # smollm2, Q4_0, 5 repeats
    python -m skippy.evals.bench_runtime --model smollm2 --model gemma3-270m \\
        --format q4_0 --format q8_0 --json bench.json        # --json - : JSON on stdout
    python -m skippy.evals.bench_runtime --weight-format fp32 --weight-format int4

--format picks llama.cpp's file (both sides load it); --weight-format picks the format our
runtime keeps those weights in (stages/linear.py), one row per (model, file, format).

With `--json PATH` the figures are also written to PATH; with `--json -` the JSON goes to
stdout and the table to stderr.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from skippy.evals.reference import _quiet_stderr
from skippy.stages.linear import WEIGHT_FORMATS
from skippy.stages.runtime import DEFAULT_WEIGHT_FORMAT

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "usecases.jsonl"
MODELS = ("smollm2", "gemma3-270m")
FORMATS = ("q4_0", "q8_0")
PROMPT_TOKENS = 128
BANDWIDTH_GB_S = 27.0  # one-thread copy bandwidth measured on these machines (MEASURED.md)
# Used only where the corpus is absent; repeated until it gives enough tokens.
FALLBACK_TEXT = (
    "The harbour town woke slowly. Fishing boats came back with the tide, gulls argued "
    "over the nets, and the baker on the corner opened his shutters to a queue of people "
    "who had been waiting since before dawn. By nine the market square was full: farmers "
    "sold cheese, apples and honey, a man mended umbrellas under the clock tower, and "
    "children ran between the stalls. In the afternoon the wind turned, clouds rolled in "
    "from the sea, and everyone hurried home before the first heavy drops of rain. "
)


class CpuMeter:
    """Share of the machine's CPU time that other processes took (or the hypervisor stole)
    while we ran: a noise gauge for a shared machine. None where /proc/stat is missing."""

    def __init__(self):
        self.start = self._sample()

    @staticmethod
    def _sample():
        try:
            with open("/proc/stat") as fh:
                fields = [int(v) for v in fh.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        # user nice system idle iowait irq softirq steal: busy = all but idle and iowait
        busy = sum(fields[:8]) - fields[3] - fields[4]
        t = os.times()
        return time.perf_counter(), busy / os.sysconf("SC_CLK_TCK"), t.user + t.system

    def other_share(self) -> float | None:
        end = self._sample()
        if self.start is None or end is None:
            return None
        wall = end[0] - self.start[0]
        others = (end[1] - self.start[1]) - (end[2] - self.start[2])
        return max(0.0, others / (wall * (os.cpu_count() or 1))) if wall > 0 else None


# -- inputs -----------------------------------------------------------------------------------

def prompt_text(data: Path) -> tuple[str, str]:
    """(text, where it came from): the first corpus record's message contents, joined."""
    if data.is_file():
        with open(data, encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    record = json.loads(line)
                    text = "\n\n".join(str(m.get("content") or "")
                                       for m in record.get("messages", []))
                    if text.strip():
                        rid = record.get("id", "?")
                        return text, f"{data.name}, first record ({rid})"
                    break
        return FALLBACK_TEXT, f"built-in paragraph ({data} has no usable first record)"
    return FALLBACK_TEXT, f"built-in paragraph (corpus {data} not found)"


def prompt_ids(llm, text: str, n: int) -> tuple[list[int], int]:
    """The first n token ids of `text` (repeated if short) and the id that follows them,
    which both sides decode as their next token."""
    ids = llm.tokenize(text.encode(), add_bos=True, special=True)
    while len(ids) < n + 1:
        ids += llm.tokenize(text.encode(), add_bos=False, special=True)
    return ids[:n], ids[n]


# -- the two sides ------------------------------------------------------------------------------

class Ours:
    name = "ours"

    def __init__(self, path: Path, threads: int, weight_format: str | None = None,
                 lane_batch: int = 1):
        from skippy.stages.runtime import StageSpec
        from skippy.stages.torch_runtime import TorchStageRuntime
        from skippy.topology.gguf_file import GGUFFile
        from skippy.topology.model_config import ModelConfig

        f = GGUFFile(path)
        n_layers = ModelConfig.from_gguf(f).n_layers
        f.close()
        torch.set_num_threads(threads)
        extra = {"weight_format": weight_format} if weight_format else {}
        self.rt = TorchStageRuntime(StageSpec(str(path), 0, n_layers, threads=threads,
                                              lane_batch=lane_batch, **extra))
        self.lane = self.rt.alloc_lane()
        self.weight_format = self.rt.spec.weight_format

    def run(self, ids: list[int], tok: int) -> tuple[float, float, int]:
        """(prefill s, decode s, prefill top-1 id)."""
        ids_t, tok_t = torch.tensor(ids), torch.tensor(tok)
        with torch.no_grad():
            t0 = time.perf_counter()
            logits = self.rt.prefill(self.lane, ids_t, start=0, logits="last").logits
            t1 = time.perf_counter()
            self.rt.decode([(self.lane, tok_t)])
            t2 = time.perf_counter()
        return t1 - t0, t2 - t1, int(torch.argmax(logits))

    def decode_bytes(self) -> int:
        """Working-weight bytes one decode step reads: every layer's matrices and norms, the
        final norm and the head (the embedding is one row per token: left out)."""
        total = 0
        for layer in self.rt.layers:
            for value in vars(layer).values():
                nbytes = getattr(value, "nbytes", None)
                if isinstance(nbytes, int):  # Linear objects and norm tensors
                    total += nbytes
        return total + self.rt.head.nbytes + self.rt.norm.nbytes

    def close(self) -> None:
        self.rt = None


class LlamaCpp:
    name = "llama.cpp"

    def __init__(self, path: Path, threads: int):
        import llama_cpp

        self._llama_cpp = llama_cpp
        with _quiet_stderr():
            self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_threads=threads,
                                       n_threads_batch=threads, n_batch=512, verbose=False)

    def run(self, ids: list[int], tok: int) -> tuple[float, float, int]:
        llm = self.llm
        t0 = time.perf_counter()
        llm.reset()
        llm.eval(ids)
        t1 = time.perf_counter()
        # Read outside the timed spans: llama.cpp leaves the last row's logits in place.
        logits = np.ctypeslib.as_array(self._llama_cpp.llama_get_logits(llm.ctx),
                                       shape=(llm.n_vocab(),))
        top1 = int(np.argmax(logits))
        t2 = time.perf_counter()
        llm.eval([tok])
        t3 = time.perf_counter()
        return t1 - t0, t3 - t2, top1

    def close(self) -> None:
        self.llm.close()
        self.llm = None


def file_decode_bytes(path: Path) -> int:
    """Bytes of the file's tensors one llama.cpp decode step reads: all of them, except
    token_embd when the head has its own output.weight (then one embedding row is read)."""
    from skippy.topology.gguf_file import GGUFFile

    f = GGUFFile(path)
    try:
        total = sum(t.nbytes for t in f.tensors.values())
        if "output.weight" in f.tensors and "token_embd.weight" in f.tensors:
            total -= f.tensors["token_embd.weight"].nbytes
        return total
    finally:
        f.close()


# -- batched decode ---------------------------------------------------------------------------

BATCH_TARGET = 4.0  # aggregate tokens/s of 8 lanes over one lane's (issue 6)


def batched_decode(path: Path, threads: int, weight_format: str | None, ids: list[int],
                   tok: int, lanes: int, steps: int, single_ms: float) -> dict:
    """`lanes` lanes with the same prompt decoding together (lane batch = lanes): the
    median step, aggregate tokens/s against one lane's `single_ms`, and whether a lane's
    logits at a step are bitwise the same alone as with every lane active."""
    ours = Ours(path, threads, weight_format, lane_batch=lanes)
    rt = ours.rt
    try:
        with torch.no_grad():
            group = [rt.alloc_lane() for _ in range(lanes)]
            alone = rt.alloc_lane()
            for lane in group + [alone]:
                rt.prefill(lane, torch.tensor(ids), logits="none")
            solo = rt.decode([(alone, torch.tensor(tok))])[0].logits
            times, together = [], None
            for i in range(steps + 1):  # the first step is a warm-up
                t = time.perf_counter()
                out = rt.decode([(lane, torch.tensor(tok if i == 0 else tok + i))
                                 for lane in group])
                if i == 0:
                    together = out[-1].logits
                else:
                    times.append((time.perf_counter() - t) * 1e3)
    finally:
        ours.close()
    step_ms = statistics.median(times)
    aggregate, single = lanes / step_ms * 1e3, 1e3 / single_ms
    return {"lanes": lanes, "step_ms": step_ms, "step_samples_ms": times,
            "aggregate_tok_s": aggregate, "single_lane_tok_s": single,
            "ratio": aggregate / single, "target": BATCH_TARGET,
            "bitwise_alone_vs_together": bool(torch.equal(solo, together))}


# -- the benchmark --------------------------------------------------------------------------------

def bench_one(model: str, fmt: str, *, repeats: int, warmup: int, threads: int,
              data: Path, say=print, weight_format: str | None = None,
              lanes: int = 0) -> dict:
    from skippy.mesh.models import requantize, resolve_model

    src = resolve_model(model)
    with _quiet_stderr():
        path = requantize(src, fmt)
    say(f"[{model} {fmt.upper()} {weight_format or 'default'}] loading {path.name} into both "
        "runtimes ...")
    ref = LlamaCpp(path, threads)
    text, source = prompt_text(data)
    ids, tok = prompt_ids(ref.llm, text, PROMPT_TOKENS)
    t = time.perf_counter()
    ours = Ours(path, threads, weight_format)
    load_s = time.perf_counter() - t
    lane_batch = ours.rt.spec.lane_batch
    samples = {"ours": {"prefill": [], "decode": []},
               "reference": {"prefill": [], "decode": []}}
    top1 = {}
    meter = CpuMeter()
    try:
        for r in range(warmup + repeats):
            order = (("ours", ours), ("reference", ref))
            if r % 2:
                order = order[::-1]
            for key, side in order:
                gc.collect()
                p, d, first = side.run(ids, tok)
                if r == 0:
                    top1[key] = first
                if r >= warmup:
                    samples[key]["prefill"].append(p * 1e3)
                    samples[key]["decode"].append(d * 1e3)
        other_cpu = meter.other_share()
        ours_bytes, ref_bytes = ours.decode_bytes(), file_decode_bytes(path)
        weight_format = ours.weight_format
    finally:
        ours.close()
        ref.close()

    def step(name: str) -> dict:
        o = statistics.median(samples["ours"][name])
        ref_ms = statistics.median(samples["reference"][name])
        return {"ours_ms": o, "reference_ms": ref_ms, "ratio": o / ref_ms,
                "ours_samples_ms": samples["ours"][name],
                "reference_samples_ms": samples["reference"][name]}

    decode = step("decode")
    floor = {
        "ours_weight_format": weight_format,
        "ours_bytes": ours_bytes,
        "reference_bytes": ref_bytes,
        "ours_floor_ms": ours_bytes / (BANDWIDTH_GB_S * 1e9) * 1e3,
        "reference_floor_ms": ref_bytes / (BANDWIDTH_GB_S * 1e9) * 1e3,
    }
    floor["ours_of_floor"] = decode["ours_ms"] / floor["ours_floor_ms"]
    floor["reference_of_floor"] = decode["reference_ms"] / floor["reference_floor_ms"]
    batched = None
    if lanes:
        say(f"[{model} {fmt.upper()} {weight_format}] {lanes} lanes decoding together ...")
        batched = batched_decode(path, threads, weight_format, ids, tok, lanes,
                                 steps=max(10, 4 * repeats), single_ms=decode["ours_ms"])
    return {
        "model": model,
        "format": fmt,
        "file": str(path),
        "file_bytes": path.stat().st_size,
        "prompt_source": source,
        "prompt_tokens": len(ids),
        "decode_token": tok,
        "ours_load_s": load_s,
        "ours_lane_batch": lane_batch,
        "other_cpu_share": other_cpu,
        "prefill_top1_match": top1["ours"] == top1["reference"],
        "prefill": step("prefill"),
        "decode": decode,
        "decode_bandwidth_floor": floor,
        "batched_decode": batched,
    }


def _table(result: dict) -> str:
    runs = result["runs"]
    lines = [
        f"torch runtime (ours) vs llama.cpp {result['llama_cpp_version']}, same GGUF, "
        f"{result['threads']} threads each, {PROMPT_TOKENS}-token prompt",
        f"median of {result['repeats']} repeats after {result['warmup']} warm-up, "
        f"sides alternating; prompt: {runs[0]['prompt_source'] if runs else '-'}",
        "",
        f"{'model':<12} {'file':<5} {'ours':<5} {'step':<16} {'ours ms':>9} "
        f"{'llama.cpp ms':>13} {'ours/llama.cpp':>15}",
    ]
    for r in runs:
        wf = r["decode_bandwidth_floor"]["ours_weight_format"]
        for key, label in (("prefill", f"prefill {r['prompt_tokens']} tok"),
                           ("decode", "decode 1 tok")):
            s = r[key]
            lines.append(f"{r['model']:<12} {r['format'].upper():<5} {wf:<5} {label:<16} "
                         f"{s['ours_ms']:>9.1f} {s['reference_ms']:>13.1f} "
                         f"{s['ratio']:>14.2f}x")
    lines += [
        "",
        f"decode bandwidth floor: weight bytes read per step / {BANDWIDTH_GB_S:g} GB/s "
        "(KV and activations left out)",
        f"{'model':<12} {'file':<5} {'side':<16} {'weights MB':>10} {'floor ms':>9} "
        f"{'measured ms':>12} {'x floor':>8}",
    ]
    for r in runs:
        f, d = r["decode_bandwidth_floor"], r["decode"]
        for side, label in (("ours", f"ours ({f['ours_weight_format']})"),
                            ("reference", f"llama.cpp ({r['format'].upper()})")):
            lines.append(f"{r['model']:<12} {r['format'].upper():<5} {label:<16} "
                         f"{f[side + '_bytes'] / 1e6:>10.1f} {f[side + '_floor_ms']:>9.2f} "
                         f"{d[side + '_ms']:>12.1f} {f[side + '_of_floor']:>7.1f}x")
    batched = [r for r in runs if r.get("batched_decode")]
    if batched:
        lines += ["", "batched decode (ours): lanes decoding together vs one lane alone "
                      "(lane batch 1)",
                  f"{'model':<12} {'file':<5} {'ours':<9} {'lanes':>5} {'step ms':>8} "
                  f"{'tok/s':>7} {'1 lane tok/s':>12} {'ratio':>7} {'target':>7} "
                  f"{'bitwise 1 vs N':>14}"]
        for r in batched:
            b, wf = r["batched_decode"], r["decode_bandwidth_floor"]["ours_weight_format"]
            lines.append(f"{r['model']:<12} {r['format'].upper():<5} {wf:<9} {b['lanes']:>5} "
                         f"{b['step_ms']:>8.1f} {b['aggregate_tok_s']:>7.1f} "
                         f"{b['single_lane_tok_s']:>12.1f} {b['ratio']:>6.2f}x "
                         f"{b['target']:>6.1f}x {str(b['bitwise_alone_vs_together']):>14}")
    mismatched = [f"{r['model']} {r['format'].upper()}" for r in runs
                  if not r["prefill_top1_match"]]
    lines += ["", "prefill top-1 next token: " + (
        "same on both sides" if not mismatched
        else "differs for " + ", ".join(mismatched) + " (quantized llama.cpp dot products "
        "round activations; check numerics with the certification evals)")]
    batches = sorted({r["ours_lane_batch"] for r in runs if "ours_lane_batch" in r})
    if batches:
        lines.append(f"ours decodes a fixed lane batch of {'/'.join(map(str, batches))} "
                     "row(s), one real; weights are read once per step.")
    shares = [(f"{r['model']} {r['format'].upper()}", r.get("other_cpu_share")) for r in runs]
    known = [(name, s) for name, s in shares if s is not None]
    if known:
        lines.append("CPU taken by other processes during the repeats: " + ", ".join(
            f"{name} {s:.0%}" for name, s in known))
        if any(s > 0.10 for _, s in known):
            lines.append("WARNING: the machine was busy with other work; with every core "
                         "oversubscribed both runtimes slow down a lot, and not equally. "
                         "Rerun on a quiet machine before trusting these figures.")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m skippy.evals.bench_runtime",
        description="Time our torch runtime against llama.cpp on the same GGUF file.")
    p.add_argument("--model", action="append", choices=MODELS,
                   help="model to bench; repeat for several (default: smollm2)")
    p.add_argument("--format", action="append", choices=FORMATS, dest="formats",
                   help="llama.cpp fast-path file type; repeat for several (default: q4_0)")
    p.add_argument("--weight-format", action="append", choices=WEIGHT_FORMATS,
                   dest="weight_formats",
                   help="our runtime's weight format; repeat for several (default: the "
                        f"runtime's default, {DEFAULT_WEIGHT_FORMAT})")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="discarded warm-up repeats (default 1)")
    p.add_argument("--threads", type=int, default=2, help="threads for both sides (default 2)")
    p.add_argument("--lanes", type=int, default=8,
                   help="lanes for the batched decode figure (default 8; 0: skip it)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA,
                   help="corpus JSONL; the first record's messages give the prompt "
                        "(default: ../shared/data/usecases.jsonl from the repo root)")
    p.add_argument("--json", metavar="PATH",
                   help="also write the figures as JSON to PATH; '-' writes JSON to stdout "
                        "and the table to stderr")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or args.threads < 1 or args.lanes < 0:
        p.error("--repeats and --threads must be >= 1, --warmup and --lanes >= 0")
    args.model = list(dict.fromkeys(args.model or ["smollm2"]))
    args.formats = list(dict.fromkeys(args.formats or ["q4_0"]))
    args.weight_formats = list(dict.fromkeys(args.weight_formats or [DEFAULT_WEIGHT_FORMAT]))
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print the table, write JSON if asked; returns the JSON figures."""
    import llama_cpp

    args = parse_args(argv)
    out = sys.stderr if args.json == "-" else sys.stdout
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731  progress
    result = {
        "llama_cpp_version": getattr(llama_cpp, "__version__", "?"),
        "torch_version": torch.__version__,
        "threads": args.threads,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "bandwidth_gb_s": BANDWIDTH_GB_S,
        "runs": [bench_one(m, f, repeats=args.repeats, warmup=args.warmup,
                           threads=args.threads, data=args.data, say=say, weight_format=w,
                           lanes=args.lanes)
                 for m in args.model for f in args.formats for w in args.weight_formats],
    }
    print(_table(result), file=out, flush=True)
    if args.json == "-":
        json.dump(result, sys.stdout, indent=2)
        print()
    elif args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
