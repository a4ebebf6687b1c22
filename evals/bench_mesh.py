"""What the data path costs: one hop between stages, and a whole 2-stage decode.

(i) per hop: one activation frame ([1, 576] and [128, 576] f16, SmolLM2's width) sent to
    a stage and answered, two ways into the same Ray actor process:
    - gRPC: a `Session` stream as stage i holds it to stage i+1 (`GrpcLink.ask`), the
      frame encoded with `frame_to_proto` and decoded at the far end;
    - Ray: an actor method call carrying the f16 tensor (pickled; object store above
      Ray's inline limit).
(ii) the requirement: a 2-stage split decodes within 1.15x the per-token time of one
    stage on the same runtime. RayEngine(smollm2, 1) and then RayEngine(smollm2, 2)
    (torch runtime, embedded Ray, one at a time) generate 64 greedy tokens from the same
    prompt a few times (probe requests: no cache serves any of it); per-token decode
    time = (last token - first token) / 63; medians, the ratio, met or not. The stages'
    own compute per decode step (their figures) shows what the chain adds.

Run it in a loopback-only namespace (DESIGN.md §9):

    unshare -n bash -c 'ip link set lo up; RAY_AUTH_MODE=disabled \\
        .venv/bin/python -m skippy.evals.bench_mesh --json mesh.json'

`--json P` also draws P.png: the hop round trips, and the per-token decode time by stage
count against the target.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import types
from pathlib import Path

import torch

from skippy.evals import plots
from skippy.evals.bench_runtime import environment
from skippy.mesh.progress import Console, tracked
from skippy.stages.runtime import DEFAULT_WEIGHT_FORMAT
from skippy.evals.entry import guarded

HOP_SHAPES = ((1, 576), (128, 576))
DECODE_TOKENS = 64
HOP_MESSAGE_LIMIT = 8 << 20  # the largest hop frame, [128, 576] f16, with room to spare
SPLIT_TARGET = 1.1  # 2-stage per-token decode time / 1-stage, at most (issue 32)
PROMPT = ("The harbour town woke slowly. Fishing boats came back with the tide, gulls "
          "argued over the nets, and the baker opened his shutters to a queue of people. "
          "Tell me what happened next in the town.")


# -- (i) one hop ----------------------------------------------------------------------------------
def _echo_actor_class():
    """A Ray actor serving a trivial Stage service over gRPC and an equivalent Ray method:
    both decode the frame they get and answer with its row count."""
    import ray

    from skippy.mesh.stage.grpc_service import serve
    from skippy.mesh.stage.local_link import LocalListener
    from skippy.mesh.wire import frame_from_proto
    from skippy.proto import stage_pb2 as pb
    from skippy.proto import stage_pb2_grpc

    class EchoStage(stage_pb2_grpc.StageServicer):
        server = types.SimpleNamespace(local_streams=0)  # what the socket's listener counts

        def Session(self, calls, context):
            for call in calls:
                frame = frame_from_proto(call.decode.frame)
                yield pb.StageResult(token=pb.Token(id=int(frame.rows.shape[0])))

    @ray.remote(num_cpus=0)
    class EchoActor:
        def __init__(self, host: str, credentials):
            echo = EchoStage()
            self._server, self._address = serve(echo, host, credentials,
                                                max_message=HOP_MESSAGE_LIMIT)
            # the same service on its socket, as a stage serves one on its node
            self._local = LocalListener(echo, self._address, credentials.token, 4)

        def address(self) -> str:
            return self._address

        def echo(self, rows: torch.Tensor) -> int:
            return int(rows.shape[0])

    return EchoActor


def _timed(fn, repeats: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def bench_hops(repeats: int, warmup: int = 20, say=print) -> list[dict]:
    """Per-hop round trips (ms) for each frame shape, gRPC vs Ray, into one actor."""
    import ray

    from skippy.mesh.stage.channels import channel_options
    from skippy.mesh.stage.grpc_service import GrpcLink
    from skippy.mesh.stage.local_link import LocalOpener
    from skippy.mesh.stage.security import StageCredentials, new_secret
    from skippy.mesh.wire import frame_to_proto
    from skippy.proto import stage_pb2 as pb
    from skippy.proto import stage_pb2_grpc
    from skippy.stages.frame import Frame

    credentials = StageCredentials.plain(new_secret())  # a stage's calls carry its token
    actor = _echo_actor_class().remote("127.0.0.1", credentials)
    channel = None
    try:
        address = ray.get(actor.address.remote(), timeout=120)
        channel = credentials.channel(address, channel_options(HOP_MESSAGE_LIMIT))
        down = GrpcLink(stage_pb2_grpc.StageStub(channel), credentials.metadata)
        local = LocalOpener(address, credentials.token)()
        rows_out = []
        for n, width in tracked(HOP_SHAPES, "hops", "shape", say=say):
            rows = torch.randn(n, width).to(torch.float16)
            frame = Frame(0, rows, torch.ones(n, dtype=torch.float32))

            def over_grpc(frame=frame, n=n):
                reply = down.ask(pb.StageCall(decode=pb.Decode(token=0,
                                                               frame=frame_to_proto(frame))))
                assert reply.token.id == n

            def over_socket(frame=frame, n=n):
                reply = local.ask(pb.StageCall(decode=pb.Decode(token=0,
                                                                frame=frame_to_proto(frame))))
                assert reply.token.id == n

            def over_ray(rows=rows, n=n):
                assert ray.get(actor.echo.remote(rows)) == n

            say(f"  hop [{n}, {width}] f16 ...")
            g = _timed(over_grpc, repeats, warmup)
            u = _timed(over_socket, repeats, warmup)
            r = _timed(over_ray, repeats, warmup)
            rows_out.append({"shape": [n, width], "bytes": n * width * 2,
                             "grpc_ms": statistics.median(g), "socket_ms": statistics.median(u),
                             "ray_ms": statistics.median(r),
                             "grpc_samples_ms": g, "socket_samples_ms": u,
                             "ray_samples_ms": r})
        down.close()
        local.end()
        return rows_out
    finally:
        if channel is not None:
            channel.close()
        ray.kill(actor, no_restart=True)


# -- (ii) the split's decode cost -------------------------------------------------------------------
async def _decode_runs(engine, tokens: list[int], runs: int, n_tokens: int) -> list[float]:
    """Per-token decode ms of each run: (last step - first step) / (n - 1)."""
    from skippy.mesh.control.engine import GenerationRequest

    request = GenerationRequest(tokens=tuple(tokens), max_tokens=n_tokens, probe=True)
    out = []
    for _ in range(runs):
        stamps = []
        async for _step in engine.generate(request):
            stamps.append(time.perf_counter())
        if len(stamps) != n_tokens:
            raise RuntimeError(f"expected {n_tokens} tokens, got {len(stamps)}")
        out.append((stamps[-1] - stamps[0]) / (n_tokens - 1) * 1e3)
    return out


def _stage_decode_ms(before: dict, after: dict) -> list[float]:
    """Each stage's own compute per decode step between two figure snapshots."""
    out = []
    for b, a in zip(before["stages"], after["stages"]):
        steps = a["steps"]["decode"] - b["steps"]["decode"]
        secs = a["seconds"]["decode"] - b["seconds"]["decode"]
        out.append(secs / steps * 1e3 if steps else float("nan"))
    return out


