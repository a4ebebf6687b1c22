"""`skippy serve`: its options, their checks, and the command. `skippy service start`
(mesh/service_cli.py) checks the same options through `parse_serve_args` before it starts a
gateway that would fail on them later, in a log."""

from __future__ import annotations

import argparse
from pathlib import Path

from skippy.topology.planner import DEFAULT_LANES, DEFAULT_N_CTX

from .front.limits import DEFAULT_PORT
from .usage import Parser, UsageError, port_arg, runtime_arg, runtime_names, say, \
    weight_format


def cmd_serve(args) -> int:
    from skippy.topology.model_package import is_package
    from .cache_flags import cache_config
    from .stage.security import load_secret

    stages = _check_serve(args)
    secret = load_secret(args.cluster_secret_file)  # an empty or unreadable file: one line
    gateway = gateway_options(args, secret)  # refused binds and bad key files: before Ray
    _trace(args)  # before the engine: its stages export where this process does
    models = served_models(args)
    for _, path in models:
        if is_package(path):
            _check_package(path, args.runtime)
    cache = cache_config(args)
    from .control.ray_engine import start_ray
    owns_ray = start_ray(args.address)  # the models' engines share it
    if not owns_ray:  # a cluster's: the gateway ends with it (ray down)
        import ray
        from .control.cluster_watch import watch
        watch(ray.get_runtime_context().gcs_address, say)
    try:
        _serve_models(args, models, stages, secret, cache, gateway)
    finally:
        if owns_ray:
            import ray
            ray.shutdown()
    return 0


def _serve_models(args, models, stages, secret, cache, gateway) -> None:
    from .front.gateway import serve
    if args.wait_nodes:  # then planned in the cluster joined here
        from .control.node_wait import wait_for_nodes
        wait_for_nodes(args.wait_nodes, lambda m: say(f"skippy: {m}"))
    served = _model_set(args, models, stages, secret, cache)
    served.load_at_start()
    first = served.info()
    names = ", ".join(served.names)
    say(f"skippy: serving {names} on http://{args.host}:{args.port}/v1 "
        f"({first.n_stages} stage(s), context {first.n_ctx}); Ctrl-C stops"
        if len(models) == 1 else
        f"skippy: serving {names} on http://{args.host}:{args.port}/v1 (a request's "
        f"\"model\" picks one); Ctrl-C stops")
    say(f"skippy: status page on http://{args.host}:{args.port}/")
    serve(served, args.host, args.port, **gateway)


