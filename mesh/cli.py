"""`skippy`: the command line. Every user mistake becomes one line on stderr, exit code 2."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

EXIT_USAGE = 2


class UsageError(Exception):
    """A mistake in what the user asked for; printed as one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's default prints the whole usage block
        raise UsageError(message)


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- models -------------------------------------------------------------------------------
def cmd_models_pull(args) -> int:
    from .models import pull
    from .progress import Console
    for name in args.names:
        path = pull(name, progress=Console())  # bars on a terminal, lines in a log
        print(path)
    return 0


def cmd_models_list(args) -> int:
    from .models import list_models
    rows = [("NAME", "ARCH", "LAYERS", "SIZE", "QUANT", "PATH")]
    for m in list_models():
        rows.append((m.name, m.architecture, str(m.layers or "-"),
                     f"{m.size_bytes / 2**20:.1f} MiB", m.quant, str(m.path)))
    if len(rows) == 1:
        _say("no models yet; run: skippy models pull smollm2")
        return 0
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    return 0


def cmd_models_synth(args) -> int:
    from skippy.stages.synth import synth_file_name, write_synthetic
    from .models import model_home, resolve_model
    tokenizer = resolve_model(args.tokenizer_from)
    knobs = _synth_knobs(args)
    out = Path(args.out) if args.out else model_home() / "synth" / synth_file_name(
        args.arch, layers=args.layers, seed=args.seed, dtype=args.dtype, **knobs)
    out.parent.mkdir(parents=True, exist_ok=True)
    from .progress import progress_bar
    with progress_bar(None, f"synth {out.name}", "B") as bar:
        path = write_synthetic(args.arch, layers=args.layers, seed=args.seed, out=out,
                               tokenizer_from=tokenizer, dtype=args.dtype, progress=bar.to,
                               chat_template=_template_text(args), **knobs)
    print(path)
    return 0


def _template_text(args) -> str | None:
    if not args.chat_template:
        return None
    try:
        return Path(args.chat_template).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--chat-template: cannot read {args.chat_template}: "
                         f"{getattr(e, 'strerror', None) or e}") from None


def _synth_knobs(args) -> dict[str, object]:
    """The arch's knobs: each --set KEY=VALUE (text, typed by the arch's table when the
    file is written), with the size flags, --rope-freqs and --variant as short forms."""
    from skippy.stages.synth import SynthError
    out: dict[str, object] = {k: v for k in SYNTH_FLAGS
                              if (v := getattr(args, k)) is not None and v is not False}
    for pair in args.set or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SynthError(f"--set takes KEY=VALUE, not {pair!r}")
        out[key] = value
    return out


# Flags that set a synth knob of the same name (stages/synth_table.py SynthTable.knobs).
SYNTH_FLAGS = ("hidden", "ff", "heads", "kv_heads", "head_dim", "rope_freqs", "variant")


# -- generate -----------------------------------------------------------------------------
def cmd_generate(args) -> int:
    import asyncio

    from skippy.cache.config import CacheConfig
    from .front.chat import render_chat
    from .control.local import InProcessEngine
    from .control.engine import GenerationRequest
    from .models import resolve_model
    from .sampler import SamplingParams
    from .tokenizer import Tokenizer

    if not args.prompt.strip():
        raise UsageError("the prompt is empty")
    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be at least 1, not {args.max_tokens}")
    params = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    path = resolve_model(args.model)
    tok = Tokenizer(path)
    text = render_chat(path, [{"role": "user", "content": args.prompt}]) if args.chat \
        else args.prompt
    ids = tok.encode(text)
    engine = InProcessEngine(path, args.stages, wire_dtype=args.wire, n_ctx=args.ctx,
                             cache=CacheConfig(enabled=False))
    request = GenerationRequest(tuple(ids), args.max_tokens, params, frozenset(tok.eog_ids))
    stream = tok.stream_decoder()

    async def run():  # the served path, in this process
        async for step in engine.generate(request):
            sys.stdout.write(stream.push(step.token))
            sys.stdout.flush()
    asyncio.run(run())
    sys.stdout.write(stream.flush() + "\n")
    return 0