def bench_split(path: Path, stage_counts: tuple[int, ...], runs: int, n_tokens: int,
                n_ctx: int = 2048, say=print, weight_format: str = "int4") -> list[dict]:
    """Per-token decode time for each stage count: every engine up at once (idle stages
    sleep), their runs taken in turn, the order reversed each round, so the machine's
    drift (this VM's speed moves by 1.3x within minutes) falls on every count alike."""
    from skippy.mesh.front.chat import render_chat
    from skippy.mesh.control.ray_engine import RayEngine
    from skippy.mesh.tokenizer import Tokenizer

    tok = Tokenizer(path)
    tokens = tok.encode(render_chat(path, [{"role": "user", "content": PROMPT}]))
    tok.close()
    engines, results = [], []
    try:
        for n in tracked(stage_counts, "split", "engine", say=say):
            say(f"  RayEngine({path.name}, {n}) ...")
            t = time.perf_counter()
            engines.append(RayEngine(path, n, n_ctx=n_ctx, weight_format=weight_format,
                                     progress=lambda m: None))
            results.append({"stages": n, "load_s": time.perf_counter() - t, "samples_ms": []})
            asyncio.run(_decode_runs(engines[-1], tokens, 1, n_tokens))   # warm-up
        before = [e.stats() for e in engines]
        for r in range(runs):
            for i in (range(len(engines)) if r % 2 == 0 else reversed(range(len(engines)))):
                results[i]["samples_ms"] += asyncio.run(
                    _decode_runs(engines[i], tokens, 1, n_tokens))
        for engine, b, result in zip(engines, before, results):
            stage_ms = _stage_decode_ms(b, engine.stats())
            per_token = result["samples_ms"]
            # the stages' figures are means over the same steps: compare means
            result.update(per_token_ms=statistics.median(per_token), stage_compute_ms=stage_ms,
                          chain_overhead_ms=statistics.mean(per_token) - sum(stage_ms))
    finally:
        for engine in engines:
            asyncio.run(engine.close())
    return results


