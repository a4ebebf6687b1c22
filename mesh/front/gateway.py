"""The OpenAI-compatible HTTP gateway over any `Engine` (DESIGN.md §4, §8), which also
speaks Anthropic's Messages API (anthropic_api): its routes,
the edge every request passes (host, keys, content type: edge.py) and the server that
runs it.

Each room of the gateway is its own module: a completion's life (completions), request
building (request_building), admission and readiness (admission), JSON and SSE answers
(rendering), every failure as its answer (http_errors). A new route adds a route here
and a renderer there.

Bodies are parsed by hand rather than by FastAPI models, so every mistake is a 4xx in
OpenAI's error envelope and never FastAPI's 422.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from skippy.topology.errors import UserError

from .. import tracing
from ..control.engine import Engine
from ..control.model_set import ModelSet
from . import http_errors
from .admission import request_slots
from .completions import Completions
from .edge import TENANT, ApiKeys, Edge, is_loopback, keys_for_bind, load_api_keys, \
    load_operator_keys
from .fronts import Fronts, Shared
from .in_flight import InFlight
from .limits import DEFAULT_PORT, GatewayLimits
from .metrics import CONTENT_TYPE, GatewayMetrics
from .openai_api import ApiError, parse_json
from .request_building import not_served
from .result_memo import ResultMemo
from .status import StatusBoard, add_status_routes

__all__ = ["BackgroundServer", "create_app", "load_api_keys", "serve"]

log = logging.getLogger(__name__)

_ENDPOINTS = {"/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/responses",
              "/v1/embeddings",
              "/v1/messages",
              "/v1/messages/count_tokens", "/tokenize", "/detokenize", "/health", "/ready",
              "/metrics", "/", "/status.json", "/admin/drain"}


async def _guarded(awaitable):
    """Failures become an error answer here (a handler registered for Exception would
    still let Starlette re-raise the failure and log it a second time)."""
    try:
        return await awaitable
    except Exception as e:  # noqa: BLE001
        raise http_errors.api_error(e) from None


def create_app(engine: Engine | ModelSet, *, api_keys: Iterable[str] | str | Path | None = None,
               limits: GatewayLimits | None = None, memo: ResultMemo | None = None,
               close_engine: bool = False, bind_host: str = "127.0.0.1",
               control_text: bool = False, tenant_secret: str | None = None,
               operator_keys: Iterable[str] | str | Path | None = None) -> FastAPI:
    """The gateway app for `engine`, or for each model of a set (mesh/control/model_set.py:
    a request's `model` picks one, loaded on demand).

    api_keys: see `load_api_keys` (None reads $SKIPPY_API_KEYS). limits: what it admits
    (the defaults by default). memo: the exact-results store (a fresh bounded one by
    default). close_engine: close the engine when the app shuts down (`serve` does; tests
    that share an engine do not). bind_host: where the server listens; on loopback the
    app answers only requests addressed to loopback (the Host header), against DNS
    rebinding. control_text: message text that spells a control token is that token
    (trusted clients only; by default it is text). tenant_secret: keys each API key's
    cache namespace (see `ApiKeys`). operator_keys: the keys that may also read what
    spans tenants (`load_operator_keys`; None reads $SKIPPY_OPERATOR_KEYS)."""

    models = engine if isinstance(engine, ModelSet) else ModelSet.of(engine)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        if close_engine:
            await models.close()

    limits, memo = limits or GatewayLimits(), memo or ResultMemo()
    slots, in_flight = request_slots(limits), InFlight()
    metrics = GatewayMetrics(models.stats, memo.stats, slots.stats)
    fronts = Fronts(models, Shared(limits, memo, metrics, slots, in_flight, control_text))
    fronts.loaded()  # the loaded models' tokenizers and templates: read before serving
    completions = Completions(fronts, limits)
    app = FastAPI(title="skippy-mesh", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.limits = limits  # the server's connections keep them too (connections.py)
    http_errors.install(app)
    _routes(app, completions, metrics)
    add_status_routes(app, StatusBoard(models, metrics, in_flight))
    keys = ApiKeys(load_api_keys(api_keys), tenant_secret, load_operator_keys(operator_keys))
    app.add_middleware(Edge, keys=keys, loopback=is_loopback(bind_host),
                       count=_counter(metrics), direct=_generating(completions))
    if tracing.enabled():  # outermost: a request's span holds the edge's refusals too
        app.add_middleware(tracing.HttpSpans)
    return app


def _generating(completions: Completions) -> dict:
    """The routes that generate, by path: POST only. The edge answers them itself
    (Edge.direct), past FastAPI's routing; their FastAPI routes answer other methods."""
    return {"/v1/completions": lambda request: completions.complete(request, chat=False),
            "/v1/chat/completions": lambda request: completions.complete(request, chat=True),
            "/v1/messages": completions.message, "/v1/responses": completions.response}


def _route(handler):
    async def route(request: Request):
        return await _guarded(handler(request))
    return route


def _counter(metrics: GatewayMetrics):
    def count(path: str, status: int) -> None:
        """One answer, by endpoint and status (the edge calls this for every request)."""
        endpoint = path if path in _ENDPOINTS else (
            "/v1/models" if path.startswith("/v1/models/") else
            "/v1/responses" if path.startswith("/v1/responses/") else "other")
        metrics.requests.labels(endpoint, str(status)).inc()
    return count


def _routes(app: FastAPI, completions: Completions, metrics: GatewayMetrics) -> None:
    fronts, created = completions.fronts, int(time.time())
    models = fronts.models

    def model_card(name: str) -> dict:
        info = models.info(name)
        card = {"id": name, "object": "model", "created": created,
                "owned_by": "skippy-mesh"}
        if info is not None:
            card["max_model_len"] = info.n_ctx
        if len(models.names) > 1:  # llama-server's router says the same
            card["status"] = {"value": "loaded" if info is not None else "unloaded"}
        return card

    @app.get("/health")
    async def health():
        return fronts.health()

    @app.get("/ready")
    async def ready():
        # the body says only that: the reason is logged
        if await fronts.ready():
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/metrics")
    async def metrics_page():
        # the engine's figures may come from Ray (a blocking call): off the event loop
        return Response(await asyncio.to_thread(metrics.render), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def model_list():
        return {"object": "list", "data": [model_card(name) for name in models.names]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model not in models.slots:
            raise not_served(model, models.names)
        return model_card(model)

    for path, handler in _generating(completions).items():
        app.add_api_route(path, _route(handler), methods=["POST"])

    _agent_routes(app, completions)
    _operator_routes(app, completions)


def _operator_routes(app: FastAPI, completions: Completions) -> None:
    """What the operator does to the cluster under load (an operator key, once keys are
    on: edge.OPERATOR_PATHS)."""

    @app.post("/admin/drain")
    async def drain(request: Request):
        body = parse_json(await request.body())
        node = body.get("node") if isinstance(body, dict) else None
        if not isinstance(node, str) or not node:
            raise ApiError(400, "give the node to drain: {\"node\": \"<its Ray node id, or "
                                "its first characters>\"}", param="node")
        engines = [s.engine for s in completions.fronts.models.loaded()
                   if hasattr(s.engine, "drain")]
        if not engines:
            raise ApiError(400, "this server's stages run in its own process: there is no "
                                "node to drain", code="not_supported")
        try:
            return {"drained": [await e.drain(node) for e in engines]}
        except UserError as e:
            raise ApiError(409, str(e), param="node", code="cannot_drain") from None


def _agent_routes(app: FastAPI, completions: Completions) -> None:
    """The APIs agents speak beside chat (Responses, Anthropic's Messages) and the
    tokenizer's own routes."""

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        return await _guarded(completions.count_tokens(request))

    @app.get("/v1/responses/{response_id}")
    async def stored_response(request: Request, response_id: str):
        return completions.stored.get(request.scope.get(TENANT, ""), response_id).response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str):
        completions.stored.delete(request.scope.get(TENANT, ""), response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        return await _guarded(completions.embeddings(request))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await _guarded(completions.tokenize(request))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await _guarded(completions.tokenize(request, detokenize=True))


# -- running it ---------------------------------------------------------------------------------------
def serve(engine: Engine, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
          api_keys: Iterable[str] | str | Path | None = None, *, insecure: bool = False,
          operator_keys: Iterable[str] | str | Path | None = None, **app_options) -> None:
    """Serve until Ctrl-C (uvicorn handles the signal), then close the engine.

    api_keys, operator_keys: see `create_app`. Beyond loopback without keys it refuses to
    start (OpenBindRefused) unless `insecure`; a key file that cannot be read or holds no
    key is a KeyFileError (both UserErrors). Either way the engine is closed."""
    import uvicorn

    from . import connections
    try:
        operators = load_operator_keys(operator_keys)
        keys = keys_for_bind(host, api_keys, insecure, operators)
    except UserError:
        asyncio.run(engine.close())
        raise
    app = create_app(engine, api_keys=keys, operator_keys=operators, close_engine=True,
                     bind_host=host, **app_options)
    uvicorn.Server(connections.config(app, host, port, "info")).run()


class BackgroundServer:
    """uvicorn in a daemon thread on a free loopback port (tests, embedding)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        from . import connections
        if port == 0:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.url = f"http://{host}:{port}"
        self._server = uvicorn.Server(connections.config(app, host, port, "warning"))
        self._server.install_signal_handlers = lambda: None  # not the main thread
        self._thread = threading.Thread(target=self._server.run, daemon=True,
                                        name=f"gateway:{port}")

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> BackgroundServer:  # noqa: PYI034
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
