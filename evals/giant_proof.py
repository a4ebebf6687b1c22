"""A model no stage holds whole: synthesize, split into a package, serve across 3 stages.

1. `write_synthetic` a deepseek2-shaped mixture of experts of about --size-gib (multi-head
   latent attention, a dense first layer, then MoE layers with shared experts and grouped
   routing; as many layers as the size asks), streamed tensor by tensor.
2. `split_package` it (also streamed), then delete the GGUF unless --keep: from here on
   only the package exists.
3. `RayEngine(package, 3)` (embedded Ray, torch runtime) in the compact weight format
   (int4-lean: no bf16 copy; an f16 source goes to int8, so a stage holds half its
   share of the file): each stage actor opens only its parts and builds one layer at a
   time; the gateway in front of them answers one chat request over HTTP.
4. Print each stage actor's peak RSS (VmHWM) and RSS after load, against the limit
   half the model's size + --allowance-mib.
5. Certify the last stage alone (`skippy certify --stage A..B`: synthetic upstream
   activations, none of the earlier layers built).
Exit status 1 if a stage's peak is over the limit, the certify fails or no answer came.
`--json P` also draws P.png: each stage's peak RSS against the limit, and the times.

`--dtype f32 --weight-format fp32` measures the split alone (stages hold what the file
holds).

Run it in a loopback-only namespace (DESIGN.md §9), niced:

    unshare -n bash -c 'ip link set lo up; RAY_AUTH_MODE=disabled nice -n 19 \\
        .venv/bin/python -m skippy.evals.giant_proof --size-gib 5'
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
import urllib.request
from pathlib import Path

from skippy.evals import plots
from skippy.topology.families import DEEPSEEK2
from skippy.evals.entry import guarded

# The giant: deepseek2-shaped (multi-head latent attention, a dense first layer, then
# mixture-of-experts layers with shared experts and grouped routing), the shape of today's
# giant models. CI runs the same path on SMALL (about 300 MB).
# DeepSeek-V3's attention sizes at head_dim 128 (kv_lora 512, q_lora 1536, rope 64); 64
# experts of width 512 per layer, 6 used, in 8 groups of which 4 are searched, 1 shared.
GIANT = {"arch": DEEPSEEK2.name, "dims": {"hidden": 1024, "ff": 2048, "heads": 8, "kv_heads": 1},
         "options": {"experts": 64, "experts_used": 6, "expert_groups": 8, "groups_used": 4}}
SMALL = {"arch": DEEPSEEK2.name, "dims": {"hidden": 512, "ff": 256, "heads": 8, "kv_heads": 1},
         "options": {}}
STAGES = 3
CHAT = {"messages": [{"role": "user", "content": "Hello, giant!"}],
        "max_tokens": 4, "temperature": 0}


def _vm(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def layers_for(size: float, shape: dict, vocab: int, dtype: str) -> int:
    """Layers that bring a synthetic model of this shape to about `size` bytes."""
    from skippy.stages.synth import synth_bytes

    def total(layers: int) -> int:
        return synth_bytes(shape["arch"], layers=layers, vocab=vocab, dtype=dtype,
                           **shape["options"], **shape["dims"])
    per_layer = total(STAGES + 1) - total(STAGES)
    return max(STAGES, STAGES + round((size - total(STAGES)) / per_layer))


def run(size_gib: float, work: Path, *, shape: dict = GIANT, dtype: str = "f16",
        weight_format: str = "int4-lean", allowance_mib: int = 512, keep: bool = False,
        say=print) -> dict:
    from skippy.mesh.models import pull
    from skippy.mesh.progress import progress_bar
    from skippy.stages.certify_range import certify_range
    from skippy.stages.package import split_package
    from skippy.stages.synth import write_synthetic
    from skippy.topology.gguf_file import GGUFFile

    work.mkdir(parents=True, exist_ok=True)
    tokenizer = pull("smollm2")
    vocab = GGUFFile(tokenizer).tensors["token_embd.weight"].shape[1]
    arch = shape["arch"]
    layers = layers_for(size_gib * 2**30, shape, vocab, dtype)
    gguf, pkg = work / f"giant-{arch}-L{layers}-{dtype}.gguf", work / "package"
    t = time.monotonic()
    if not gguf.exists():
        say(f"synth: {arch}, {layers} layers, {dtype}, {shape['dims']} {shape['options']} "
            f"-> {gguf}")
        write_synthetic(arch, layers=layers, seed=1, out=gguf, tokenizer_from=tokenizer,
                        dtype=dtype, **shape["options"], **shape["dims"])
    model_bytes = gguf.stat().st_size
    synth_s = time.monotonic() - t
    if pkg.exists():
        shutil.rmtree(pkg)
    t = time.monotonic()
    rss_before_split = _vm("VmRSS")
    with progress_bar(None, f"split {gguf.name}", "B", say=say) as bar:
        manifest = split_package(gguf, pkg, progress=bar.to)
    split_s = time.monotonic() - t
    split_peak = _vm("VmHWM")
    largest = max(ti.nbytes for p in manifest.parts for ti in p.tensors)
    if not keep:
        gguf.unlink()
    say(f"model {model_bytes / 2**30:.2f} GiB, {layers} layers; synth {synth_s:.0f} s, "
        f"split {split_s:.0f} s into {len(manifest.parts)} parts")
    report = _serve(pkg, weight_format, say)
    last = report["stages"][-1]["layers"]
    t = time.monotonic()
    cert = certify_range(pkg, last[0], last[1], weight_format=weight_format)
    say(cert.table())
    report["last_stage_certify"] = {**cert.as_dict(), "layers": last,
                                    "seconds": round(time.monotonic() - t)}
    limit = model_bytes // 2 + allowance_mib * 2**20
    report.update(model_bytes=model_bytes, layers=layers, dtype=dtype, limit_bytes=limit,
                  arch=arch,
                  weight_format=weight_format,
                  synth_s=round(synth_s, 1), split_s=round(split_s, 1),
                  largest_tensor_bytes=largest, driver_rss_before_split=rss_before_split,
                  driver_peak_rss=max(split_peak, _vm("VmHWM")),
                  passed=all(s["peak_rss"] < limit for s in report["stages"])
                  and cert.passed and bool(report["chat"]["content"]))
    return report


def _serve(pkg: Path, weight_format: str, say) -> dict:
    """Serve the package on 3 stage actors behind the gateway; one chat request over HTTP;
    each stage's memory. The gateway closes the engine as it stops."""
    import ray

    from skippy.mesh.control.ray_engine import RayEngine
    from skippy.mesh.front.gateway import BackgroundServer, create_app

    t = time.monotonic()
    engine = RayEngine(pkg, STAGES, n_ctx=256, progress=say, weight_format=weight_format)
    load_s = time.monotonic() - t
    with BackgroundServer(create_app(engine, api_keys=(), close_engine=True)) as srv:
        with urllib.request.urlopen(srv.url + "/v1/models", timeout=60) as r:
            model = json.loads(r.read())["data"][0]["id"]
        t = time.monotonic()
        request = urllib.request.Request(srv.url + "/v1/chat/completions",
                                         data=json.dumps({**CHAT, "model": model}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as r:
            status, body = r.status, json.loads(r.read())
        chat_s = time.monotonic() - t
        memory = ray.get([a.memory.remote() for a in engine.actors], timeout=60)
        ranges = [[s.start, s.end] for s in engine.plan.stages]
    say(f"chat over HTTP: {status} in {chat_s:.1f} s")
    return {"load_s": round(load_s, 1),
            "chat": {"status": status, "seconds": round(chat_s, 1),
                     "content": body["choices"][0]["message"]["content"],
                     "usage": body["usage"]},
            "stages": [{"layers": r, **m} for r, m in zip(ranges, memory)]}


def table(r: dict) -> str:
    mib = 2**20
    lines = [f"model {r['arch']} {r['model_bytes'] / 2**30:.2f} GiB ({r['layers']} layers, "
             f"{r['dtype']}); "
             f"limit per stage: half the model + allowance = {r['limit_bytes'] / mib:.0f} MiB",
             f"split: {r['split_s']} s; largest tensor {r['largest_tensor_bytes'] / mib:.0f} "
             f"MiB; driver peak RSS {r['driver_peak_rss'] / mib:.0f} MiB",
             f"served 3 stages ({r['weight_format']}), loaded in {r['load_s']} s",
             "stage  layers    peak RSS MiB  RSS MiB  under limit"]
    for i, s in enumerate(r["stages"]):
        a, b = s["layers"]
        under = "yes" if s["peak_rss"] < r["limit_bytes"] else "NO"
        lines.append(f"{i:<5}  {a:>3}-{b - 1:<4}  {s['peak_rss'] / mib:>12.0f}  "
                     f"{s['rss'] / mib:>7.0f}  {under}")
    lines.append(f"chat over HTTP: {r['chat']['content']!r} ({r['chat']['usage']})")
    cert = r["last_stage_certify"]
    lines.append(f"last stage (layers {cert['layers'][0]}-{cert['layers'][1] - 1}) certified "
                 f"alone, synthetic upstream, in "
                 f"{cert['seconds']} s: {'PASS' if cert['passed'] else 'FAIL'}")
    lines.append("PASS" if r["passed"] else "FAIL: a stage over its limit, a failed "
                 "certify or no chat answer")
    return "\n".join(lines)


def plot(result: dict):
    """Each stage actor's peak RSS and RSS after load against the limit (half the model +
    the allowance), the driver's peak beside them (left); where the time went (right)."""
    mib = plots.MIB
    stages = result["stages"]
    fig, ((mem, time_),) = plots.figure(1, 2, title=(
        f"a {result['model_bytes'] / 2**30:.2f} GiB {result['arch']} ({result['layers']} "
        f"layers, {result['dtype']}) served on {len(stages)} stages in "
        f"{result['weight_format']}: {'PASS' if result['passed'] else 'FAIL'}"))
    labels = [f"stage {i}\nlayers {a}-{b - 1}" for i, (a, b) in
              enumerate(s["layers"] for s in stages)] + ["driver"]
    plots.bars(mem, labels, {
        "peak RSS": [s["peak_rss"] / mib for s in stages] + [result["driver_peak_rss"] / mib],
        "RSS after load": [s["rss"] / mib for s in stages] + [0]})
    mem.axhline(result["limit_bytes"] / mib, color=plots.FAIL, linestyle="--",
                label=f"stage limit {result['limit_bytes'] / mib:.0f} MiB")
    mem.axhline(result["model_bytes"] / mib, color="black", linestyle=":",
                label="the whole model")
    plots.finish(mem, title="memory per process", ylabel="MiB")
    cert = result["last_stage_certify"]
    parts = {"synth": result["synth_s"], "split": result["split_s"], "load": result["load_s"],
             "chat": result["chat"]["seconds"], "certify last stage": cert["seconds"]}
    time_.barh(list(parts), list(parts.values()), color=plots.OURS)
    time_.invert_yaxis()
    plots.finish(time_, title=f"seconds (certify: {'PASS' if cert['passed'] else 'FAIL'})",
                 xlabel="s", legend=False)
    return fig


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m skippy.evals.giant_proof",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=5.0)
    p.add_argument("--small", action="store_true", help="CI's shape (hidden 512)")
    p.add_argument("--dtype", choices=("f32", "f16"), default="f16")
    p.add_argument("--weight-format", default="int4-lean", help="the stages' weight format")
    p.add_argument("--allowance-mib", type=int, default=512)
    p.add_argument("--work", type=Path, default=Path("/tmp/skippy-giant"))
    p.add_argument("--keep", action="store_true", help="keep the source GGUF")
    p.add_argument("--json", type=Path, help="write the report here too (and a plot: the "
                   "path with .png)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    from skippy.mesh.progress import Console
    args = parse_args(argv)
    report = run(args.size_gib, args.work, shape=SMALL if args.small else GIANT,
                 dtype=args.dtype, weight_format=args.weight_format,
                 allowance_mib=args.allowance_mib, keep=args.keep,
                 say=Console())  # stderr; bars for the split and the stages' loading
    print(table(report))
    plots.write(report, args.json, "giant_proof")
    return report


if __name__ == "__main__":
    sys.exit(0 if guarded(main)["passed"] else 1)
