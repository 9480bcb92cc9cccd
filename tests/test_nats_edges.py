"""Where NATS is touched: only the modules in NATS_EDGES import shared.bus or nats (also
inside functions); everything else in the product (services/, shared/, cli/, kernels/) is
plain code that tests drive without a bus. Each service's edge is its service.py plus the
named client modules kept apart so service.py stays about one job (docs/ARCHITECTURE.md).
Benchmarks and tests are not the product and may use the bus freely."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_boundaries import ROOT

PRODUCT = ("services", "shared", "cli", "kernels")

# module -> why it talks to NATS. A new edge module is one line here (and one word in
# docs/ARCHITECTURE.md); one that stops importing the bus must leave the list.
NATS_EDGES = {
    "shared/bus.py": "the typed request/publish/subscribe layer over nats-py",
    "shared/healthcheck.py": "the container probe: one health request, without the Bus",
    "services/gateway/service.py": "the gateway's edge: tokenizer calls, submits, outputs",
    "services/gateway/health_checks.py": "health calls to the other tiers (/health)",
    "services/gateway/block_feed.py": "the block index's events and snapshots",
    "services/gateway/lora_directory.py": "LoRA loads and unloads sent to every scheduler",
    "services/gateway/response_store.py": "stored responses in JetStream: the stream, records, replays",
    "services/tokenizer/service.py": "the tokenizer's edge",
    "services/scheduler/service.py": "the scheduler's edge: submits, steps, stats",
    "services/scheduler/kv_client.py": "lookups and pins at the node's kvstore",
    "services/scheduler/kv_connector.py": "builds the KvClient over the scheduler's bus (the kvstore's connector)",
    "services/scheduler/block_events.py": "block events and snapshots for the gateways",
    "services/scheduler/output_publisher.py": "outputs to the gateways, held ones sent again",
    "services/scheduler/lora_handlers.py": "the scheduler's LoRA load and unload endpoints",
    "services/worker/service.py": "the worker's edge: steps",
    "services/worker/kv_upkeep.py": "attach, reserve, keepalive and commits at the node's kvstore",
    "services/kvstore/service.py": "the kvstore's edge",
}


def touches_nats(path: Path) -> list[str]:
    """'line: module' for each import of nats or shared.bus in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # from shared import bus: the name may be a submodule
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found += [f"{node.lineno}: {name}" for name in names if _is_nats(name)][:1]
    return found


def _is_nats(module: str) -> bool:
    parts = module.split(".")
    return parts[0] == "nats" or parts[:2] == ["shared", "bus"]


def nats_importers(root: Path = ROOT, packages: tuple[str, ...] = PRODUCT) -> dict[str, list[str]]:
    """Every product module that imports NATS or the bus: relative path -> its imports."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            imports = touches_nats(path)
            if imports:
                found[path.relative_to(root).as_posix()] = imports
    return found


def test_only_the_named_edges_touch_nats():
    others = {module: imports for module, imports in nats_importers().items()
              if module not in NATS_EDGES}
    assert not others, (
        "these modules import NATS or shared.bus: keep the bus in the service's edge "
        "(service.py) and pass plain data in, or name the module in NATS_EDGES and "
        f"docs/ARCHITECTURE.md: {others}")


def test_every_named_edge_still_touches_nats():
    stale = sorted(set(NATS_EDGES) - set(nats_importers()))
    assert not stale, f"no longer an edge (or gone): remove from NATS_EDGES: {stale}"


def test_the_check_finds_imports_anywhere_in_a_module(tmp_path):
    package = tmp_path / "services"
    package.mkdir()
    (package / "top.py").write_text("from shared.bus import Bus\n")
    (package / "inner.py").write_text("def f():\n    import nats.errors\n")
    (package / "client.py").write_text("from nats.aio.client import Client\n")
    (package / "by_name.py").write_text("from shared import bus\n")
    (package / "clean.py").write_text("from shared.messages import encode\nimport natsort\n")
    assert nats_importers(tmp_path, ("services",)) == {
        "services/by_name.py": ["1: shared.bus"],
        "services/client.py": ["1: nats.aio.client"],
        "services/inner.py": ["2: nats.errors"],
        "services/top.py": ["1: shared.bus"],
    }
