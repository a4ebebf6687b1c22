"""Our torch stage runtime vs llama.cpp on the same GGUF file, side by side.

For each model and format, both runtimes load the same llama.cpp fast-path file (Q4_0 or
Q8_0, requantized from the source model; Q4_1 would be a slow path in llama.cpp and
flatter us) and time, on the same token ids and the same thread count:

- prefill: a cold prompt of each `--tokens` length (128 by default; the prompt text is
  repeated to reach it), logits for the last row (ours: one whole-model stage,
  `prefill(start=0)`; llama.cpp: `reset()` + `eval(ids)`);
- decode: `--decode-steps` tokens (16 by default), one step at a time, right after the
  first length's prefill, the same fixed ids on both sides; the median step is reported
  and every step's time is kept in the JSON;
- batched decode (ours, `--lanes N`, 8 by default, 0: off): N lanes holding the same
  prompt decode together in a runtime with a lane batch of N; aggregate tokens/s against
  the single lane's decode above (lane batch 1, the serving default), and whether a lane's
  logits are bitwise the same with 1 and with N lanes active.

Each repeat runs both sides, alternating which goes first so machine noise hits both;
one warm-up repeat is discarded; medians are reported with the ratio ours/llama.cpp.

Decode of one token is bound by memory bandwidth, so the table also gives the floor:
weight bytes read per decode step / the measured ~27 GB/s (MEASURED.md), for our working
weights and for the llama.cpp file.

    python -m skippy.evals.bench_runtime                      # smollm2, Q4_0, 5 repeats
    python -m skippy.evals.bench_runtime --model smollm2 --model gemma3-270m \\
        --format q4_0 --format q8_0 --json bench.json        # --json - : JSON on stdout
    python -m skippy.evals.bench_runtime --tokens 128,2048,4096 --decode-steps 16
    python -m skippy.evals.bench_runtime --model llama-1.5b --restrict avx2
    python -m skippy.evals.bench_runtime --plot bench.json    # bench.png from stored JSON

--model is a shipped model, a path to a .gguf, or `llama-1.5b` (a random-weight llama of
about 1.5 B parameters, synthesized once into $SKIPPY_HOME and requantized; the F16
stepping stone is deleted once every requested format is derived from it).
--format picks llama.cpp's file (both sides load it); --weight-format picks the format our
runtime keeps those weights in (stages/linear.py), one row per (model, file, format).
--restrict avx2 re-executes the bench with ATEN_CPU_CAPABILITY=avx2 and
ONEDNN_MAX_CPU_ISA=AVX2: torch and our kernel then run AVX2 code; llama.cpp, in the same
process, is not restricted (its build is for this machine), which the output says.

The JSON records the CPU, torch's CPU capability, the restrictions in force, what our
runtime multiplies with per weight format and llama.cpp's system info. With `--json PATH`
the figures are also written to PATH and a plot to PATH with a .png suffix (drawn again
by `--plot PATH` or `python -m skippy.evals.plots PATH`); with `--json -` the JSON goes to
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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from skippy.evals import plots
from skippy.evals.reference import _quiet_stderr
from skippy.mesh.progress import Console, tracked
from skippy.stages.linear import WEIGHT_FORMATS, kernels
from skippy.stages.qkernel import cpu_flags, cpu_name
from skippy.stages.runtime import DEFAULT_WEIGHT_FORMAT, StageSpec
from skippy.topology.families import LLAMA
from skippy.evals.entry import guarded

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "usecases.jsonl"
MODELS = ("smollm2", "gemma3-270m")
FORMATS = ("q4_0", "q8_0")
PROMPT_TOKENS = 128
DECODE_STEPS = 16
BANDWIDTH_GB_S = 27.0  # one-thread copy bandwidth measured on these machines (MEASURED.md)
# --restrict: the environment each choice sets before the bench is executed again.
RESTRICTIONS = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}
RESTRICT_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
# Used only where the corpus is absent; repeated until it gives enough tokens.
FALLBACK_TEXT = (
    "The harbour town woke slowly. Fishing boats came back with the tide, gulls argued "
    "over the nets, and the baker on the corner opened his shutters to a queue of people "
    "who had been waiting since before dawn. By nine the market square was full: farmers "
    "sold cheese, apples and honey, a man mended umbrellas under the clock tower, and "
    "children ran between the stalls. In the afternoon the wind turned, clouds rolled in "
    "from the sea, and everyone hurried home before the first heavy drops of rain. "
)


@dataclass(frozen=True)
class SynthModel:
    """A random-weight model the bench synthesizes (stages/synth.py) when first asked."""

    arch: str
    layers: int
    hidden: int
    ff: int
    heads: int
    kv_heads: int
    seed: int = 1

    def stem(self, name: str) -> str:
        from skippy.stages.synth import SYNTH_VERSION
        return f"{name}-s{self.seed}-v{SYNTH_VERSION}"


# llama-1.5b: 24 x 60.8 M in the blocks + 2 x 100.7 M for the embedding and the untied
# head = 1.66 B parameters (1.56 B without the embedding table, which decode reads a row of).
SYNTH_MODELS = {
    "llama-1.5b": SynthModel(LLAMA.name, layers=24, hidden=2048, ff=8192, heads=32, kv_heads=8),
}


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


def prompt_ids(llm, text: str, n: int) -> list[int]:
    """The first n token ids of `text`, repeated as often as it takes."""
    ids = llm.tokenize(text.encode(), add_bos=True, special=True)
    while len(ids) < n:
        ids += llm.tokenize(text.encode(), add_bos=False, special=True)
    return ids[:n]


def context_for(tokens: int) -> int:
    """Rows a runtime must hold for `tokens` rows, rounded up to whole prefill chunks
    (a short last chunk is padded to a full one)."""
    return -(-tokens // StageSpec.chunk) * StageSpec.chunk


# -- the models -------------------------------------------------------------------------------

def model_files(model: str, formats: list[str], say=print) -> dict[str, Path]:
    """The GGUF file each format runs: `model` (a shipped name, a .gguf path or a
    SYNTH_MODELS name) requantized to it, cached in $SKIPPY_HOME/derived."""
    from skippy.mesh.models import requantize, resolve_model

    if model in SYNTH_MODELS:
        return synth_files(model, formats, say)
    src = resolve_model(model)
    with _quiet_stderr():
        return {fmt: requantize(src, fmt) for fmt in formats}


def synth_files(name: str, formats: list[str], say=print) -> dict[str, Path]:
    """A SYNTH_MODELS entry requantized to each format. The F16 file written first (3 GB
    for llama-1.5b; streamed, so memory stays about one tensor) is only a stepping stone:
    it is deleted once every asked-for format is derived from it. The derived files stay:
    the synthesis is deterministic in its arguments, so a file with the stem is the same."""
    from skippy.mesh.models import derived_dir, model_home, requantize, resolve_model
    from skippy.stages.synth import write_synthetic

    m = SYNTH_MODELS[name]
    stem = m.stem(name)
    out = {fmt: derived_dir() / f"{stem}.{fmt.upper()}.gguf" for fmt in formats}
    missing = [fmt for fmt, path in out.items() if not path.is_file()]
    if not missing:
        return out
    src = model_home() / "synth" / f"{stem}.gguf"
    if not src.is_file():
        src.parent.mkdir(parents=True, exist_ok=True)
        say(f"[{name}] synthesizing {m.arch} ({m.layers} layers, hidden {m.hidden}, ff "
            f"{m.ff}, {m.heads} heads, {m.kv_heads} kv heads) as F16 into {src} ...")
        write_synthetic(m.arch, layers=m.layers, seed=m.seed, out=src,
                        tokenizer_from=resolve_model("smollm2"), hidden=m.hidden, ff=m.ff,
                        heads=m.heads, kv_heads=m.kv_heads, dtype="f16")
    for fmt in missing:
        say(f"[{name}] requantizing to {fmt.upper()} ...")
        with _quiet_stderr():
            out[fmt] = requantize(src, fmt)
    src.unlink()
    return out


def model_label(model: str) -> str:
    return Path(model).stem if model.endswith(".gguf") else model


# -- the two sides ------------------------------------------------------------------------------

class Ours:
    name = "ours"

    def __init__(self, path: Path, threads: int, weight_format: str | None = None,
                 lane_batch: int = 1, n_ctx: int | None = None):
        from skippy.stages.torch_runtime import TorchStageRuntime
        from skippy.topology.gguf_file import GGUFFile
        from skippy.topology.model_config import ModelConfig

        f = GGUFFile(path)
        n_layers = ModelConfig.from_gguf(f).n_layers
        f.close()
        torch.set_num_threads(threads)
        extra = {"weight_format": weight_format} if weight_format else {}
        if n_ctx:
            extra["n_ctx"] = n_ctx
        self.rt = TorchStageRuntime(StageSpec(str(path), 0, n_layers, threads=threads,
                                              lane_batch=lane_batch, **extra))
        self.lane = self.rt.alloc_lane()
        self.weight_format = self.rt.spec.weight_format
        self.n_ctx = self.rt.n_ctx

    def prefill(self, ids: list[int]) -> tuple[float, int]:
        """(seconds, top-1 id) of a cold prefill."""
        ids_t = torch.tensor(ids)
        with torch.no_grad():
            t0 = time.perf_counter()
            logits = self.rt.prefill(self.lane, ids_t, start=0, logits="last").logits
            t1 = time.perf_counter()
        return t1 - t0, int(torch.argmax(logits))

    def decode(self, toks: list[int]) -> list[float]:
        """Seconds of each step, one token at a time, after the last prefill."""
        times = []
        with torch.no_grad():
            for tok in toks:
                tok_t = torch.tensor(tok)
                t0 = time.perf_counter()
                self.rt.decode([(self.lane, tok_t)])
                times.append(time.perf_counter() - t0)
        return times

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

    def __init__(self, path: Path, threads: int, n_ctx: int = 512):
        import llama_cpp

        self._llama_cpp = llama_cpp
        self.n_ctx = n_ctx
        # n_batch = n_ctx: llama-cpp-python hands each prompt to llama.cpp as one batch
        # (llama.cpp splits it into its default 512-row micro-batches itself). Flash
        # attention on: llama.cpp at its fastest (2,048 tokens of SmolLM2 here: 3.3 s with
        # it, 4.6 s without), as our llama.cpp runtime runs it.
        with _quiet_stderr():
            self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads,
                                       n_threads_batch=threads, n_batch=n_ctx, verbose=False,
                                       flash_attn=True)

    def prefill(self, ids: list[int]) -> tuple[float, int]:
        llm = self.llm
        t0 = time.perf_counter()
        llm.reset()
        llm.eval(ids)
        t1 = time.perf_counter()
        # Read outside the timed span: llama.cpp leaves the last row's logits in place.
        logits = np.ctypeslib.as_array(self._llama_cpp.llama_get_logits(llm.ctx),
                                       shape=(llm.n_vocab(),))
        return t1 - t0, int(np.argmax(logits))

    def decode(self, toks: list[int]) -> list[float]:
        times = []
        for tok in toks:
            t0 = time.perf_counter()
            self.llm.eval([tok])
            times.append(time.perf_counter() - t0)
        return times

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


# -- where it ran ----------------------------------------------------------------------------

def environment(weight_formats: list[str], restrict: str | None) -> dict:
    """The CPU, what torch and our kernel run (and the restrictions in force), and what
    llama.cpp was built for."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info()
    info = info.decode(errors="replace") if isinstance(info, bytes) else str(info)
    return {
        "cpu": cpu_name(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "restrict": restrict,
        "restrictions": {k: os.environ.get(k) for k in RESTRICT_VARS},
        "ours_kernels": {wf: kernels(wf) for wf in weight_formats},
        "llama_cpp_system_info": info.strip(),
        # llama.cpp runs in this process on its own build (the variables above are torch's):
        # restricted only when that build leaves out AVX-512 on a CPU that has it
        "llama_cpp_restricted": "AVX512" not in _llama_features(info).split()
        and "avx512f" in cpu_flags(),
        "llama_cpp_path": str(Path(llama_cpp.__file__).parent),
    }


def _llama_features(info: str) -> str:
    """'AVX2 AVX512 ...' from llama.cpp's 'CPU : SSE3 = 1 | AVX2 = 1 | ...' line."""
    feats = []
    for part in info.replace("\n", "|").split("|"):
        key, _, value = part.rpartition("=")
        if value.strip() == "1":
            feats.append(key.split(":")[-1].strip())
    return " ".join(feats) or info


# -- batched decode ---------------------------------------------------------------------------

BATCH_TARGET = 4.0  # aggregate tokens/s of 8 lanes over one lane's (issue 6)


def batched_decode(path: Path, threads: int, weight_format: str | None, ids: list[int],
                   tok: int, lanes: int, steps: int, single_ms: float) -> dict:
    """`lanes` lanes with the same prompt decoding together (lane batch = lanes): the
    median step, aggregate tokens/s against one lane's `single_ms`, and whether a lane's
    logits at a step are bitwise the same alone as with every lane active."""
    ours = Ours(path, threads, weight_format, lane_batch=lanes,
                n_ctx=context_for(len(ids) + steps + 2))
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

def _time_sides(sides: dict, prompts: dict[int, list[int]], steps: list[int], *,
                repeats: int, warmup: int) -> tuple[dict, dict]:
    """Each repeat, each side (alternating which first): a cold prefill of every length,
    the decode steps right after the first length's. Returns (samples, top-1 ids) by side;
    samples["prefill"][n] is a list of ms, samples["decode"] a list of per-step ms lists."""
    first = next(iter(prompts))
    samples = {k: {"prefill": {n: [] for n in prompts}, "decode": []} for k in sides}
    top1 = {k: {} for k in sides}
    for r in range(warmup + repeats):
        order = list(sides.items())
        for key, side in (order[::-1] if r % 2 else order):
            gc.collect()
            for n, ids in prompts.items():
                s, top = side.prefill(ids)
                if r == 0:
                    top1[key][n] = top
                if r >= warmup:
                    samples[key]["prefill"][n].append(s * 1e3)
                if n == first:
                    d = side.decode(steps)
                    if r >= warmup:
                        samples[key]["decode"].append([t * 1e3 for t in d])
    return samples, top1


def _compare(ours: list[float], ref: list[float], paired: tuple[list, list] | None = None,
             **extra) -> dict:
    """Medians and their ratio, and the spread: the lowest and highest ratio of one
    repeat's two sides (`paired`: per-repeat figures, default the samples themselves)."""
    o, r = statistics.median(ours), statistics.median(ref)
    po, pr = paired or (ours, ref)
    ratios = [a / b for a, b in zip(po, pr)]
    return {**extra, "ours_ms": o, "reference_ms": r, "ratio": o / r,
            "ratio_range": [min(ratios), max(ratios)]}


def _figures(samples: dict, top1: dict, tokens: list[int], steps: int) -> tuple[list, dict]:
    """Per-length prefill rows and the decode row, medians and ratios."""
    prefill = [{**_compare(samples["ours"]["prefill"][n], samples["reference"]["prefill"][n],
                           tokens=n),
                "ours_samples_ms": samples["ours"]["prefill"][n],
                "reference_samples_ms": samples["reference"]["prefill"][n],
                "top1_match": top1["ours"][n] == top1["reference"][n]} for n in tokens]
    od, rd = samples["ours"]["decode"], samples["reference"]["decode"]
    per_repeat = ([statistics.median(rep) for rep in od], [statistics.median(rep) for rep in rd])
    decode = {**_compare([t for rep in od for t in rep], [t for rep in rd for t in rep],
                         per_repeat, after_tokens=tokens[0], steps=steps),
              "ours_samples_ms": od, "reference_samples_ms": rd}
    return prefill, decode


def _floor(ours_bytes: int, ref_bytes: int, weight_format: str, decode: dict) -> dict:
    floor = {
        "ours_weight_format": weight_format,
        "ours_bytes": ours_bytes,
        "reference_bytes": ref_bytes,
        "ours_floor_ms": ours_bytes / (BANDWIDTH_GB_S * 1e9) * 1e3,
        "reference_floor_ms": ref_bytes / (BANDWIDTH_GB_S * 1e9) * 1e3,
    }
    floor["ours_of_floor"] = decode["ours_ms"] / floor["ours_floor_ms"]
    floor["reference_of_floor"] = decode["reference_ms"] / floor["reference_floor_ms"]
    return floor


def bench_one(model: str, fmt: str, path: Path, *, repeats: int, warmup: int, threads: int,
              data: Path, say=print, weight_format: str | None = None, lanes: int = 0,
              tokens: tuple[int, ...] = (PROMPT_TOKENS,),
              decode_steps: int = DECODE_STEPS) -> dict:
    tokens = list(tokens)
    need = max(max(tokens), tokens[0] + decode_steps)
    say(f"[{model_label(model)} {fmt.upper()} {weight_format or 'default'}] loading "
        f"{path.name} into both runtimes ...")
    ref = LlamaCpp(path, threads, n_ctx=need)
    text, source = prompt_text(data)
    ids = prompt_ids(ref.llm, text, need)
    prompts = {n: ids[:n] for n in tokens}
    steps = ids[tokens[0]:tokens[0] + decode_steps]
    t = time.perf_counter()
    ours = Ours(path, threads, weight_format, n_ctx=context_for(need))
    load_s = time.perf_counter() - t
    lane_batch, n_ctx = ours.rt.spec.lane_batch, ours.n_ctx
    meter = CpuMeter()
    try:
        if n_ctx < need:
            raise SystemExit(f"{model}: its context ({n_ctx} tokens) is shorter than the "
                             f"{need} tokens asked for (--tokens, --decode-steps)")
        samples, top1 = _time_sides({"ours": ours, "reference": ref}, prompts, steps,
                                    repeats=repeats, warmup=warmup)
        other_cpu = meter.other_share()
        ours_bytes, ref_bytes = ours.decode_bytes(), file_decode_bytes(path)
        weight_format = ours.weight_format
    finally:
        ours.close()
        ref.close()
    prefill, decode = _figures(samples, top1, tokens, decode_steps)
    batched = None
    if lanes:
        say(f"[{model_label(model)} {fmt.upper()} {weight_format}] {lanes} lanes decoding "
            "together ...")
        batched = batched_decode(path, threads, weight_format, prompts[tokens[0]], steps[0],
                                 lanes, steps=max(10, 4 * repeats),
                                 single_ms=decode["ours_ms"])
    return {
        "model": model,
        "format": fmt,
        "file": str(path),
        "file_bytes": path.stat().st_size,
        "prompt_source": source,
        "tokens": tokens,
        "decode_tokens": steps,
        "ours_load_s": load_s,
        "ours_lane_batch": lane_batch,
        "ours_kernels": kernels(weight_format),
        "ours_n_ctx": n_ctx,
        "reference_n_ctx": need,
        "reference_n_batch": need,
        "other_cpu_share": other_cpu,
        "prefill_top1_match": all(p["top1_match"] for p in prefill),
        "prefill": prefill,
        "decode": decode,
        "decode_bandwidth_floor": _floor(ours_bytes, ref_bytes, weight_format, decode),
        "batched_decode": batched,
    }


# -- output ---------------------------------------------------------------------------------------

def _header(result: dict) -> list[str]:
    env = result.get("environment") or {}
    runs = result["runs"]
    held = {k: v for k, v in (env.get("restrictions") or {}).items() if v}
    restricted = (", restricted by " + ", ".join(f"{k}={v}" for k, v in held.items())
                  if held else ", unrestricted")
    lines = [
        f"torch runtime (ours) vs llama.cpp {result['llama_cpp_version']}, same GGUF, "
        f"{result['threads']} threads each",
        f"CPU: {env.get('cpu', '?')}; torch CPU capability "
        f"{env.get('torch_cpu_capability', '?')}{restricted}",
        "ours multiplies with: " + ", ".join(
            f"{wf} {k}" for wf, k in (env.get("ours_kernels") or {}).items()),
        "llama.cpp CPU features: " + _llama_features(env.get("llama_cpp_system_info", "?")),
    ]
    if env.get("llama_cpp_restricted"):
        lines.append("the llama.cpp side is a build without AVX-512 (--llama-cpp "
                     f"{env.get('llama_cpp_path', '?')}): AVX2 against AVX2")
    elif held:
        lines.append("the llama.cpp side is NOT restricted: it shares the process and its "
                     "build is for this machine")
    lines.append(f"median of {result['repeats']} repeats after {result['warmup']} warm-up, "
                 f"sides alternating; prompt: {runs[0]['prompt_source'] if runs else '-'}")
    if runs:
        d = runs[0]["decode"]
        lines.append(f"decode: {d['steps']} steps one token at a time after the "
                     f"{d['after_tokens']}-token prefill, the same ids on both sides; "
                     "median step")
    return lines


def _step_rows(runs: list[dict], w: int) -> list[str]:
    lines = [f"{'model':<{w}} {'file':<5} {'ours':<9} {'step':<18} {'ours ms':>9} "
             f"{'llama.cpp ms':>13} {'ours/llama.cpp':>15} {'spread':>12}"]
    for r in runs:
        wf = r["decode_bandwidth_floor"]["ours_weight_format"]
        rows = [(f"prefill {p['tokens']} tok", p) for p in r["prefill"]]
        rows.append(("decode / step", r["decode"]))
        for label, s in rows:
            lines.append(f"{model_label(r['model']):<{w}} {r['format'].upper():<5} {wf:<9} "
                         f"{label:<18} {s['ours_ms']:>9.1f} {s['reference_ms']:>13.1f} "
                         f"{s['ratio']:>14.2f}x {_spread(s)}")
    return lines


def _spread(s: dict) -> str:
    lo_hi = s.get("ratio_range")
    return f"{lo_hi[0]:>6.2f}-{lo_hi[1]:.2f}x" if lo_hi else ""


def _floor_rows(runs: list[dict], w: int) -> list[str]:
    lines = [
        f"decode bandwidth floor: weight bytes read per step / {BANDWIDTH_GB_S:g} GB/s "
        "(KV and activations left out)",
        f"{'model':<{w}} {'file':<5} {'side':<16} {'weights MB':>10} {'floor ms':>9} "
        f"{'measured ms':>12} {'x floor':>8}",
    ]
    for r in runs:
        f, d = r["decode_bandwidth_floor"], r["decode"]
        for side, label in (("ours", f"ours ({f['ours_weight_format']})"),
                            ("reference", f"llama.cpp ({r['format'].upper()})")):
            lines.append(f"{model_label(r['model']):<{w}} {r['format'].upper():<5} {label:<16} "
                         f"{f[side + '_bytes'] / 1e6:>10.1f} {f[side + '_floor_ms']:>9.2f} "
                         f"{d[side + '_ms']:>12.1f} {f[side + '_of_floor']:>7.1f}x")
    return lines


def _batched_rows(runs: list[dict], w: int) -> list[str]:
    batched = [r for r in runs if r.get("batched_decode")]
    if not batched:
        return []
    lines = ["", "batched decode (ours): lanes decoding together vs one lane alone "
                 "(lane batch 1)",
             f"{'model':<{w}} {'file':<5} {'ours':<9} {'lanes':>5} {'step ms':>8} "
             f"{'tok/s':>7} {'1 lane tok/s':>12} {'ratio':>7} {'target':>7} "
             f"{'bitwise 1 vs N':>14}"]
    for r in batched:
        b, wf = r["batched_decode"], r["decode_bandwidth_floor"]["ours_weight_format"]
        lines.append(f"{model_label(r['model']):<{w}} {r['format'].upper():<5} {wf:<9} "
                     f"{b['lanes']:>5} {b['step_ms']:>8.1f} {b['aggregate_tok_s']:>7.1f} "
                     f"{b['single_lane_tok_s']:>12.1f} {b['ratio']:>6.2f}x "
                     f"{b['target']:>6.1f}x {str(b['bitwise_alone_vs_together']):>14}")
    return lines


def _notes(runs: list[dict]) -> list[str]:
    mismatched = [f"{model_label(r['model'])} {r['format'].upper()} "
                  f"{'/'.join(str(p['tokens']) for p in r['prefill'] if not p['top1_match'])}"
                  for r in runs if not r["prefill_top1_match"]]
    lines = ["", "prefill top-1 next token: " + (
        "same on both sides" if not mismatched
        else "differs for " + ", ".join(mismatched) + " tokens (quantized llama.cpp dot "
        "products round activations; check numerics with the certification evals)")]
    batches = sorted({r["ours_lane_batch"] for r in runs if "ours_lane_batch" in r})
    if batches:
        lines.append(f"ours decodes a fixed lane batch of {'/'.join(map(str, batches))} "
                     "row(s), one real; weights are read once per step.")
    shares = [(f"{model_label(r['model'])} {r['format'].upper()}", r.get("other_cpu_share"))
              for r in runs]
    known = [(name, s) for name, s in shares if s is not None]
    if known:
        lines.append("CPU taken by other processes during the repeats: " + ", ".join(
            f"{name} {s:.0%}" for name, s in known))
        if any(s > 0.10 for _, s in known):
            lines.append("WARNING: the machine was busy with other work; with every core "
                         "oversubscribed both runtimes slow down a lot, and not equally. "
                         "Rerun on a quiet machine before trusting these figures.")
    return lines


def _table(result: dict) -> str:
    runs = result["runs"]
    w = max([12] + [len(model_label(r["model"])) for r in runs])
    return "\n".join(_header(result) + [""] + _step_rows(runs, w) + [""]
                     + _floor_rows(runs, w) + _batched_rows(runs, w) + _notes(runs))


def plot(result: dict):
    """ms per step, ours vs llama.cpp: prefill by prompt length (left) and each decode step
    (right, medians over repeats, dotted: the median step), one row per run."""
    from matplotlib.ticker import MaxNLocator

    runs = result["runs"]
    env = result.get("environment") or {}
    fig, axes = plots.figure(max(1, len(runs)), 2, width=5.5, height=3.4, title=(
        f"ours vs llama.cpp {result.get('llama_cpp_version', '?')}, "
        f"{result.get('threads', '?')} threads, {env.get('cpu', '?')}, torch "
        f"{env.get('torch_cpu_capability', '?')}"))
    sides = (("ours", "ours", plots.OURS, "o-"), ("reference", "llama.cpp", plots.REFERENCE,
                                                   "s--"))
    for (pre, dec), r in zip(axes, runs):
        name = (f"{model_label(r['model'])} {r['format'].upper()} "
                f"(ours {r['decode_bandwidth_floor']['ours_weight_format']})")
        toks = [p["tokens"] for p in r["prefill"]]
        d = r["decode"]
        for side, label, color, style in sides:
            pre.plot(toks, [p[f"{side}_ms"] for p in r["prefill"]], style, color=color,
                     label=label)
            per_step = [statistics.median(col) for col in zip(*d[f"{side}_samples_ms"])]
            dec.plot(range(1, len(per_step) + 1), per_step, style, color=color, label=label)
            dec.axhline(d[f"{side}_ms"], color=color, linestyle=":", linewidth=1)
        if len(toks) > 1:
            pre.set_xscale("log", base=2)
            pre.set_yscale("log")
        pre.set_xticks(toks, [str(n) for n in toks])
        plots.finish(pre, title=f"{name}: prefill", xlabel="prompt tokens",
                     ylabel="ms per prefill")
        dec.set_ylim(0, None)
        dec.xaxis.set_major_locator(MaxNLocator(integer=True))
        plots.finish(dec, title=f"{name}: decode", ylabel="ms per step",
                     xlabel=f"step after the {d['after_tokens']}-token prefill")
    return fig


# -- the command line ------------------------------------------------------------------------------

def _tokens(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of token counts: {text!r}")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"token counts must be >= 1: {text!r}")
    return list(dict.fromkeys(values))


def _model(spec: str) -> str:
    if spec in MODELS or spec in SYNTH_MODELS:
        return spec
    if spec.endswith(".gguf"):
        if not Path(spec).expanduser().is_file():
            raise argparse.ArgumentTypeError(f"no such file: {spec}")
        return str(Path(spec).expanduser().resolve())
    raise argparse.ArgumentTypeError(
        f"{spec!r}: not one of {', '.join(MODELS + tuple(SYNTH_MODELS))} or a .gguf path")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m skippy.evals.bench_runtime",
        description="Time our torch runtime against llama.cpp on the same GGUF file.")
    p.add_argument("--model", action="append", type=_model,
                   help="model to bench: " + ", ".join(MODELS + tuple(SYNTH_MODELS))
                        + " or a .gguf path; repeat for several (default: smollm2)")
    p.add_argument("--format", action="append", choices=FORMATS, dest="formats",
                   help="llama.cpp fast-path file type; repeat for several (default: q4_0)")
    p.add_argument("--weight-format", action="append", choices=WEIGHT_FORMATS,
                   dest="weight_formats",
                   help="our runtime's weight format; repeat for several (default: the "
                        f"runtime's default, {DEFAULT_WEIGHT_FORMAT})")
    p.add_argument("--tokens", type=_tokens, default=[PROMPT_TOKENS],
                   help=f"prefill length(s), a comma list (default {PROMPT_TOKENS}); decode "
                        "follows the first")
    p.add_argument("--decode-steps", type=int, default=DECODE_STEPS,
                   help=f"decode steps timed after the prefill (default {DECODE_STEPS})")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="discarded warm-up repeats (default 1)")
    p.add_argument("--threads", type=int, default=2, help="threads for both sides (default 2)")
    p.add_argument("--lanes", type=int, default=8,
                   help="lanes for the batched decode figure (default 8; 0: skip it)")
    p.add_argument("--restrict", choices=sorted(RESTRICTIONS),
                   help="run our side with torch and our kernel limited to this ISA "
                        "(re-executes the bench; llama.cpp is not restricted)")
    p.add_argument("--llama-cpp", metavar="DIR", type=Path,
                   help="import llama_cpp from DIR (another build of it, e.g. the AVX2-only "
                        "one `make llama-avx2` installs), for the reference side")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA,
                   help="corpus JSONL; the first record's messages give the prompt "
                        "(default: ../shared/data/usecases.jsonl from the repo root)")
    p.add_argument("--json", metavar="PATH",
                   help="also write the figures as JSON to PATH and a plot to PATH with a "
                        ".png suffix; '-' writes JSON to stdout and the table to stderr")
    p.add_argument("--plot", metavar="JSON", type=Path,
                   help="only render the plot of a stored JSON (next to it, .png) and exit")
    args = p.parse_args(argv)
    if (args.repeats < 1 or args.warmup < 0 or args.threads < 1 or args.lanes < 0
            or args.decode_steps < 1):
        p.error("--repeats, --threads and --decode-steps must be >= 1, --warmup and --lanes "
                ">= 0")
    args.model = list(dict.fromkeys(args.model or ["smollm2"]))
    args.formats = list(dict.fromkeys(args.formats or ["q4_0"]))
    args.weight_formats = list(dict.fromkeys(args.weight_formats or [DEFAULT_WEIGHT_FORMAT]))
    return args


