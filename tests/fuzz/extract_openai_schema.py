"""Cut OpenAI's published OpenAPI description (github.com/openai/openai-openapi,
openapi.json, MIT licence) down to what flotilla serves: chat completions, completions
and models, with every schema they reference.

    python tests/fuzz/extract_openai_schema.py path/to/openapi.json COMMIT

writes tests/fuzz/openai_openapi_subset.json, which the field test and the fuzz run read.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OPERATIONS = {("/chat/completions", "post"), ("/completions", "post"), ("/models", "get"),
              ("/models/{model}", "get")}
TARGET = Path(__file__).with_name("openai_openapi_subset.json")


def _refs(node, found: set[str]) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
            found.add(ref.rsplit("/", 1)[1])
        for value in node.values():
            _refs(value, found)
    elif isinstance(node, list):
        for value in node:
            _refs(value, found)


def subset(document: dict, commit: str) -> dict:
    paths = {}
    for path, method in sorted(OPERATIONS):
        operation = dict(document["paths"][path][method])
        operation.pop("x-oaiMeta", None)
        paths.setdefault(path, {})[method] = operation
    schemas = document["components"]["schemas"]
    needed: set[str] = set()
    _refs(paths, needed)
    todo = list(needed)
    while todo:
        found: set[str] = set()
        _refs(schemas[todo.pop()], found)
        todo += sorted(found - needed)
        needed |= found
    return {"openapi": document["openapi"],
            "info": {**document["info"], "x-source": f"openai/openai-openapi@{commit}"},
            "servers": [{"url": "/v1"}], "paths": paths,
            "components": {"schemas": {name: schemas[name] for name in sorted(needed)}}}


if __name__ == "__main__":
    source, commit = sys.argv[1], sys.argv[2]
    document = json.loads(Path(source).read_text())
    TARGET.write_text(json.dumps(subset(document, commit), indent=1, sort_keys=True) + "\n")
    print(f"wrote {TARGET} ({TARGET.stat().st_size} bytes)")