def served_models(args) -> list[tuple[str, Path]]:
    """(name clients ask for, path) of each model to serve, checked: every --model, then
    each model in --models-dir (its .gguf files by stem, its packages by folder name)."""
    from skippy.topology.model_package import is_package
    from .models import resolve_model
    named = [(spec, spec) for spec in args.model or []]  # (name, what resolves)
    if args.package:
        named.append((Path(args.package).name, args.package))
    if args.models_dir:
        folder = Path(args.models_dir).expanduser()
        if not folder.is_dir():
            raise UsageError(f"--models-dir {args.models_dir}: not a folder")
        found = sorted(p for p in folder.iterdir()
                       if (p.is_file() and p.suffix == ".gguf") or is_package(p))
        if not found:
            raise UsageError(f"--models-dir {args.models_dir}: no .gguf file or model "
                             f"package in it")
        named += [(p.stem if p.is_file() else p.name, str(p)) for p in found]
    named = named or [("smollm2", "smollm2")]
    if args.model_name and len(named) > 1:
        raise UsageError("--model-name names one model: with several, each is asked for "
                         "by its --model (or its file's stem in --models-dir)")
    out = [(args.model_name or name, resolve_model(spec)) for name, spec in named]
    names = [n for n, _ in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UsageError(f"two models are named {', '.join(twice)}: each name must be one "
                         f"model's")
    return out


def _model_set(args, models: list[tuple[str, Path]], stages: int | None, secret: str,
               cache):
    """The models as a set whose engines load on demand (mesh/control/model_set.py)."""
    from collections import Counter
    from .control.model_set import ModelSet, ModelSlot
    from .control.ray_engine import RayEngine, plan_model, planned_bytes
    from .control.scaling import ScalingPolicy
    from .progress import Console
    from .models import resolve_model
    progress, slots = Console(prefix="skippy: "), []
    draft = resolve_model(args.draft_model) if args.draft_model else None
    # watched even without --max-pipelines: a node that joins may let a model a lost
    # node made cut anew go back to its plan (RayEngine.restore)
    scaling = ScalingPolicy(args.pipelines, max(args.max_pipelines or 0, args.pipelines),
                            idle_s=args.release_idle)

    def others(me: str) -> Counter:
        return sum((s.engine.held_bytes() for s in slots
                    if s.name != me and s.engine is not None), Counter())

    def loader(name: str, path: Path):
        def load():
            say(f"skippy: loading {path.name} ({args.runtime.name} runtime) ...")
            return RayEngine(path, stages, pipelines=args.pipelines,
                             weight_format=args.weight_format, lane_batch=args.lane_batch,
                             lanes=args.lanes, model_name=name, address=args.address,
                             secret=secret, stage_tls=args.stage_tls, cache=cache,
                             runtime=args.runtime, wire_dtype=args.wire, n_ctx=args.ctx,
                             progress=progress, reserved=lambda: others(name),
                             speculate=args.speculate == "on", draft=draft,
                             scaling=scaling)

        def size() -> int:  # planned on the whole cluster: what it holds loaded alone
            return planned_bytes(plan_model(path, args.runtime, stages,
                                            pipelines=args.pipelines, lanes=args.lanes,
                                            wire_dtype=args.wire, n_ctx=args.ctx,
                                            weight_format=args.weight_format),
                                 args.pipelines)
        return ModelSlot(name, load, size)

    slots += [loader(name, path) for name, path in models]
    budget = None if args.models_memory is None else int(args.models_memory * 2**30)
    served = ModelSet(slots, budget_bytes=budget, idle_unload_s=args.unload_idle,
                      wait_s=args.queue_timeout, say=progress)
    if len(slots) > 1:
        for slot in slots:  # a model that can never fit fails here, at start
            say(f"skippy: model {slot.name}: {slot.bytes / 2**30:.2f} GiB planned")
    return served


def _check_serve(args) -> int | None:
    """The flags' own checks, before anything starts; the stage count to plan (None: the
    fewest that fit). Fills in --lane-batch and --weight-format where they were left out."""
    if args.stages is not None and args.stages < 1:
        raise UsageError(f"--stages must be at least 1, not {args.stages}")
    stages = args.runtime.stages(args.stages)
    if args.pipelines < 1:
        raise UsageError(f"--pipelines must be at least 1, not {args.pipelines}")
    if args.max_pipelines is not None and args.max_pipelines < args.pipelines:
        raise UsageError(f"--max-pipelines must be at least --pipelines ({args.pipelines}), "
                         f"not {args.max_pipelines}")
    if args.wait_nodes and not args.address:
        raise UsageError("--wait-nodes needs --address: an embedded Ray has one node")
    if args.lanes < 1:
        raise UsageError(f"--lanes must be at least 1, not {args.lanes}")
    if args.models_memory is not None and args.models_memory <= 0:
        raise UsageError(f"--models-memory must be above 0, not {args.models_memory:g}")
    if args.unload_idle is not None and args.unload_idle <= 0:
        raise UsageError(f"--unload-idle must be above 0, not {args.unload_idle:g}")
    if args.release_idle <= 0:
        raise UsageError(f"--release-idle must be above 0, not {args.release_idle:g}")
    if args.lane_batch is None:
        # One row: the lone request's step is fastest. Torch fp32 decodes fastest one row
        # at a time; llama.cpp then still decodes lanes under 256 tokens together, exactly
        # (stages/llamacpp_runtime.py).
        args.lane_batch = 1
    if args.lane_batch < 1:
        raise UsageError(f"--lane-batch must be at least 1, not {args.lane_batch}")
    args.weight_format = weight_format(args.runtime, args.weight_format)
    return stages


def _trace(args) -> None:
    """Trace requests where --otlp-endpoint or the OTEL_EXPORTER_OTLP_ environment names a
    collector (mesh/tracing.py); off otherwise."""
    from . import tracing
    url = tracing.traces_url(args.otlp_endpoint)  # a UserError: the CLI's one line
    if url:
        tracing.configure(url)
        say(f"skippy: traces go to {url} (OTLP/HTTP)")


def _check_package(path: Path, runtime) -> None:
    """A bad part fails here, named, before any stage starts; parts the head lacks are
    fetched by the nodes whose stages read them."""
    from skippy.topology.model_package import verify_package
    from .progress import Console, progress_bar
    runtime.check_model(package=True)
    with progress_bar(None, f"verify {path.name}", "B", say=Console(prefix="skippy: ")) as bar:
        verify_package(path, progress=bar.to, held_only=True)


def gateway_options(args, secret: str) -> dict:
    """serve()'s options from the flags; a bad value, an unreadable or empty key file, or a
    bind beyond loopback without keys (unless --insecure) fails here, in one line."""
    from .front.edge import keys_for_bind, load_operator_keys
    from .front.limits import GatewayLimits
    limits = GatewayLimits(max_concurrent_requests=args.max_concurrent_requests,
                           max_request_tokens=args.max_request_tokens,
                           queue_timeout_s=args.queue_timeout,
                           request_timeout_s=args.request_timeout,
                           read_timeout_s=args.read_timeout,
                           max_connections=args.max_connections,
                           body_bytes_per_s=int(args.max_body_mib_per_s * 2**20))
    operators = load_operator_keys(args.operator_keys_file or None)
    keys = keys_for_bind(args.host, args.api_keys_file or None, args.insecure, operators)
    return dict(api_keys=keys, operator_keys=operators, insecure=args.insecure, limits=limits,
                control_text=args.allow_control_tokens, tenant_secret=secret)


def parse_serve_args(serve_args: list[str]) -> argparse.Namespace:
    """`skippy serve SERVE_ARGS`'s options, as serve itself reads them."""
    p = Parser(prog="skippy serve")
    _serve_arguments(p)
    return p.parse_args(serve_args)


def add_serve_parser(sub) -> None:
    srv = sub.add_parser("serve", help="serve a model over the OpenAI API on Ray stages")
    _serve_arguments(srv)
    srv.set_defaults(run=cmd_serve)


def _serve_arguments(srv) -> None:
    _model_arguments(srv)
    srv.add_argument("--stages", type=int, help="stages to split into (default: the fewest "
                     "that fit the cluster)")
    srv.add_argument("--runtime", type=runtime_arg, default="torch", metavar="NAME",
                     help=f"{runtime_names()} (default: %(default)s)")
    srv.add_argument("--pipelines", type=int, default=1,
                     help="copies of the whole chain; requests go where their prefix is "
                          "cached, else to the least loaded")
    srv.add_argument("--max-pipelines", type=int, metavar="N",
                     help="add pipelines, up to N, while requests wait for lanes and the "
                          "cluster has room for a whole copy (a node that joins too); one "
                          "added is released once idle (default: --pipelines)")
    srv.add_argument("--release-idle", type=float, default=60.0, metavar="S",
                     help="seconds an added pipeline stays idle before it is released "
                          "(default: %(default)s)")
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
    srv.add_argument("--port", type=port_arg, default=DEFAULT_PORT)
    srv.add_argument("--ctx", type=int, default=DEFAULT_N_CTX,
                     help="context per request in tokens (capped at the model's)")
    srv.add_argument("--wire", choices=("f16", "f32"), default="f16",
                     help="activation dtype between stages")
    srv.add_argument("--weight-format", help="how the torch runtime holds weights: int4 "
                     "(default: the file's own 4-bit blocks computed as llama.cpp does, an "
                     "fp32 head; 97-98 %% top-1 agreement with fp32), fp32 (the reference), "
                     "bf16, int8; int4-lean / int8-lean: the same on our kernel, no bf16 "
                     "copy on torch's (no C compiler)")
    srv.add_argument("--lane-batch", type=int,
                     help="decode rows a torch stage runs per step, padded (concurrent "
                          "requests share a step): 1 (default) is fastest alone, 8 gives the "
                          "most tokens/s to many clients. llama.cpp: 1 decodes lanes past "
                          "255 tokens alone, 2 or more decodes every lane together")
    srv.add_argument("--speculate", choices=("on", "off"), default="on",
                     help="decode steps verify tokens proposed by prompt lookup where every "
                          "stage keeps the row-invariant contract: the same text, fewer "
                          "trips through the stages (default: %(default)s)")
    srv.add_argument("--draft-model", metavar="MODEL", help="propose those tokens with this "
                     "small model of the same vocabulary, run in the gateway (default: "
                     "prompt lookup)")
    srv.add_argument("--lanes", type=int, default=DEFAULT_LANES, metavar="N",
                     help="a pipeline's lane budget: requests it runs at once (each stage "
                          "holds this many lanes' KV); more wait, then get a 503 "
                          "(default: %(default)s)")
    _serve_limits(srv)


def _model_arguments(srv) -> None:
    """Which models, by what names, and how many stay loaded."""
    srv.add_argument("--model", action="append", help="model name, path to a .gguf, or a "
                     "package directory (default: smollm2); again to serve several, each "
                     "asked for by what was given here")
    srv.add_argument("--package", metavar="DIR", help="serve a package (as --model DIR)")
    srv.add_argument("--models-dir", metavar="DIR", help="serve every .gguf file (by its "
                     "stem) and model package (by its folder name) in DIR too")
    srv.add_argument("--model-name", help="the name clients ask for (default: --model; "
                     "one model only)")
    srv.add_argument("--models-memory", type=float, metavar="GIB",
                     help="the most memory the loaded models' plans may hold together; a "
                          "model asked for beyond it first unloads idle ones, least "
                          "recently used first (default: what the cluster's nodes hold)")
    srv.add_argument("--unload-idle", type=float, metavar="S",
                     help="unload a model no request has used for S seconds; it loads "
                          "again on its next request (default: only to make room)")


def _serve_limits(srv) -> None:
    """Who may call, and how much: keys, the gateway's limits, the caches."""
    from .cache_flags import add_cache_arguments
    from .front import limits
    srv.add_argument("--api-keys-file", metavar="FILE", help="accepted Bearer keys, one a "
                     "line (also: $SKIPPY_API_KEYS, comma-separated); each key's cached "
                     "state is its own")
    srv.add_argument("--operator-keys-file", metavar="FILE", help="keys that may also read "
                     "what spans tenants: /metrics and the cluster's figures on the status "
                     "page (also: $SKIPPY_OPERATOR_KEYS); with keys on, other keys see "
                     "only their own figures")
    srv.add_argument("--insecure", action="store_true",
                     help="serve beyond loopback without API keys (refused otherwise)")
    srv.add_argument("--allow-control-tokens", action="store_true",
                     help="message text that spells a control token (<|im_start|>...) is "
                          "that token: for trusted clients only (default: it is text)")
    srv.add_argument("--request-timeout", type=float, metavar="S",
                     default=limits.DEFAULT_REQUEST_TIMEOUT_S,
                     help="a request's deadline from arrival, then a 504 (or an error "
                          "event in a stream) (default: %(default)s)")
    srv.add_argument("--read-timeout", type=float, metavar="S",
                     default=limits.DEFAULT_READ_TIMEOUT_S,
                     help="seconds a connection has to send a request's headers and body "
                          "(then a 408, or it is dropped) (default: %(default)s)")
    srv.add_argument("--max-body-mib-per-s", type=float, metavar="M",
                     default=limits.DEFAULT_BODY_BYTES_PER_S / 2**20,
                     help="MiB of request bodies a key (or an address, without keys) may "
                          "send a second; beyond, a 429 before the body is read "
                          "(default: %(default)s)")
    srv.add_argument("--max-connections", type=int, metavar="N",
                     default=limits.DEFAULT_MAX_CONNECTIONS,
                     help="connections open at once; beyond, a 503 at once "
                          "(default: %(default)s)")
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
