"""The gateway's edge: who may call, from where, with what, before any route runs.

A pure ASGI middleware (Starlette's BaseHTTPMiddleware would wrap streams), in order:

- Host (only when the server listens on loopback): a browser page on another site can
  point its own host name at 127.0.0.1 (DNS rebinding) and then reach a loopback server
  as if it were that site; the Host header still names the page's site, so anything but
  localhost / 127.x / [::1] is refused (400, as RFC 9110 asks for an invalid Host).
- API keys (when there are any): Bearer keys (or `x-api-key`, as Anthropic's clients
  send them), compared in constant time. The key's
  tenant tag goes with the request (`scope[TENANT]`), so its cache namespace is its own.
- Operator keys: what spans tenants (`/metrics`, the cluster's figures in
  `/status.json`) is for the operator. Once a server has keys, a tenant's key reads only
  its own figures and `/metrics` asks for an operator key (403 for a tenant's): dedupe and
  byte counters would tell one tenant what another sent. An operator key also calls the
  API, as a tenant of its own.
- Content-Type: a POST body must say application/json (415 otherwise), so a browser
  form or a text/plain "simple request" cannot reach the API without a CORS preflight.

Serving beyond loopback without keys is refused unless asked for in so many words
(`keys_for_bind`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
from collections.abc import Callable, Iterable
from pathlib import Path

from starlette.requests import Request

from skippy.mesh.private_file import read_private
from skippy.topology.errors import UserError

from . import http_errors
from .openai_api import ApiError

TENANT = "skippy.tenant"  # the ASGI scope key for the caller's tenant tag ("" unkeyed)
OPERATOR = "skippy.operator"  # the scope key: the caller may read what spans tenants
# probes stay reachable without a key, and the status page (its data needs the key)
OPEN_PATHS = frozenset({"/health", "/ready", "/"})
JSON_POSTS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses",
                        "/v1/embeddings", "/v1/messages", "/v1/messages/count_tokens",
                        "/tokenize", "/detokenize"})
# with keys on, an operator key's alone
OPERATOR_PATHS = frozenset({"/metrics", "/admin/drain"})


class KeyFileError(UserError):
    """The API keys given cannot be used (an unreadable or empty file, a bad key)."""


class OpenBindRefused(UserError):
    """Serving beyond loopback without API keys, and not told `insecure`."""


# -- API keys -----------------------------------------------------------------------------------
def load_api_keys(api_keys: Iterable[str] | str | Path | None, *,
                  variable: str = "SKIPPY_API_KEYS",
                  what: str = "the API key file") -> frozenset[str]:
    """None: $SKIPPY_API_KEYS (`variable`; comma separated; unset or empty: none); a str or
    Path: a file with one key per line, which must hold at least one; otherwise the keys
    themselves. An empty set means no authentication. KeyFileError (one line) for a file
    that cannot be read, is open to other users or holds no key, or a key that is not
    printable ASCII."""
    if api_keys is None:
        where = f"${variable}"
        keys = _keys(os.environ.get(variable, "").split(","), f"{where}, item")
    elif isinstance(api_keys, (str, Path)):
        where = f"{what} {api_keys}"
        text = read_private(api_keys, what, KeyFileError)
        keys = _keys(text.splitlines(), f"{where}, line")
        if not keys:  # an empty file is a mistake, never "no authentication"
            raise KeyFileError(f"{where} holds no key (one key a line)")
    else:
        keys = _keys(api_keys, "the keys given, key")
    return keys


def load_operator_keys(keys: Iterable[str] | str | Path | None) -> frozenset[str]:
    """The operator's keys, as `load_api_keys` reads them ($SKIPPY_OPERATOR_KEYS)."""
    return load_api_keys(keys, variable="SKIPPY_OPERATOR_KEYS", what="the operator key file")


def _keys(lines: Iterable[str], where: str) -> frozenset[str]:
    """The non-blank keys; `where` names the place of the i-th one in an error."""
    keys = [k.strip() for k in lines]
    for i, k in enumerate(keys):
        # a header carries printable ASCII; anything else could never match
        if k and not all(0x21 <= ord(c) <= 0x7E for c in k):
            raise KeyFileError(f"{where} {i + 1}: a key is printable ASCII without spaces")
    return frozenset(k for k in keys if k)


class ApiKeys:
    """The accepted keys, and each one's tenant tag: a keyed hash of the key (never the
    key itself), so a namespace seen in a stage's memory or a log tells nothing about the
    key. `secret` keys the hash: serve passes the cluster's, so a restarted gateway (or a
    second one over the same stages) finds a key's cached state again; by default a
    secret of this process. `operators`: the keys that may also read what spans tenants."""

    def __init__(self, keys: frozenset[str], secret: str | None = None,
                 operators: frozenset[str] = frozenset()):
        secret = secret.encode() if secret else secrets.token_bytes(32)
        self._tags = {k.encode(): (hmac.new(secret, k.encode(), hashlib.sha256).hexdigest()[:16],
                                   k in operators) for k in keys | operators}

    def __bool__(self) -> bool:
        return bool(self._tags)

    def caller(self, authorization: str | None, api_key: str | None = None
               ) -> tuple[str, bool] | None:
        """(tenant tag, whether an operator's) of a valid `Authorization: Bearer <key>`,
        or else of a valid `x-api-key: <key>` (`api_key`: Anthropic's clients send that),
        or None."""
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else ""
        token = token or (api_key or "").strip()
        if not token:
            return None
        sent = token.encode("latin-1")
        # compare against every key in constant time: no early exit that leaks which matched
        matched = [who for key, who in self._tags.items() if hmac.compare_digest(sent, key)]
        return matched[0] if matched else None

    def tenant(self, authorization: str | None) -> str | None:
        """The tenant tag of a valid `Authorization: Bearer <key>`, or None."""
        who = self.caller(authorization)
        return None if who is None else who[0]