# -- certify ------------------------------------------------------------------------------
def cmd_certify(args) -> int:
    import json

    from skippy.stages.certify import certify
    from .models import resolve_model

    if args.stages < 1:
        raise UsageError(f"--stages must be at least 1, not {args.stages}")
    if args.runtime == "llama.cpp" and args.stages != 1:
        raise UsageError("the llama.cpp runtime serves a whole model: use --stages 1")
    # certify() refuses a format the runtime lacks (StageError: one line, exit 2)
    from .progress import progress_bar
    model = resolve_model(args.model)
    if args.stage is not None:
        from skippy.stages.certify_range import certify_range, parse_range
        if args.runtime != "torch":
            raise UsageError("--stage certifies a torch stage: drop --runtime llama.cpp")
        with progress_bar(None, f"certify {model.name} {args.stage}", "step") as bar:
            report = certify_range(model, *parse_range(args.stage),
                                   weight_format=args.weight_format, progress=bar.to)
    else:
        with progress_bar(None, f"certify {model.name}", "step") as bar:
            report = certify(model, args.stages, args.runtime,
                             weight_format=args.weight_format, progress=bar.to)
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.table())
    return 0 if report.passed else 1


def _weight_format(fmt: str | None) -> str:
    from skippy.stages.linear import WEIGHT_FORMATS
    from skippy.stages.runtime import DEFAULT_WEIGHT_FORMAT
    fmt = fmt or DEFAULT_WEIGHT_FORMAT
    if fmt not in WEIGHT_FORMATS:
        raise UsageError(f"--weight-format must be one of {', '.join(WEIGHT_FORMATS)}, "
                         f"not {fmt!r}")
    return fmt


# -- plan -------------------------------------------------------------------------------------
def cmd_plan(args) -> int:
    import functools
    import json

    from skippy.stages.linear import held_bytes
    from skippy.topology.planner import ModelFacts, load_nodes, local_node, plan
    from .models import resolve_model

    nodes = load_nodes(args.nodes) if args.nodes else [local_node()]
    fmt = _weight_format(args.weight_format)
    facts = ModelFacts.from_gguf(resolve_model(args.model),
                                 tensor_bytes=functools.partial(held_bytes, fmt))
    result = plan(facts, nodes, wire_dtype=args.wire, n_ctx=args.ctx, lanes=args.lanes,
                  stages=args.stages, max_stages=args.max_stages)
    print(json.dumps(result.as_dict(), indent=2) if args.json else result.table())
    return 0


# -- package ----------------------------------------------------------------------------------
def cmd_package_split(args) -> int:
    from skippy.stages.package import split_package
    from .models import resolve_model
    from .progress import progress_bar
    model = resolve_model(args.model)
    with progress_bar(None, f"split {model.name}", "B") as bar:
        manifest = split_package(model, args.out, progress=bar.to)
    size = sum(p.size for p in manifest.parts)
    print(f"{args.out}: {len(manifest.parts)} parts, {size / 2**20:.1f} MiB, "
          f"model {manifest.model_digest[:16]}")
    return 0


def cmd_package_verify(args) -> int:
    from skippy.topology.model_package import verify_package
    from .progress import Console, progress_bar
    console = Console()
    # a log hears verify's progress only when asked: a clean run stays one line
    say = console if console.tty or args.verbose else (lambda _line: None)
    with progress_bar(None, f"verify {Path(args.dir).name}", "B", say=say) as bar:
        manifest = verify_package(args.dir, progress=bar.to)
    print(f"{args.dir}: {len(manifest.parts)} parts verified")
    return 0


