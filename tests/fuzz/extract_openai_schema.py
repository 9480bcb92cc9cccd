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


def _refs(node, found: set[tuple[str, str]]) -> None:
    """Every (component kind, name) that ``node`` refers to."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/components/"):
            kind, name = ref.removeprefix("#/components/").split("/", 1)
            found.add((kind, name))
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
    components = document["components"]
    needed: set[tuple[str, str]] = set()
    _refs(paths, needed)
    todo = list(needed)
    while todo:
        kind, name = todo.pop()
        found: set[tuple[str, str]] = set()
        _refs(components[kind][name], found)
        todo += sorted(found - needed)
        needed |= found
    subset_components: dict[str, dict] = {}
    for kind, name in sorted(needed):
        subset_components.setdefault(kind, {})[name] = components[kind][name]
    return {"openapi": document["openapi"],
            "info": {**document["info"], "x-source": f"openai/openai-openapi@{commit}"},
            "servers": [{"url": "/v1"}], "paths": paths, "components": subset_components}


if __name__ == "__main__":
    source, commit = sys.argv[1], sys.argv[2]
    document = json.loads(Path(source).read_text())
    TARGET.write_text(json.dumps(subset(document, commit), indent=1, sort_keys=True) + "\n")
    print(f"wrote {TARGET} ({TARGET.stat().st_size} bytes)")
