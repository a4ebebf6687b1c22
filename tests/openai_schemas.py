"""OpenAI's published response schemas (tests/data/openai) as validators: the conformance
test and the gateway's request fuzzing check bodies with them."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import httpx
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


@functools.cache
def schema_names() -> frozenset[str]:
    """The schemas the document holds."""
    return frozenset(json.loads(DOCUMENT.read_text())["components"]["schemas"])


def conforms(name: str, body) -> None:
    """AssertionError naming every place where `body` breaks schema `name`."""
    errors = sorted(validator(name).iter_errors(body), key=lambda e: list(e.absolute_path))
    assert not errors, f"{name}: " + "; ".join(
        f"{list(e.absolute_path)}: {e.message}" for e in errors)


def source() -> dict:
    """Where the schemas come from (repository, path, commit)."""
    return json.loads(DOCUMENT.read_text())["x-source"]


# -- the Responses API, over HTTP ----------------------------------------------------------
def raw_events(url: str, body: dict, key: str) -> list[dict]:
    events = []
    with httpx.stream("POST", url + "/responses", json={**body, "stream": True}, timeout=120,
                      headers={"Authorization": f"Bearer {key}"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    return events


def responses_conform(url: str, body: dict, key: str = "x") -> dict:
    """The whole Response and every streamed event of `body`, each against the schema
    OpenAI publishes for it (tests/data/openai); the whole Response."""
    whole = httpx.post(url + "/responses", json=body, timeout=120,
                       headers={"Authorization": f"Bearer {key}"}).json()
    conforms("Response", whole)
    events = raw_events(url, body, key)
    for n, e in enumerate(events):
        assert e["sequence_number"] == n
        named = "Response" + "".join(w.title() for w in e["type"].replace("_", ".")
                                     .split(".")[1:]) + "Event"
        conforms(named if named in schema_names() else "ResponseStreamEvent", e)
    def same(output):  # ids are each response's own
        return [{k: v for k, v in item.items() if k not in ("id", "call_id")}
                for item in output]
    assert same(events[-1]["response"]["output"]) == same(whole["output"])
    return whole
