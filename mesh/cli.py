"""`skippy`: the command line. Every user mistake becomes one line on stderr, exit code 2."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from skippy.topology.planner import DEFAULT_LANES, DEFAULT_N_CTX

from .usage import Parser as _Parser
from .usage import UsageError, runtime_arg, runtime_names, weight_format
from .usage import say as _say

EXIT_USAGE = 2


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

    from .models import resolve_model

    if not args.prompt.strip():
        raise UsageError("the prompt is empty")
    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be at least 1, not {args.max_tokens}")
    path = resolve_model(args.model)  # a missing model is refused before torch loads
    from skippy.cache.config import CacheConfig
    from .control.engine import GenerationRequest
    from .control.local import InProcessEngine
    from .front.chat import render_chat
    from .sampler import SamplingParams
    from .tokenizer import Tokenizer
    params = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
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
    # certify() refuses a split or a format the runtime lacks (StageError: one line, exit 2)
    from .progress import progress_bar
    model = resolve_model(args.model)
    if args.stage is not None:
        from skippy.stages.certify_range import certify_range, parse_range
        with progress_bar(None, f"certify {model.name} {args.stage}", "step") as bar:
            report = certify_range(model, *parse_range(args.stage),
                                   weight_format=args.weight_format, progress=bar.to,
                                   runtime=args.runtime)
    else:
        with progress_bar(None, f"certify {model.name}", "step") as bar:
            report = certify(model, args.stages, args.runtime,
                             weight_format=args.weight_format, progress=bar.to)
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.table())
    return 0 if report.passed else 1


# -- plan -------------------------------------------------------------------------------------
def cmd_plan(args) -> int:
    import functools
    import json

    from skippy.stages.linear import held_bytes
    from skippy.topology.planner import ModelFacts, load_nodes, local_node, plan
    from .models import resolve_model

    nodes = load_nodes(args.nodes) if args.nodes else [local_node()]
    from skippy.stages.runtime_kind import TORCH
    fmt = weight_format(TORCH, args.weight_format)
    facts = ModelFacts.from_gguf(resolve_model(args.model),
                                 tensor_bytes=functools.partial(held_bytes, fmt))
    from skippy.cache.config import CacheConfig
    # each stage's cache budget as `skippy serve` would give it (SKIPPY_CACHE_* settings)
    result = plan(facts, nodes, wire_dtype=args.wire, n_ctx=args.ctx, lanes=args.lanes,
                  stages=args.stages, max_stages=args.max_stages,
                  cache_bytes=CacheConfig.from_env().stage_bytes)
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


def build_parser() -> _Parser:
    from .drain_cli import add_drain_parser
    from .serve_cli import add_serve_parser
    from .service_cli import add_service_parsers  # service start|stop|restart, status
    p = _Parser(prog="skippy", description="A staged, distributed LLM serving mesh.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in (_models_parser, _generate_parser, _certify_parser, _plan_parser,
                _package_parser, add_serve_parser, add_service_parsers, add_drain_parser):
        add(sub)
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
    gen.add_argument("--ctx", type=int, default=DEFAULT_N_CTX, help="context size in tokens")
    gen.set_defaults(run=cmd_generate)


def _certify_parser(sub) -> None:
    cert = sub.add_parser("certify", help="check that every state hand-off is exact")
    cert.add_argument("--model", default="smollm2", help="model name or path to a .gguf")
    cert.add_argument("--stages", type=int, default=1)
    cert.add_argument("--runtime", type=runtime_arg, default="torch", metavar="NAME",
                      help=f"{runtime_names()} (default: %(default)s)")
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
                     help="JSON list of {name, memory, cpus, resources, latency_ms, "
                          "layers, links} (default: this machine)")
    pln.add_argument("--stages", type=int, help="exactly this many stages "
                     "(default: the fewest that fit; with link figures, the count and "
                     "nodes whose links cost a token least)")
    pln.add_argument("--max-stages", type=int)
    pln.add_argument("--ctx", type=int, default=DEFAULT_N_CTX,
                     help="context per lane in tokens")
    pln.add_argument("--lanes", type=int, default=DEFAULT_LANES,
                     help="concurrent sequences per stage")
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


def main(argv: list[str] | None = None) -> int:
    """Runs a command. A UserError (topology/errors.py: a bad flag, setting, model file,
    split, ...) is the one line `skippy: error: ...` and exit 2; anything else is a bug of
    ours and keeps its traceback."""
    from skippy.topology.errors import UserError

    try:
        args = build_parser().parse_args(argv)
        return args.run(args)
    except UserError as e:
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
