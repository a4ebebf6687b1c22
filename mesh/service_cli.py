"""`skippy service start|stop|restart` and `skippy status`: the command line of the
gateway service (mesh/service.py)."""

from __future__ import annotations

import json
import shlex
import sys

from . import service
from .serve_cli import gateway_options, parse_serve_args, served_models
from .usage import UsageError

NO_SERVICE = "no gateway service runs (start one: skippy service start -- <serve options>)"


def _say(message: str) -> None:
    print(f"skippy: {message}", file=sys.stderr, flush=True)


def serve_url(serve_args: list[str]) -> str:
    """The URL `skippy serve SERVE_ARGS` listens on, once they pass serve's own checks
    (flags, port, bind without keys, key file, model): a mistake is reported here, in
    one line, not later in a log."""
    args = parse_serve_args(serve_args)
    gateway_options(args, secret="")
    served_models(args)
    host = f"[{args.host}]" if ":" in args.host else args.host
    return f"http://{host}:{args.port}"


def cmd_service_start(args) -> int:
    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    return _start(serve_args, args.wait)


def _start(serve_args: list[str], wait: float) -> int:
    url = serve_url(serve_args)
    try:
        state = service.start(serve_args, url, wait, say=_say)
    except service.ServiceError as e:
        _say(f"error: {e}")
        return 1
    done = f"answers at {url}/v1" if wait > 0 else "starts"
    _say(f"the gateway {done} (service pid {state.supervisor_pid}, gateway pid "
         f"{state.gateway_pid}); log: {state.log}")
    return 0


def cmd_service_stop(_args) -> int:
    state = service.stop()
    _say(f"gateway stopped (pid {state.gateway_pid})" if state else NO_SERVICE)
    return 0


def cmd_service_restart(args) -> int:
    state = service.current()
    if state is None:
        raise UsageError(NO_SERVICE.replace("runs", "to restart"))
    return _start(state.args, args.wait)


def cmd_status(args) -> int:
    state = service.current()
    if state is None:
        print(json.dumps(None) if args.json else f"skippy: {NO_SERVICE}")
        return 1
    d = service.describe(state)
    if args.json:
        print(json.dumps(d, indent=1))
    elif state.phase == "failed":
        print(f"skippy: the gateway service gave up: {state.reason}; log: {state.log}")
    else:
        last = f" (last exit code {d['last_exit']})" if d["last_exit"] is not None else ""
        rows = [("gateway", f"{d['phase']}, /health: {d['health']}"),
                ("pid", f"{d['gateway_pid'] or '-'} (supervisor {d['supervisor_pid']})"),
                ("url", f"{d['url']}/v1"),
                ("uptime", f"{service.duration(d['uptime_s'])} (service "
                           f"{service.duration(d['service_uptime_s'])})"),
                ("restarts", f"{d['restarts']}{last}"),
                ("log", d["log"]),
                ("serve", shlex.join(d["serve_args"]))]
        print("\n".join(f"{k:<9} {v}" for k, v in rows))
    return 0 if state.phase != "failed" else 1


def add_service_parsers(sub) -> None:
    svc = sub.add_parser("service", help="the gateway as a detached service that restarts "
                         "on failure (what `ray up` starts on the head)")
    ssub = svc.add_subparsers(dest="service_command", required=True)
    start = ssub.add_parser("start", help="start `skippy serve SERVE_OPTIONS` detached "
                            "(a running one is stopped first)",
                            usage="skippy service start [--wait S] -- SERVE_OPTIONS")
    start.add_argument("serve_args", nargs="*", metavar="SERVE_OPTIONS",
                       help="skippy serve's options, after --")
    for p in (start, ssub.add_parser("restart", help="stop it, and start it again with "
                                     "the same options")):
        p.add_argument("--wait", type=float, default=0.0, metavar="S",
                       help="return once the gateway answers /health (at most S seconds; "
                            "default: return at once)")
    start.set_defaults(run=cmd_service_start)
    ssub.choices["restart"].set_defaults(run=cmd_service_restart)
    ssub.add_parser("stop", help="stop the gateway and its supervisor").set_defaults(
        run=cmd_service_stop)
    st = sub.add_parser("status", help="the gateway service: pid, URL, uptime, restarts, log")
    st.add_argument("--json", action="store_true", help="print it as JSON")
    st.set_defaults(run=cmd_status)
