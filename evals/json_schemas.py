"""Generated JSON schemas with bounded replies, for structured-output tests and evals.

    schemas(n, seed=0) -> list of (name, schema)
    request_body(name, schema) -> a chat completion request for a reply in that schema
    conforms(reply, schema) -> whether the reply is JSON the schema accepts

Each schema is an object whose properties are all required, with no others allowed
(OpenAI's strict form), drawn from: strings with a maxLength, string enums, bounded
integers and numbers, booleans, arrays with a maxItems of those, and nested objects (two
levels at most). Every string and array is bounded, so a constrained reply is finite
whatever the model prefers. Deterministic in (n, seed): schema i depends only on the
seed and i, so the first k of 50 are the same k in a shorter run.
"""

from __future__ import annotations

import json
import random

WORDS = ("name", "city", "age", "score", "tags", "color", "size", "price", "count", "id",
         "title", "status", "level", "owner", "items", "kind", "weight", "rank", "note",
         "active", "unit", "label", "year", "rating")
COLORS = ("red", "green", "blue", "black", "white")
STATES = ("open", "closed", "pending", "done")


def schemas(n: int, seed: int = 0) -> list[tuple[str, dict]]:
    return [(f"schema_{i}", _object(random.Random(f"{seed}:{i}"), depth=0))
            for i in range(n)]


def _object(rng: random.Random, depth: int) -> dict:
    names = rng.sample(WORDS, rng.randint(1, 4 if depth == 0 else 3))
    props = {name: _value(rng, depth) for name in names}
    return {"type": "object", "properties": props, "required": names,
            "additionalProperties": False}


def _value(rng: random.Random, depth: int) -> dict:
    kinds = ["string", "enum", "integer", "number", "boolean", "array"]
    if depth < 2:
        kinds.append("object")
    kind = rng.choice(kinds)
    if kind == "object":
        return _object(rng, depth + 1)
    if kind == "array":
        return {"type": "array", "items": _scalar(rng, rng.choice(kinds[:5])),
                "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 4)}
    return _scalar(rng, kind)


def _scalar(rng: random.Random, kind: str) -> dict:
    if kind == "string":
        return {"type": "string", "minLength": 1, "maxLength": rng.randint(4, 24)}
    if kind == "enum":
        return {"type": "string", "enum": rng.sample(rng.choice((COLORS, STATES)), 3)}
    if kind == "integer":
        low = rng.randint(-10, 10)
        return {"type": "integer", "minimum": low, "maximum": low + rng.choice((9, 100, 2000))}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice((1, 100, 1e4))}
    return {"type": "boolean"}


def request_body(name: str, schema: dict, model: str = "smollm2",
                 max_tokens: int = 256) -> dict:
    """A greedy chat request for a reply in `schema` (response_format json_schema, strict),
    the schema also shown to the model as text."""
    return {"model": model, "temperature": 0, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "Reply with JSON matching this "
                          "schema: " + json.dumps(schema)}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": name, "schema": schema,
                                                "strict": True}}}


def conforms(reply: str, schema: dict) -> bool:
    """Whether `reply` is JSON that `schema` accepts (jsonschema's own validator)."""
    import jsonschema
    try:
        jsonschema.validate(json.loads(reply), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True