# -- serve ------------------------------------------------------------------------------------
def cmd_serve(args) -> int:
    from skippy.topology.model_package import is_package
    from .cache_flags import cache_config
    from .models import resolve_model

    if args.stages is not None and args.stages < 1:
        raise UsageError(f"--stages must be at least 1, not {args.stages}")
    if args.runtime == "llama.cpp" and args.stages not in (None, 1):
        raise UsageError("the llama.cpp runtime serves a whole model: use --stages 1")
    if args.pipelines < 1:
        raise UsageError(f"--pipelines must be at least 1, not {args.pipelines}")
    if args.wait_nodes and not args.address:
        raise UsageError("--wait-nodes needs --address: an embedded Ray has one node")
    if args.lanes < 1:
        raise UsageError(f"--lanes must be at least 1, not {args.lanes}")
    if args.lane_batch is None:
        # One row: the lone request's step is fastest. Torch fp32 decodes fastest one row
        # at a time; llama.cpp then still decodes lanes under 256 tokens together, exactly
        # (stages/llamacpp_runtime.py).
        args.lane_batch = 1
    if args.lane_batch < 1:
        raise UsageError(f"--lane-batch must be at least 1, not {args.lane_batch}")
    args.weight_format = _weight_format(args.weight_format)
    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be in 1..65535, not {args.port}")
    from .stage.security import load_secret
    secret = load_secret(args.cluster_secret_file)  # an empty or unreadable file: one line
    gateway = _gateway_options(args, secret)  # refused binds and bad key files: before Ray
    _trace(args)  # before the engine: its stages export where this process does
    path = resolve_model(args.package or args.model)
    if is_package(path):
        _check_package(path, args.runtime)
    cache = cache_config(args)
    _say(f"skippy: loading {path.name} ({args.runtime} runtime) ...")
    from .front.gateway import serve
    from .control.ray_engine import RayEngine, start_ray
    if args.wait_nodes:  # RayEngine then plans in the cluster joined here
        from .control.node_wait import wait_for_nodes
        start_ray(args.address)
        wait_for_nodes(args.wait_nodes, lambda m: _say(f"skippy: {m}"))
    from .progress import Console
    engine = RayEngine(path, args.stages or (1 if args.runtime == "llama.cpp" else None),
                       pipelines=args.pipelines, weight_format=args.weight_format,
                       lane_batch=args.lane_batch, lanes=args.lanes,
                       model_name=args.model_name or (path.name if args.package else args.model),
                       address=args.address, secret=secret, stage_tls=args.stage_tls,
                       cache=cache, runtime=args.runtime, wire_dtype=args.wire,
                       n_ctx=args.ctx, progress=Console(prefix="skippy: "))
    _say(f"skippy: serving {engine.info.model} on http://{args.host}:{args.port}/v1 "
         f"({engine.info.n_stages} stage(s), context {engine.info.n_ctx}); Ctrl-C stops")
    _say(f"skippy: status page on http://{args.host}:{args.port}/")
    serve(engine, args.host, args.port, **gateway)
    return 0


def _trace(args) -> None:
    """Trace requests where --otlp-endpoint or the OTEL_EXPORTER_OTLP_ environment names a
    collector (mesh/tracing.py); off otherwise."""
    from . import tracing
    try:
        url = tracing.traces_url(args.otlp_endpoint)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if url:
        tracing.configure(url)
        _say(f"skippy: traces go to {url} (OTLP/HTTP)")


def _check_package(path: Path, runtime: str) -> None:
    """A bad part fails here, named, before any stage starts; parts the head lacks are
    fetched by the nodes whose stages read them."""
    from skippy.topology.model_package import verify_package
    from .progress import Console, progress_bar
    if runtime == "llama.cpp":  # llama.cpp opens one GGUF file (or a split set)
        raise UsageError("the llama.cpp runtime serves a .gguf file, not a package: "
                         "use --runtime torch, or the GGUF the package was split from")
    with progress_bar(None, f"verify {path.name}", "B", say=Console(prefix="skippy: ")) as bar:
        verify_package(path, progress=bar.to, held_only=True)


