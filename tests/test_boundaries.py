"""Services never import each other: what two services share lives in shared/ (or
kernels/), so each one can be deployed, restarted and replaced on its own."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVICES = sorted(p.name for p in (ROOT / "services").iterdir()
                  if p.is_dir() and (p / "__init__.py").exists())


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every absolute module a file imports (also inside functions), with its line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            if node.module == "services":  # from services import tokenizer
                found += [(node.lineno, f"services.{alias.name}") for alias in node.names]
    return found


def crossings(package: Path, allowed_service: str | None, root: Path = ROOT) -> list[str]:
    """Imports of a service other than ``allowed_service`` in the files under ``package``."""
    bad = []
    for path in sorted(package.rglob("*.py")):
        for line, module in imported_modules(path):
            parts = module.split(".")
            if parts[0] == "services" and len(parts) > 1 and parts[1] != allowed_service:
                bad.append(f"{path.relative_to(root)}:{line} imports {module}")
    return bad


def test_there_are_services_to_check():
    assert {"gateway", "tokenizer", "scheduler", "worker"} <= set(SERVICES)


def test_no_service_imports_another():
    bad = [entry for service in SERVICES
           for entry in crossings(ROOT / "services" / service, service)]
    assert not bad, "move what two services share to shared/:\n" + "\n".join(bad)


def test_shared_and_kernels_import_no_service():
    bad = crossings(ROOT / "shared", None) + crossings(ROOT / "kernels", None)
    assert not bad, "\n".join(bad)


def test_the_check_catches_a_crossing(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "m.py").write_text("import services.gateway.app\n"
                                  "def f():\n    from services.tokenizer.encoding import TextCodec\n")
    (package / "n.py").write_text("from services import worker\n")
    assert crossings(package, "gateway", tmp_path) == [
        "pkg/m.py:3 imports services.tokenizer.encoding", "pkg/n.py:1 imports services.worker"]
