"""OpenAI's `response_format` -> the constraint the reply is decoded under (mesh/constraint.py).

    {"type": "text"}                                   free text (no constraint)
    {"type": "json_object"}                            any JSON object
    {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}
                                                       one JSON value the schema accepts

The schema is enforced by constrained decoding whatever `strict` says (a reply that does
not match is never produced), so `strict` is accepted and needs nothing more. vLLM's
`structured_outputs` (`{"grammar": Lark}` or `{"regex": ...}`) is taken too. A schema
the grammar engine cannot compile is the client's mistake: `ResponseFormatError`, which
the caller turns into a 400 naming `response_format`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from skippy.topology.errors import RequestError

from ..constraint import Constraint, ConstraintError, check, json_object, json_schema, lark

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for json_schema.name
MAX_SCHEMA_CHARS = 64 * 1024  # compiling is bounded by the engine; this bounds the text


class ResponseFormatError(RequestError):
    """A response_format the server cannot follow; the message is one line."""

    def __init__(self, message: str):
        super().__init__(message, "response_format")


def response_constraint(value: Any) -> Constraint | None:
    """The constraint `response_format` asks for (None: free text), compiled once here so
    that a bad schema is refused before any stage sees it."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ResponseFormatError("response_format must be an object with a type")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        constraint = json_object()
    elif kind == "json_schema":
        constraint = json_schema(_schema(value.get("json_schema")))
    else:
        raise ResponseFormatError(f"response_format type {kind!r} is not supported (text, "
                                  f"json_object or json_schema)")
    if len(constraint.text) > MAX_SCHEMA_CHARS:
        raise ResponseFormatError(f"the JSON schema takes at most {MAX_SCHEMA_CHARS} "
                                  f"characters")
    try:
        check(constraint)
    except ConstraintError as e:
        raise ResponseFormatError(f"the JSON schema cannot be used: {e}") from None
    return constraint


def structured_outputs(value: Any) -> Constraint | None:
    """vLLM's `structured_outputs` extension (None: absent): `{"grammar": <Lark, in
    llguidance's dialect>}` or `{"regex": <pattern>}` for the whole reply."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or len(value) != 1 or \
            not isinstance(value.get("grammar", value.get("regex")), str):
        raise ResponseFormatError("structured_outputs takes one of grammar (Lark) or regex, "
                                  "as a string")
    if "grammar" in value:
        constraint = lark(value["grammar"])
    else:
        constraint = lark(f"start: /{value['regex'].replace('/', chr(92) + '/')}/")
    if len(constraint.text) > MAX_SCHEMA_CHARS:
        raise ResponseFormatError(f"the grammar takes at most {MAX_SCHEMA_CHARS} characters")
    try:
        check(constraint)
    except ConstraintError as e:
        raise ResponseFormatError(f"the grammar cannot be used: {e}") from None
    return constraint


def _schema(spec: Any) -> Mapping | bool:
    if not isinstance(spec, Mapping):
        raise ResponseFormatError("response_format json_schema needs a json_schema object "
                                  "with a name and a schema")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ResponseFormatError("json_schema.name must be 1 to 64 letters, digits, _ or -")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ResponseFormatError("json_schema.strict must be a boolean")
    schema = spec.get("schema", {})  # OpenAI: optional; none accepts any JSON value
    if not isinstance(schema, (Mapping, bool)):
        raise ResponseFormatError("json_schema.schema must be a JSON schema (an object)")
    return schema
