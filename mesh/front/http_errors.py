"""Every failure as the client's answer in its API's error envelope (OpenAI's, or
Anthropic's under /v1/messages), decided here only.

By type (topology/errors.py), never by a builtin one:

- `ApiError`: already an answer (the gateway's own refusals: 404, 413, 504, ...);
- `RequestError`: the request's fault -> 400 naming its `param`;
- `OverCapacity`: no room now -> 503 with Retry-After;
- `StageUnavailable`: a stage failed past what recovery absorbs -> 503 carrying the id
  the stage logged the traceback under (this log gets the id too);
- anything else is ours -> 500 `server_error` with a new error id, logged here with its
  traceback. The exception's text may tell what a caller should not learn (hosts, paths,
  state): only the id is told.

Once a stream has begun the same envelope travels as an SSE error event (`event`).
`install` has the app answer what its routes do not catch the same way (FastAPI's and
Starlette's own refusals included), each error in one line.
"""

from __future__ import annotations

import logging
import math

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from skippy.topology.errors import (OverCapacity, RequestError, StageUnavailable, log_ours,
                                    new_error_id, one_line)

from . import anthropic_api
from .openai_api import ApiError, bad, sse

log = logging.getLogger(__name__)

RETRY_AFTER_S = 2  # what a 503 tells the client when nothing better is known


def api_error(e: BaseException) -> ApiError:
    """The answer for `e` (see the module docstring); logs what is ours."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, RequestError):
        return ApiError(400, one_line(e), param=e.param, code=e.code)
    if isinstance(e, OverCapacity):
        return unavailable(f"the engine is busy, retry later ({one_line(e)})",
                           "engine_busy", e.retry_after)
    if isinstance(e, StageUnavailable):
        return _stage_unavailable(e)
    return internal(e)


def event(e: BaseException) -> bytes:
    """`e`'s answer as an SSE event, for a stream whose headers are already sent."""
    return sse(api_error(e).envelope())


def unavailable(message: str, code: str, retry_after: float = RETRY_AFTER_S) -> ApiError:
    seconds = str(max(1, math.ceil(retry_after)))  # HTTP wants whole seconds
    return ApiError(503, message, code=code, headers={"Retry-After": seconds})


def internal(e: BaseException) -> ApiError:
    """A 500 whose message names an error id the log has beside the traceback."""
    error_id = new_error_id()
    log_ours(log, e, error_id)
    return ApiError(500, f"the server failed to answer this request (error {error_id}); "
                         f"its operator can look the id up in the server's log",
                    code="internal_error")


def answer(path: str, e: ApiError) -> JSONResponse:
    """`e` as the response to a request for `path`: in Anthropic's envelope under
    /v1/messages, in OpenAI's everywhere else."""
    body = anthropic_api.envelope(e) if anthropic_api.is_messages(path) else e.envelope()
    return JSONResponse(body, status_code=e.status, headers=e.headers)


def install(app: FastAPI) -> None:
    """Answer what escapes the routes in the same envelopes too."""

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return answer(request.url.path, e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return answer(request.url.path, ApiError(e.status_code, str(e.detail), code=code))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e: RequestValidationError):
        return answer(request.url.path, bad(f"invalid request: {one_line(e)}"))

    @app.exception_handler(Exception)
    async def _unexpected(request, e: Exception):
        return answer(request.url.path, internal(e))


def _stage_unavailable(e: StageUnavailable) -> ApiError:
    # the traceback is in the stage's log under the stage's id; this log ties it to us
    error_id = e.error_id or new_error_id()
    log.error("a stage failed past recovery [%s]: %s", error_id, one_line(e))
    return unavailable(f"a stage of this server failed and could not be recovered (error "
                       f"{error_id}); retry later, or give its operator the id",
                       "stage_unavailable")
