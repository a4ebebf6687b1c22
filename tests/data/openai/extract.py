"""Cut the response schemas tests/test_openai_schema.py needs (with every schema they
reference) out of openai-openapi's openapi.yaml into one JSON document (see README.md).

    python extract.py <clone of openai/openai-openapi> <commit> <out.json>
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
# documentation only: dropped (the keys of a `properties` map are names, always kept)
DOC_KEYS = ("description", "x-oaiMeta", "example", "examples", "x-stainless-const",
            "title", "deprecated")


def refs(node):
    """The schema names `node` refers to."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value.rsplit("/", 1)[1]
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


def main(repo: str, commit: str, out: str) -> None:
    text = subprocess.run(["git", "-C", repo, "show", f"{commit}:openapi.yaml"],
                          check=True, capture_output=True, text=True).stdout
    spec = yaml.safe_load(text)
    schemas = spec["components"]["schemas"]
    keep, todo = {}, list(ROOTS)
    while todo:
        name = todo.pop()
        if name not in keep:
            keep[name] = schemas[name]
            todo.extend(refs(schemas[name]))
    doc = {"openapi": spec["openapi"],
           "x-source": {"repository": "openai/openai-openapi", "path": "openapi.yaml",
                        "commit": commit, "roots": ROOTS},
           "components": {"schemas": {k: strip(keep[k]) for k in sorted(keep)}}}
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"{len(keep)} schemas: {', '.join(sorted(keep))}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
