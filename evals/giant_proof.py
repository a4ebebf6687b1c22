"""A model no stage holds whole: synthesize, split into a package, serve across 3 stages.

1. `write_synthetic` a qwen3 of about --size-gib (hidden 2048, ff 5632, 16 heads / 8 KV
   heads; as many layers as the size asks), streamed tensor by tensor.
2. `split_package` it (also streamed), then delete the GGUF unless --keep: from here on
   only the package exists.
3. `RayEngine(package, 3)` (embedded Ray, torch runtime) in the compact weight format
   (int4-lean: no bf16 copy; an f16 source goes to int8, so a stage holds half its
   share of the file): each stage actor opens only its parts and builds one layer at a
   time; generate a few greedy tokens.
4. Print each stage actor's peak RSS (VmHWM) and RSS after load, against the limit
   half the model's size + --allowance-mib. Exit status 1 if a stage's peak is over it.

`--dtype f32 --weight-format fp32` measures the split alone (stages hold what the file
holds).

Run it in a loopback-only namespace (DESIGN.md §9), niced:

    unshare -n bash -c 'ip link set lo up; RAY_AUTH_MODE=disabled nice -n 19 \\
        .venv/bin/python -m skippy.evals.giant_proof --size-gib 5'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
from pathlib import Path

GIANT_DIMS = {"hidden": 2048, "ff": 5632, "heads": 16, "kv_heads": 8}
SMALL_DIMS = {"hidden": 512, "ff": 1536, "heads": 8, "kv_heads": 4}
STAGES = 3
GENERATE_TOKENS = 4


def _vm(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _bytes_per_layer(d: dict, itemsize: int) -> int:
    head_dim = d["hidden"] // d["heads"]
    q, kv = d["heads"] * head_dim, d["kv_heads"] * head_dim
    weights = 2 * q * d["hidden"] + 2 * kv * d["hidden"] + 3 * d["ff"] * d["hidden"]
    return weights * itemsize + (2 * d["hidden"] + 2 * head_dim) * 4


def layers_for(size: float, dims: dict, vocab: int, itemsize: int) -> int:
    """Layers that bring a model with these dims (untied head) to about `size` bytes."""
    ends = 2 * vocab * dims["hidden"] * itemsize
    return max(STAGES, round((size - ends) / _bytes_per_layer(dims, itemsize)))


def run(size_gib: float, work: Path, *, dims: dict = GIANT_DIMS, dtype: str = "f16",
        weight_format: str = "int4-lean", allowance_mib: int = 512, keep: bool = False,
        say=print) -> dict:
    from skippy.mesh.models import pull
    from skippy.stages.package import split_package
    from skippy.stages.synth import write_synthetic
    from skippy.topology.gguf_file import GGUFFile

    work.mkdir(parents=True, exist_ok=True)
    tokenizer = pull("smollm2")
    vocab = GGUFFile(tokenizer).tensors["token_embd.weight"].shape[1]
    itemsize = 4 if dtype == "f32" else 2
    layers = layers_for(size_gib * 2**30, dims, vocab, itemsize)
    gguf, pkg = work / f"giant-L{layers}-{dtype}.gguf", work / "package"
    t = time.monotonic()
    if not gguf.exists():
        say(f"synth: qwen3, {layers} layers, {dtype}, {dims} -> {gguf}")
        write_synthetic("qwen3", layers=layers, seed=1, out=gguf, tokenizer_from=tokenizer,
                        dtype=dtype, **dims)
    model_bytes = gguf.stat().st_size
    synth_s = time.monotonic() - t
    if pkg.exists():
        shutil.rmtree(pkg)
    t = time.monotonic()
    rss_before_split = _vm("VmRSS")
    manifest = split_package(gguf, pkg)
    split_s = time.monotonic() - t
    split_peak = _vm("VmHWM")
    largest = max(ti.nbytes for p in manifest.parts for ti in p.tensors)
    if not keep:
        gguf.unlink()
    say(f"model {model_bytes / 2**30:.2f} GiB, {layers} layers; synth {synth_s:.0f} s, "
        f"split {split_s:.0f} s into {len(manifest.parts)} parts")
    report = _serve(pkg, weight_format, say)
    limit = model_bytes // 2 + allowance_mib * 2**20
    report.update(model_bytes=model_bytes, layers=layers, dtype=dtype, limit_bytes=limit,
                  weight_format=weight_format,
                  synth_s=round(synth_s, 1), split_s=round(split_s, 1),
                  largest_tensor_bytes=largest, driver_rss_before_split=rss_before_split,
                  driver_peak_rss=max(split_peak, _vm("VmHWM")),
                  passed=all(s["peak_rss"] < limit for s in report["stages"]))
    return report


def _serve(pkg: Path, weight_format: str, say) -> dict:
    from skippy.mesh.control.engine import GenerationRequest
    from skippy.mesh.control.ray_engine import RayEngine

    t = time.monotonic()
    engine = RayEngine(pkg, STAGES, n_ctx=256, progress=say, weight_format=weight_format)
    load_s = time.monotonic() - t

    async def generate() -> list[int]:
        req = GenerationRequest(tokens=tuple(range(1, 17)), max_tokens=GENERATE_TOKENS,
                                probe=True)
        return [step.token async for step in engine.generate(req)]

    async def finish(tokens: list[int]) -> dict:
        import ray
        memory = ray.get([a.memory.remote() for a in engine.actors], timeout=60)
        ranges = [[s.start, s.end] for s in engine.plan.stages]
        await engine.close()
        return {"tokens": tokens, "load_s": round(load_s, 1),
                "stages": [{"layers": r, **m} for r, m in zip(ranges, memory)]}

    async def main() -> dict:
        tokens = await generate()
        return await finish(tokens)
    return asyncio.run(main())


def table(r: dict) -> str:
    mib = 2**20
    lines = [f"model {r['model_bytes'] / 2**30:.2f} GiB ({r['layers']} layers, {r['dtype']}); "
             f"limit per stage: half the model + allowance = {r['limit_bytes'] / mib:.0f} MiB",
             f"split: {r['split_s']} s; largest tensor {r['largest_tensor_bytes'] / mib:.0f} "
             f"MiB; driver peak RSS {r['driver_peak_rss'] / mib:.0f} MiB",
             f"served 3 stages ({r['weight_format']}), loaded in {r['load_s']} s; "
             f"generated {r['tokens']}",
             "stage  layers    peak RSS MiB  RSS MiB  under limit"]
    for i, s in enumerate(r["stages"]):
        a, b = s["layers"]
        under = "yes" if s["peak_rss"] < r["limit_bytes"] else "NO"
        lines.append(f"{i:<5}  {a:>3}-{b - 1:<4}  {s['peak_rss'] / mib:>12.0f}  "
                     f"{s['rss'] / mib:>7.0f}  {under}")
    lines.append("PASS" if r["passed"] else "FAIL: a stage's peak RSS is over the limit")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m skippy.evals.giant_proof",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=5.0)
    p.add_argument("--small", action="store_true", help="CI dims (hidden 512)")
    p.add_argument("--dtype", choices=("f32", "f16"), default="f16")
    p.add_argument("--weight-format", default="int4-lean", help="the stages' weight format")
    p.add_argument("--allowance-mib", type=int, default=512)
    p.add_argument("--work", type=Path, default=Path("/tmp/skippy-giant"))
    p.add_argument("--keep", action="store_true", help="keep the source GGUF")
    p.add_argument("--json", type=Path, help="write the report here too")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    report = run(args.size_gib, args.work, dims=SMALL_DIMS if args.small else GIANT_DIMS,
                 dtype=args.dtype, weight_format=args.weight_format,
                 allowance_mib=args.allowance_mib, keep=args.keep,
                 say=lambda m: print(m, file=sys.stderr, flush=True))
    print(table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
