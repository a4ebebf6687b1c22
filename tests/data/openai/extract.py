"""Cut the response schemas tests/test_openai_schema.py needs (with every schema they
reference) out of openai-openapi's openapi.yaml into one JSON document, and the operations
we serve into an OpenAPI document of their own (see README.md).

    python extract.py <clone of openai/openai-openapi> <commit> <out.json> [<served.json>]
"""

from __future__ import annotations

import json
import subprocess
import sys

import yaml

ROOTS = ["CreateChatCompletionResponse", "CreateChatCompletionStreamResponse", "Response",
         "CreateEmbeddingResponse",
         "ResponseStreamEvent",
         "CreateCompletionResponse", "ErrorResponse", "ListModelsResponse", "Model"]
# the operations we serve, as OpenAI's document spells them (under its /v1 server)
SERVED = {"/completions": ["post"], "/chat/completions": ["post"], "/responses": ["post"],
          "/responses/{response_id}": ["get", "delete"], "/embeddings": ["post"],
          "/models": ["get"], "/models/{model}": ["get"]}
# documentation only: dropped (the keys of a `properties` map are names, always kept)
DOC_KEYS = ("description", "x-oaiMeta", "example", "examples", "x-stainless-const",
            "title", "deprecated")


def refs(node):
    """The schema names `node` refers to."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":  # "#/components/SECTION/NAME": (SECTION, NAME)
                yield tuple(value.split("/")[2:4])
            elif key not in DOC_KEYS:
                yield from refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from refs(value)


def strip(node, names: bool = False):
    if isinstance(node, dict):
        if names:
            return {k: strip(v) for k, v in node.items()}
        return {k: strip(v, names=(k == "properties")) for k, v in node.items()
                if k not in DOC_KEYS}
    if isinstance(node, list):
        return [strip(v) for v in node]
    return node


def closure(components: dict, roots) -> dict:
    """The components named in `roots` ((section, name) pairs), with every one they refer
    to, by section."""
    keep, todo = {}, list(roots)
    while todo:
        section, name = todo.pop()
        if name not in keep.setdefault(section, {}):
            keep[section][name] = components[section][name]
            todo.extend(refs(keep[section][name]))
    return {section: {k: strip(v[k]) for k in sorted(v)} for section, v in keep.items()}


def main(repo: str, commit: str, out: str, served: str | None = None) -> None:
    text = subprocess.run(["git", "-C", repo, "show", f"{commit}:openapi.yaml"],
                          check=True, capture_output=True, text=True).stdout
    spec = yaml.safe_load(text)
    source = {"repository": "openai/openai-openapi", "path": "openapi.yaml", "commit": commit}
    keep = closure(spec["components"], [("schemas", name) for name in ROOTS])
    write(out, {"openapi": spec["openapi"], "x-source": {**source, "roots": ROOTS},
                "components": keep})
    print(f"{len(keep['schemas'])} schemas: {', '.join(keep['schemas'])}")
    if served:
        paths = {path: {m: strip(spec["paths"][path][m]) for m in methods}
                 for path, methods in SERVED.items()}
        keep = closure(spec["components"], set(refs(paths)))
        write(served, {"openapi": spec["openapi"], "info": spec["info"],
                       "servers": [{"url": "/v1"}], "x-source": source, "paths": paths,
                       "components": keep})
        print(f"{sum(map(len, paths.values()))} operations, "
              f"{sum(map(len, keep.values()))} components")


def write(path: str, doc: dict) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main(*sys.argv[1:5])
