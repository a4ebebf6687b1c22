"""OpenAI's published response schemas (tests/data/openai) as validators: the conformance
test and the gateway's request fuzzing check bodies with them."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

DOCUMENT = Path(__file__).parent / "data" / "openai" / "response_schemas.json"
BASE = "https://schemas.test/openai.json"


def or_null(node):
    """OpenAPI 3.0's `nullable: true` (some of OpenAI's schemas still say it) as JSON
    Schema spells it: the schema, or null."""
    if isinstance(node, list):
        return [or_null(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: or_null(v) for k, v in node.items() if k != "nullable"}
    return {"anyOf": [out, {"type": "null"}]} if node.get("nullable") is True else out


@functools.cache
def _registry() -> Registry:
    document = or_null(json.loads(DOCUMENT.read_text()))
    return Registry().with_resource(BASE, Resource(document, DRAFT202012))


@functools.cache
def validator(name: str) -> jsonschema.Draft202012Validator:
    """A validator for components/schemas/`name` of OpenAI's document."""
    return jsonschema.Draft202012Validator({"$ref": f"{BASE}#/components/schemas/{name}"},
                                           registry=_registry())


def conforms(name: str, body) -> None:
    """AssertionError naming every place where `body` breaks schema `name`."""
    errors = sorted(validator(name).iter_errors(body), key=lambda e: list(e.absolute_path))
    assert not errors, f"{name}: " + "; ".join(
        f"{list(e.absolute_path)}: {e.message}" for e in errors)


def source() -> dict:
    """Where the schemas come from (repository, path, commit)."""
    return json.loads(DOCUMENT.read_text())["x-source"]
