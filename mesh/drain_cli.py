"""`skippy drain NODE`: move every stage off a node of a serving cluster, with no request
failing (the gateway's POST /admin/drain: each pipeline with a stage there is replaced
by a copy on other nodes, then retired once its requests end)."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path

from .front.limits import DEFAULT_PORT
from .usage import UsageError, say

TIMEOUT_S = 900  # a drain waits for the requests in flight on the pipelines it moves


def cmd_drain(args) -> int:
    headers = {"Content-Type": "application/json"}
    key = _operator_key(args.key_file)
    if key:
        headers["Authorization"] = f"Bearer {key}"
    url = args.url.rstrip("/") + "/admin/drain"
    request = urllib.request.Request(url, json.dumps({"node": args.node}).encode(), headers)
    say(f"skippy: draining node {args.node} through {args.url} ...")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as r:
            drained = json.loads(r.read())["drained"]
    except urllib.error.HTTPError as e:
        raise UsageError(f"the gateway refused: {_message(e)}") from None
    except (urllib.error.URLError, OSError) as e:
        raise UsageError(f"no gateway answers at {args.url}: {e}") from None
    for d in drained:
        moves = ", ".join(f"pipeline {m['from']} -> {m['to']}" for m in d["moved"]) or \
            "it held no stage"
        say(f"skippy: node {d['node'][:12]} drained ({moves})")
    return 0


def _operator_key(path: str | None) -> str:
    if path:
        try:
            return Path(path).read_text().split()[0]
        except (OSError, IndexError):
            raise UsageError(f"cannot read an operator key from {path}") from None
    return os.environ.get("SKIPPY_OPERATOR_KEYS", "").split(",")[0].strip()


def _message(e: urllib.error.HTTPError) -> str:
    try:
        return json.loads(e.read())["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {e.code}"


def add_drain_parser(sub) -> None:
    p = sub.add_parser("drain", help="move every stage off a node of the serving cluster, "
                       "requests in flight ending where they are")
    p.add_argument("node", help="the node's Ray id, or its first characters (the status "
                   "page's plan shows them)")
    p.add_argument("--url", default=f"http://127.0.0.1:{DEFAULT_PORT}",
                   help="the gateway (default: %(default)s)")
    p.add_argument("--key-file", metavar="FILE", help="an operator key (default: the first "
                   "of $SKIPPY_OPERATOR_KEYS; none where the gateway has no keys)")
    p.set_defaults(run=cmd_drain)