def split_verdict(split: list[dict], target: float = SPLIT_TARGET) -> dict | None:
    """The 2-stage / 1-stage per-token ratio against the target (None without both): the
    median of the runs' paired ratios (each pair ran back to back)."""
    by = {r["stages"]: r["samples_ms"] for r in split}
    if 1 not in by or 2 not in by:
        return None
    pairs = [b / a for a, b in zip(by[1], by[2])]
    ratio = statistics.median(pairs)
    return {"ratio": ratio, "pairs": pairs, "target": target, "met": bool(ratio <= target)}


# -- report ----------------------------------------------------------------------------------------
def table(result: dict) -> str:
    lines = [f"(i) one hop into a Ray actor: median round trip of {result['repeats']} "
             f"(frame encoded, sent, decoded, answered)",
             f"{'frame':<14} {'KiB':>6} {'gRPC ms':>8} {'socket ms':>10} {'Ray ms':>8} "
             f"{'Ray/gRPC':>9}"]
    for h in result["hops"]:
        lines.append(f"{'[%d, %d] f16' % tuple(h['shape']):<14} {h['bytes'] / 1024:>6.1f} "
                     f"{h['grpc_ms']:>8.2f} {h['socket_ms']:>10.2f} {h['ray_ms']:>8.2f} "
                     f"{h['ray_ms'] / h['grpc_ms']:>8.2f}x")
    lines += ["", f"(ii) decode through RayEngine, torch runtime, {result['decode_tokens']} "
                  f"greedy tokens, median of {result['runs']} runs after a warm-up, the "
                  f"engines' runs in turn",
              f"{'stages':>6} {'per token ms':>13} {'stage compute ms':>20} "
              f"{'chain adds ms':>14}"]  # mean per token - stages' mean compute
    for s in result["split"]:
        compute = " + ".join(f"{x:.2f}" for x in s["stage_compute_ms"])
        lines.append(f"{s['stages']:>6} {s['per_token_ms']:>13.2f} {compute:>20} "
                     f"{s['chain_overhead_ms']:>14.2f}")
    v = result.get("verdict")
    if v:
        pairs = " ".join(f"{x:.2f}" for x in v.get("pairs", ()))
        lines.append(f"2 stages / 1 stage: {v['ratio']:.2f}x, median of the runs' pairs "
                     f"({pairs}) (target <= {v['target']}x): {'met' if v['met'] else 'NOT met'}")
    lines.append(f"load average before/after: {result['loadavg_before']} / "
                 f"{result['loadavg_after']} (2 cores: above ~1 the figures are noisy)")
    return "\n".join(lines)