def _gateway_options(args, secret: str) -> dict:
    """serve()'s options from the flags; a bad value, an unreadable or empty key file, or a
    bind beyond loopback without keys (unless --insecure) fails here, in one line."""
    from .front.edge import keys_for_bind
    from .front.limits import GatewayLimits
    limits = GatewayLimits(max_concurrent_requests=args.max_concurrent_requests,
                           max_request_tokens=args.max_request_tokens,
                           queue_timeout_s=args.queue_timeout,
                           request_timeout_s=args.request_timeout)
    keys = keys_for_bind(args.host, args.api_keys_file or None, args.insecure)
    return dict(api_keys=keys, insecure=args.insecure, limits=limits,
                control_text=args.allow_control_tokens, tenant_secret=secret)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="skippy", description="A staged, distributed LLM serving mesh.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in (_models_parser, _generate_parser, _certify_parser, _plan_parser,
                _package_parser, _serve_parser):
        add(sub)
    from .service_cli import add_service_parsers  # service start|stop|restart, status
    add_service_parsers(sub)
    return p


def _models_parser(sub) -> None:
    models = sub.add_parser("models", help="pull, list and synthesize models")
    msub = models.add_subparsers(dest="models_command", required=True, parser_class=_Parser)
    pull = msub.add_parser("pull", help="fetch a shipped model into $SKIPPY_HOME")
    pull.add_argument("names", nargs="+", metavar="NAME", help="smollm2, gemma3-270m")
    pull.set_defaults(run=cmd_models_pull)
    lst = msub.add_parser("list", help="models on this machine")
    lst.set_defaults(run=cmd_models_list)
    syn = msub.add_parser("synth", help="write a random-weight GGUF of another family")
    from skippy.topology.families import synth_archs
    syn.add_argument("--arch", required=True, choices=synth_archs())
    syn.add_argument("--layers", type=int, required=True)
    syn.add_argument("--seed", type=int, required=True)
    syn.add_argument("--hidden", type=int)
    syn.add_argument("--ff", type=int)
    syn.add_argument("--heads", type=int)
    syn.add_argument("--kv-heads", type=int)
    syn.add_argument("--head-dim", type=int)
    syn.add_argument("--dtype", choices=("f32", "f16"), default="f32")
    syn.add_argument("--set", action="append", metavar="KEY=VALUE",
                     help="a knob of the arch's table (a size, an option such as "
                          "kv_lora_rank=512, rope_freqs=1, variant=a4b); repeatable")
    syn.add_argument("--rope-freqs", action="store_true",
                     help="short for --set rope_freqs=1 (a Llama 3 style file)")
    syn.add_argument("--variant", help="short for --set variant=NAME")
    syn.add_argument("--chat-template", metavar="FILE",
                     help="Jinja chat template written into the file instead of the "
                          "tokenizer's (e.g. a tool-aware one)")
    syn.add_argument("--out", help="output path (default: $SKIPPY_HOME/synth/...)")
    syn.add_argument("--tokenizer-from", default="smollm2",
                     help="model whose tokenizer is copied (default: smollm2)")
    syn.set_defaults(run=cmd_models_synth)


def _generate_parser(sub) -> None:
    gen = sub.add_parser("generate", help="generate a continuation in-process")
    gen.add_argument("prompt", metavar="PROMPT")
    gen.add_argument("--model", default="smollm2", help="model name or path to a .gguf")
    gen.add_argument("--stages", type=int, default=2)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--wire", choices=("f16", "f32"), default="f16",
                     help="activation dtype between stages")
    gen.add_argument("--ctx", type=int, default=8192, help="context size in tokens")
    gen.set_defaults(run=cmd_generate)


def _certify_parser(sub) -> None:
    cert = sub.add_parser("certify", help="check that every state hand-off is exact")
    cert.add_argument("--model", default="smollm2", help="model name or path to a .gguf")
    cert.add_argument("--stages", type=int, default=1)
    cert.add_argument("--runtime", choices=("torch", "llama.cpp"), default="torch")
    cert.add_argument("--weight-format", default="fp32",
                      help="how the torch runtime holds weights: fp32 (default, the "
                           "reference), bf16, int8, int4, ... (stages/linear.py)")
    cert.add_argument("--stage", metavar="A..B",
                      help="certify layers A..B (B excluded) alone, fed synthetic upstream "
                           "activations: a late stage of a giant package without the "
                           "layers before it")
    cert.add_argument("--json", action="store_true", help="print the report as JSON")
    cert.set_defaults(run=cmd_certify)


