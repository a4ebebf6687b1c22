"""Our own exception types: the failures a caller can act on, and everything else ours.

Each edge translates these, and only these, into its caller's answer, in one place: HTTP
in mesh/front/http_errors.py, the stage RPC in mesh/stage/session.py (and back into
these in mesh/control/driver.py), the command line in mesh/cli.py.

- `UserError`: a mistake of whoever asked — a request, a command line, a setting, a model
  file they named. Its message is one line addressed to them. `RequestError` is the one a
  request makes (HTTP 400 naming its `param`; a stage's `invalid`, never retried).
- `OverCapacity`: nothing is wrong, there is no room now (503 with Retry-After).
- `StageUnavailable`: a stage failed and recovery could not absorb it (503 with the id
  under which the stage logged it).

Anything else, a builtin `ValueError` included, is a bug of ours: logged with its
traceback and an error id in the process where it happened, and the caller is told only
the id. A builtin exception is never read as the caller's fault.

This module sits in topology/, the bottom of the import order (DESIGN.md §3), so that
cache/ and topology/ raise these types too; it imports nothing of ours.
"""

from __future__ import annotations

import logging
import secrets


class UserError(Exception):
    """The caller's mistake, told to them in one line (never a bug of ours)."""


class RequestError(UserError):
    """The request itself is at fault. `param`: the field it names (OpenAI's envelope);
    `code`: a machine-readable reason, where one helps."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class OverCapacity(Exception):
    """No room for this request now (lanes, slots, a pipeline under repair); nothing is
    wrong with it: retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class StageUnavailable(Exception):
    """A stage failed and recovery could not absorb it. `error_id`: the id the stage
    logged the failure under ("" when no stage logged one, e.g. a link that went down)."""

    def __init__(self, message: str, error_id: str = ""):
        super().__init__(message)
        self.error_id = error_id


def new_error_id() -> str:
    """A short random id that ties a caller's answer to the log line with the traceback."""
    return "err_" + secrets.token_hex(6)


def log_ours(log: logging.Logger, exc: BaseException, error_id: str,
             what: str = "unexpected failure") -> None:
    """Log a failure of ours with its traceback under `error_id`."""
    log.error("%s [%s]: %s", what, error_id, one_line(exc),
              exc_info=(type(exc), exc, exc.__traceback__))


def one_line(e: object) -> str:
    """An exception's (or any error object's) text on one line, its type's name when it
    has none."""
    return " ".join(str(e).split()) or type(e).__name__