def _reexec_restricted(restrict: str, argv: list[str]) -> None:
    """Start this bench again with the restriction's variables set (torch reads them once,
    at start-up); returns only when they are already in force."""
    env = RESTRICTIONS[restrict]
    if all(os.environ.get(k) == v for k, v in env.items()):
        return
    print(f"re-executing with {' '.join(f'{k}={v}' for k, v in env.items())} (ours only: "
          "llama.cpp shares the process and is not restricted)", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "skippy.evals.bench_runtime", *argv],
              {**os.environ, **env})


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print the table, write JSON (and its plot) if asked; returns the
    JSON figures."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.llama_cpp:
        sys.path.insert(0, str(args.llama_cpp.resolve()))
    import llama_cpp

    if args.plot:  # the same as `python -m skippy.evals.plots JSON --bench bench_runtime`
        result = json.loads(args.plot.read_text())
        print(plots.render(result, plots.png_for(args.plot), "bench_runtime"))
        return result
    if args.restrict:
        _reexec_restricted(args.restrict, argv)
    out = sys.stderr if args.json == "-" else sys.stdout
    say = Console()  # progress, on stderr
    result = {
        "llama_cpp_version": getattr(llama_cpp, "__version__", "?"),
        "torch_version": torch.__version__,
        "environment": environment(args.weight_formats, args.restrict),
        "threads": args.threads,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "tokens": args.tokens,
        "decode_steps": args.decode_steps,
        "bandwidth_gb_s": BANDWIDTH_GB_S,
        "runs": [],
    }
    files = {m: model_files(m, args.formats, say) for m in args.model}
    cells = [(m, f, w) for m in args.model for f in args.formats for w in args.weight_formats]
    result["runs"] += [
        bench_one(m, f, files[m][f], repeats=args.repeats, warmup=args.warmup,
                  threads=args.threads, data=args.data, say=say, weight_format=w,
                  lanes=args.lanes, tokens=args.tokens, decode_steps=args.decode_steps)
        for m, f, w in tracked(cells, "bench_runtime", "run", say=say)]
    print(_table(result), file=out, flush=True)
    png = plots.write(result, args.json, "bench_runtime")
    if png:
        say(f"plot: {png}")
    return result


if __name__ == "__main__":
    guarded(main)