def _plan_parser(sub) -> None:
    pln = sub.add_parser("plan", help="show how a model splits into stages over nodes")
    pln.add_argument("--model", default="smollm2", help="model name or path to a .gguf")
    pln.add_argument("--nodes", metavar="FILE",
                     help="JSON list of {name, memory, cpus, resources, latency_ms} "
                          "(default: this machine)")
    pln.add_argument("--stages", type=int, help="exactly this many stages "
                     "(default: the fewest that fit)")
    pln.add_argument("--max-stages", type=int)
    pln.add_argument("--ctx", type=int, default=8192, help="context per lane in tokens")
    pln.add_argument("--lanes", type=int, default=8, help="concurrent sequences per stage")
    pln.add_argument("--wire", choices=("f16", "f32", "q8"), default="f16",
                     help="activation dtype between stages")
    pln.add_argument("--weight-format",
                     help="the torch runtime's weight format, which sets the memory a stage "
                          "needs (default: serve's, int4)")
    pln.add_argument("--json", action="store_true", help="print the plan as JSON")
    pln.set_defaults(run=cmd_plan)


def _package_parser(sub) -> None:
    pkg = sub.add_parser("package", help="split a model by layer; verify a package")
    psub = pkg.add_subparsers(dest="package_command", required=True, parser_class=_Parser)
    spl = psub.add_parser("split", help="write a package: one GGUF part per layer, "
                          "shared parts, a manifest of hashes")
    spl.add_argument("model", metavar="MODEL", help="model name, .gguf, or one shard of a "
                     "split set (*-00001-of-0000N.gguf)")
    spl.add_argument("--out", required=True, metavar="DIR", help="new or empty directory")
    spl.set_defaults(run=cmd_package_split)
    ver = psub.add_parser("verify", help="check every part's size and BLAKE3")
    ver.add_argument("dir", metavar="DIR")
    ver.add_argument("-v", "--verbose", action="store_true",
                     help="progress lines in a log too (a terminal always shows a bar)")
    ver.set_defaults(run=cmd_package_verify)


def _serve_parser(sub) -> None:
    from .control.ray_engine import DEFAULT_LANES
    srv = sub.add_parser("serve", help="serve a model over the OpenAI API on Ray stages")
    srv.add_argument("--model", default="smollm2", help="model name, path to a .gguf, or a "
                     "package directory")
    srv.add_argument("--package", metavar="DIR", help="serve a package (as --model DIR)")
    srv.add_argument("--model-name", help="the name clients ask for (default: --model)")
    srv.add_argument("--stages", type=int, help="stages to split into (default: the fewest "
                     "that fit the cluster)")
    srv.add_argument("--runtime", choices=("torch", "llama.cpp"), default="torch")
    srv.add_argument("--pipelines", type=int, default=1,
                     help="copies of the whole chain; requests go where their prefix is "
                          "cached, else to the least loaded")
    srv.add_argument("--address", help="join a Ray cluster ('auto' for the local one); "
                     "default: start an embedded Ray, listening on loopback only")
    srv.add_argument("--wait-nodes", type=int, default=0, metavar="N",
                     help="with --address: wait until the Ray cluster has N nodes before "
                          "planning (a gateway `ray up` starts before its workers joined)")
    srv.add_argument("--cluster-secret-file", metavar="FILE", help="the secret every call "
                     "between stages carries (also: $SKIPPY_CLUSTER_SECRET; default: a new "
                     "random one)")
    srv.add_argument("--stage-tls", choices=("auto", "on", "off"), default="auto",
                     help="mutual TLS between stages, certificates made at start: auto "
                     "(default) is on when the Ray cluster has more than one node")
    srv.add_argument("--otlp-endpoint", metavar="URL", help="export an OpenTelemetry trace "
                     "of each request to this OTLP/HTTP collector (e.g. http://host:4318; "
                     "also: $OTEL_EXPORTER_OTLP_ENDPOINT; default: off)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--ctx", type=int, default=8192,
                     help="context per request in tokens (capped at the model's)")
    srv.add_argument("--wire", choices=("f16", "f32"), default="f16",
                     help="activation dtype between stages")
    srv.add_argument("--weight-format", help="how the torch runtime holds weights: int4 "
                     "(default: the file's own 4-bit blocks, an fp32 head; 99 %% top-1 "
                     "agreement with fp32), fp32 (the reference), bf16, int8; int4-lean / "
                     "int8-lean hold no bf16 copy for prefill (4x less weight memory, "
                     "prefill about 2x slower)")
    srv.add_argument("--lane-batch", type=int,
                     help="decode rows a torch stage runs per step, padded (concurrent "
                          "requests share a step): 1 (default) is fastest alone, 8 gives the "
                          "most tokens/s to many clients. llama.cpp: 1 decodes lanes past "
                          "255 tokens alone, 2 or more decodes every lane together")
    srv.add_argument("--lanes", type=int, default=DEFAULT_LANES, metavar="N",
                     help="a pipeline's lane budget: requests it runs at once (each stage "
                          "holds this many lanes' KV); more wait, then get a 503 "
                          "(default: %(default)s)")
    _serve_limits(srv)


