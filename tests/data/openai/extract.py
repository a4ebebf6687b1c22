"""Cut the response schemas our conformance test needs (with every schema they reference)
out of openai-openapi's openapi.yaml; write them as one JSON document."""
import json, subprocess, sys
import yaml

repo, commit, out = sys.argv[1], sys.argv[2], sys.argv[3]
text = subprocess.run(["git", "-C", repo, "show", f"{commit}:openapi.yaml"], check=True,
                      capture_output=True, text=True).stdout
spec = yaml.safe_load(text)
schemas = spec["components"]["schemas"]
ROOTS = ["CreateChatCompletionResponse", "CreateChatCompletionStreamResponse",
         "CreateCompletionResponse", "ErrorResponse", "ListModelsResponse", "Model"]
keep, todo = {}, list(ROOTS)

def refs(node):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref":
                yield v.rsplit("/", 1)[1]
            elif k not in ("x-oaiMeta", "example", "examples"):
                yield from refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from refs(v)

DOC_KEYS = ("description", "x-oaiMeta", "example", "examples", "x-stainless-const",
            "title", "deprecated")

def strip(node, names=False):
    """Drop documentation-only keys (descriptions, examples, x-oai metadata); the keys of
    a `properties` map are property names, kept whatever they are."""
    if isinstance(node, dict):
        if names:
            return {k: strip(v) for k, v in node.items()}
        return {k: strip(v, names=(k == "properties")) for k, v in node.items()
                if k not in DOC_KEYS}
    if isinstance(node, list):
        return [strip(v) for v in node]
    return node

while todo:
    name = todo.pop()
    if name in keep:
        continue
    keep[name] = schemas[name]
    todo.extend(refs(schemas[name]))
doc = {"openapi": spec["openapi"], "x-source": {
    "repository": "openai/openai-openapi", "path": "openapi.yaml", "commit": commit,
    "roots": ROOTS}, "components": {"schemas": {k: strip(keep[k]) for k in sorted(keep)}}}
with open(out, "w") as f:
    json.dump(doc, f, indent=1, sort_keys=False)
    f.write("\n")
print(len(keep), sorted(keep))