def plot(result: dict):
    """Round trip of one hop, gRPC vs Ray, per frame (left); per-token decode time by stage
    count, the stages' own compute stacked under what the chain adds, with the target
    (right)."""
    fig, ((hops, split),) = plots.figure(1, 2, title=(
        f"the data path: {result['model']} ({result['weight_format']})"))
    if result["hops"]:
        plots.bars(hops, [f"[{a}, {b}] f16\n{h['bytes'] / 1024:.0f} KiB"
                          for h in result["hops"] for a, b in [h["shape"]]],
                   {"gRPC stream": [h["grpc_ms"] for h in result["hops"]],
                    "socket (one node)": [h["socket_ms"] for h in result["hops"]],
                    "Ray actor call": [h["ray_ms"] for h in result["hops"]]})
        plots.finish(hops, title=f"one hop, median of {result['repeats']} round trips",
                     ylabel="ms")
    else:
        plots.empty(hops, "hops not measured (--skip-hops)")
    if result["split"]:
        xs = range(len(result["split"]))
        bottom = [0.0] * len(result["split"])
        for i in range(max(len(s["stage_compute_ms"]) for s in result["split"])):
            part = [s["stage_compute_ms"][i] if i < len(s["stage_compute_ms"]) else 0.0
                    for s in result["split"]]
            split.bar(xs, part, 0.5, bottom=bottom, label=f"stage {i} compute")
            bottom = [b + p for b, p in zip(bottom, part)]
        split.bar(xs, [max(0.0, s["chain_overhead_ms"]) for s in result["split"]], 0.5,
                  bottom=bottom, color="lightgrey", label="the chain adds")
        split.scatter(xs, [s["per_token_ms"] for s in result["split"]], color="black",
                      zorder=3, label="per token (median)")
        v = result.get("verdict")
        if v:
            one = next(s["per_token_ms"] for s in result["split"] if s["stages"] == 1)
            split.axhline(one * v["target"], color="black", linestyle="--", linewidth=1,
                          label=f"target {v['target']}x one stage")
        split.set_xticks(list(xs), [f"{s['stages']} stage(s)" for s in result["split"]])
        plots.finish(split, title=f"decode, {result['decode_tokens']} tokens, median of "
                                  f"{result['runs']} runs", ylabel="ms per token")
    else:
        plots.empty(split, "split not measured (--skip-split)")
    return fig


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m skippy.evals.bench_mesh",
                                description="Per-hop cost (gRPC vs Ray) and 2-stage decode "
                                            "cost against one stage.")
    p.add_argument("--model", default="smollm2", help="model name or .gguf (default smollm2)")
    p.add_argument("--weight-format", default=DEFAULT_WEIGHT_FORMAT,
                   help=f"the stages' weight format (default {DEFAULT_WEIGHT_FORMAT}, as serve)")
    p.add_argument("--repeats", type=int, default=200, help="hop round trips timed (200)")
    p.add_argument("--runs", type=int, default=10, help="timed decode runs per engine (10)")
    p.add_argument("--tokens", type=int, default=DECODE_TOKENS, help="tokens per run (64)")
    p.add_argument("--skip-hops", action="store_true", help="only (ii)")
    p.add_argument("--skip-split", action="store_true", help="only (i)")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH "
                                                  "('-': JSON on stdout, table on stderr)")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.runs < 1 or args.tokens < 2:
        p.error("--repeats and --runs must be >= 1, --tokens >= 2")
    return args


def main(argv: list[str] | None = None) -> dict:
    import ray

    from skippy.evals.bench_gateway import emit, loadavg
    from skippy.mesh.models import resolve_model
    from skippy.mesh.control.ray_engine import start_ray

    args = parse_args(argv)
    say = Console()  # progress, on stderr
    path = resolve_model(args.model)
    result = {"model": args.model, "file": str(path), "weight_format": args.weight_format,
              "repeats": args.repeats,
              "runs": args.runs, "decode_tokens": args.tokens, "loadavg_before": loadavg(),
              "environment": environment([args.weight_format], None),
              "hops": [], "split": []}
    owns_ray = start_ray()
    try:
        if not args.skip_hops:
            say("(i) per hop")
            result["hops"] = bench_hops(args.repeats, say=say)
        if not args.skip_split:
            say("(ii) 1 vs 2 stages")
            result["split"] = bench_split(path, (1, 2), args.runs, args.tokens, say=say,
                                          weight_format=args.weight_format)
            result["verdict"] = split_verdict(result["split"])
    finally:
        if owns_ray:
            ray.shutdown()
    result["loadavg_after"] = loadavg()
    emit(result, table(result), args.json, "bench_mesh")
    return result


if __name__ == "__main__":
    guarded(main)