def cache_namespace(tenant: str, cache_salt: str) -> str:
    """The namespace a request's cached state lives in: its tenant's, then its salt's.
    Unkeyed servers keep the salt alone (one tenant, as before keys existed)."""
    return f"{tenant}/{cache_salt}" if tenant else cache_salt


# -- where it listens ---------------------------------------------------------------------------
def is_loopback(host: str) -> bool:
    """Whether binding to `host` keeps the server to this machine: localhost, 127.0.0.0/8,
    ::1. Any other name or address counts as open (the cautious answer)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def keys_for_bind(host: str, api_keys: Iterable[str] | str | Path | None,
                  insecure: bool = False, operators: frozenset[str] = frozenset()
                  ) -> frozenset[str]:
    """The API keys a server on `host` will check (see `load_api_keys`). OpenBindRefused
    (one line) when `host` is beyond loopback and there is no key of either kind (an
    operator key alone closes the API to all but the operator), unless `insecure`."""
    keys = load_api_keys(api_keys)
    if not keys and not operators and not insecure and not is_loopback(host):
        raise OpenBindRefused(
            f"refusing to serve on {host} without API keys: anyone who can reach it could "
            f"use the model; give keys (--api-keys-file FILE or $SKIPPY_API_KEYS) or serve "
            f"it open on purpose (--insecure)")
    return keys


def loopback_host_header(value: str | None) -> bool:
    """Whether a Host header names this machine by loopback: localhost, 127.x.x.x or
    [::1], with any port."""
    name, port = _split_host(value or "")
    if port and not port.isdigit():
        return False
    return is_loopback(name)  # an IPv6 name keeps its brackets here, as a Host needs


def _split_host(value: str) -> tuple[str, str]:
    """(name, port) of a Host header; an IPv6 name keeps its brackets. Anything after
    the name but a ":" and a port comes back in the port, which then is not digits."""
    value = value.strip().lower()
    if value.startswith("["):
        name, bracket, rest = value.partition("]")
        if not bracket:
            return "", ""
        return name + "]", rest[1:] if rest.startswith(":") else rest or ""
    name, _, port = value.partition(":")
    return name, port


def json_content_type(value: str | None) -> bool:
    """application/json, with a UTF-8 charset or none (JSON is UTF-8: RFC 8259)."""
    media, *params = (value or "").split(";")
    if media.strip().lower() != "application/json":
        return False
    for p in params:
        name, _, v = p.partition("=")
        if name.strip().lower() == "charset" and \
                v.strip().strip('"').lower() not in ("utf-8", "utf8"):
            return False
    return True


# -- the middleware -----------------------------------------------------------------------------
class Edge:
    """Host, keys and content type (see the module's docstring), and each answer counted
    by `count(path, status)` whoever gave it. `direct`: handlers of POST by path
    (request -> response), called here rather than through the app's routing and
    dependency layers, which took 0.2 ms of a warm hit's 7; what they raise is answered
    as the app's exception handlers answer it."""

    def __init__(self, app, *, keys: ApiKeys, loopback: bool,
                 count: Callable[[str, int], None], direct: dict | None = None):
        self.app, self.keys, self.loopback, self.count = app, keys, loopback, count
        self.direct = direct or {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            refusal = self.refusal(scope)
            handler = self.direct.get(scope.get("path")) if scope.get("method") == "POST" \
                else None
            if refusal is None and handler is not None:
                await self._answer(handler, scope, receive, counting_send)
            elif refusal is None:
                await self.app(scope, receive, counting_send)
            else:
                await http_errors.answer(scope.get("path", ""), refusal)(
                    scope, receive, counting_send)
        finally:
            self.count(scope.get("path", ""), status[0])

    @staticmethod
    async def _answer(handler, scope, receive, send) -> None:
        try:
            response = await handler(Request(scope, receive))
        except Exception as e:  # noqa: BLE001 (as the app's handlers: an answer, logged)
            response = http_errors.answer(scope.get("path", ""), http_errors.api_error(e))
        await response(scope, receive, send)

    def refusal(self, scope) -> ApiError | None:
        """Why the request is refused before any route sees it, or None (and its tenant
        noted in the scope)."""
        path = scope.get("path", "")
        if self.loopback and not loopback_host_header(_header(scope, b"host")):
            return ApiError(400, "this server listens on loopback and answers only requests "
                                 "addressed to localhost, 127.0.0.1 or [::1]",
                            code="invalid_host")
        tenant, operator = "", not self.keys  # a server without keys has one user
        if self.keys and path not in OPEN_PATHS:
            who = self.keys.caller(_header(scope, b"authorization"),
                                   _header(scope, b"x-api-key"))
            if who is None:
                return ApiError(401, "missing or invalid API key (Authorization: Bearer "
                                     "<key>, or x-api-key: <key>)", code="invalid_api_key")
            tenant, operator = who
            if path in OPERATOR_PATHS and not operator:
                return ApiError(403, f"{path} spans every tenant: it needs an operator key "
                                     f"(--operator-keys-file)", code="operator_key_required")
        scope[TENANT], scope[OPERATOR] = tenant, operator
        if scope.get("method") == "POST" and path in JSON_POSTS and \
                not json_content_type(_header(scope, b"content-type")):
            return ApiError(415, "the request body must be JSON, sent with Content-Type: "
                                 "application/json", code="unsupported_media_type")
        return None


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None