def _serve_limits(srv) -> None:
    """Who may call, and how much: keys, the gateway's limits, the caches."""
    from .cache_flags import add_cache_arguments
    from .front import limits
    srv.add_argument("--api-keys-file", metavar="FILE", help="accepted Bearer keys, one a "
                     "line (also: $SKIPPY_API_KEYS, comma-separated); each key's cached "
                     "state is its own")
    srv.add_argument("--insecure", action="store_true",
                     help="serve beyond loopback without API keys (refused otherwise)")
    srv.add_argument("--allow-control-tokens", action="store_true",
                     help="message text that spells a control token (<|im_start|>...) is "
                          "that token: for trusted clients only (default: it is text)")
    srv.add_argument("--request-timeout", type=float, metavar="S",
                     default=limits.DEFAULT_REQUEST_TIMEOUT_S,
                     help="a request's deadline from arrival, then a 504 (or an error "
                          "event in a stream) (default: %(default)s)")
    srv.add_argument("--max-concurrent-requests", type=int, metavar="N",
                     default=limits.DEFAULT_MAX_CONCURRENT_REQUESTS,
                     help="requests the gateway runs at once; as many more wait up to "
                          "--queue-timeout, the rest get a 503 with Retry-After "
                          "(default: %(default)s)")
    srv.add_argument("--queue-timeout", type=float, metavar="S",
                     default=limits.DEFAULT_QUEUE_TIMEOUT_S,
                     help="seconds a request waits for one of those slots "
                          "(default: %(default)s)")
    srv.add_argument("--max-request-tokens", type=int, metavar="N",
                     default=limits.DEFAULT_MAX_REQUEST_TOKENS,
                     help="n x max_tokens summed over a request's choices; above it, a 400 "
                          "(default: %(default)s)")
    add_cache_arguments(srv)
    srv.set_defaults(run=cmd_serve)


def main(argv: list[str] | None = None) -> int:
    from skippy.stages.runtime import StageError
    from skippy.stages.synth import SynthError
    from skippy.topology.families import UnsupportedFamily
    from skippy.topology.gguf_file import GGUFError
    from skippy.topology.planner import PlanError
    from .front.chat import ChatTemplateMissing
    from .models import ModelError

    user_errors = (UsageError, ModelError, PlanError, StageError, SynthError, GGUFError,
                   UnsupportedFamily, ChatTemplateMissing, ValueError, FileNotFoundError)
    try:
        args = build_parser().parse_args(argv)
        return args.run(args)
    except user_errors as e:
        if os.environ.get("SKIPPY_DEBUG"):
            raise
        _say(f"skippy: error: {e}")
        return EXIT_USAGE
    except KeyboardInterrupt:
        _say("skippy: interrupted")
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    # `python -m skippy.mesh.cli`: run the module as imported, so that the exception types
    # other modules raise (UsageError) are the ones main() catches
    from skippy.mesh.cli import main as _main
    sys.exit(_main())
