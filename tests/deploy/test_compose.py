"""docker-compose.yml: valid against the compose specification, loadable by Docker
Compose itself, and describing the same stack as the Helm chart (services, environment
variable names, health checks), so that the two cannot drift apart."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from shared.healthcheck import SERVICES
from tests.deploy.tools import (
    COMPOSE_FILE, compose, compose_config, container, env, flotilla_workloads, helm_template,
    of_kind, tool,
)

HEALTHCHECK = ["python", "-m", "shared.healthcheck"]


@pytest.fixture(scope="module")
def stack() -> dict:
    """Every service, the gpu profile's too."""
    return compose_config("gpu")["services"]


@pytest.fixture(scope="module")
def chart() -> list[dict]:
    """The chart with an API key, so the gateway's FLOTILLA_API_KEY is there as in compose."""
    return helm_template({"apiKey": {"value": "compare"}})


def check_jsonschema(path) -> subprocess.CompletedProcess:
    return subprocess.run([tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec",
                           str(path)], capture_output=True, text=True, timeout=60)


# ------------------------------------------------------------------ validity
def test_compose_file_validates_against_the_compose_spec():
    result = check_jsonschema(COMPOSE_FILE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_spec_check_catches_a_bad_file(tmp_path):
    bad = yaml.safe_load(COMPOSE_FILE.read_text())
    bad["services"]["gateway"]["helthcheck"] = bad["services"]["gateway"].pop("healthcheck")
    (tmp_path / "docker-compose.yml").write_text(yaml.safe_dump(bad))
    assert check_jsonschema(tmp_path / "docker-compose.yml").returncode != 0


@pytest.mark.parametrize("profiles", [[], ["gpu"]])
def test_docker_compose_loads_it(profiles):
    args = [item for profile in profiles for item in ("--profile", profile)]
    result = compose(*args, "config", "--quiet")
    assert result.returncode == 0, result.stderr


# ------------------------------------------------------------------ the stack
def test_default_profile_runs_the_cpu_stack_and_gpu_adds_the_cuda_worker(stack):
    assert set(compose_config()["services"]) == {"nats", *SERVICES}
    assert set(stack) == {"nats", *SERVICES, "worker-gpu"}
    gpu, cpu = stack["worker-gpu"], stack["worker"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert gpu["environment"]["FLOTILLA_DEVICE"] == "cuda" and gpu["build"]["target"] == "cuda"
    assert gpu["image"] == "flotilla:0.1.0-cuda"
    assert cpu["environment"]["FLOTILLA_DEVICE"] == "cpu" and cpu["build"]["target"] == "cpu"
    assert "deploy" not in cpu and "profiles" not in cpu


def test_the_gpu_worker_reserves_a_gpu_per_tensor_parallel_rank(stack):
    assert stack["worker-gpu"]["environment"]["FLOTILLA_TENSOR_PARALLEL_SIZE"] == "1"
    services = compose_config("gpu", env={"FLOTILLA_TENSOR_PARALLEL_SIZE": "4"})["services"]
    gpu = services["worker-gpu"]
    assert gpu["environment"]["FLOTILLA_TENSOR_PARALLEL_SIZE"] == "4"
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["count"] == 4
    cpu = services["worker"]["environment"]
    assert cpu["FLOTILLA_TENSOR_PARALLEL_SIZE"] == "4"  # the CPU worker: processes


def test_nats_has_jetstream_on_a_volume(stack):
    nats = stack["nats"]
    assert "--jetstream" in nats["command"]
    store = nats["command"][nats["command"].index("--store_dir") + 1]
    (volume,) = nats["volumes"]
    assert (volume["type"], volume["source"], volume["target"]) == ("volume", "nats-data", store)


def test_ports_volumes_and_start_order(stack):
    gateway = stack["gateway"]
    assert [(p["target"], p["published"]) for p in gateway["ports"]] == [(8000, "8000")]
    for name in ("tokenizer", "worker", "worker-gpu"):
        mounts = {v["target"]: v for v in stack[name]["volumes"]}
        assert (mounts["/cache"]["type"], mounts["/cache"]["source"]) == ("volume", "model-cache")
        assert mounts["/models"]["read_only"] is True
    for name in ("gateway", "scheduler"):
        assert "volumes" not in stack[name]
    for name in ("tokenizer", "scheduler", "worker", "worker-gpu"):
        assert stack[name]["depends_on"] == {"nats": {"condition": "service_healthy", "required": True}}
    assert {k: v["condition"] for k, v in gateway["depends_on"].items()} == {
        "nats": "service_healthy", "tokenizer": "service_healthy", "scheduler": "service_healthy"}


def test_settings_come_from_the_environment():
    services = compose_config(env={"FLOTILLA_MODEL": "/models/llama", "FLOTILLA_API_KEY": "k",
                                   "FLOTILLA_HTTP_PORT": "9000", "FLOTILLA_MODELS_DIR": "/srv/models"})["services"]
    assert {s["environment"]["FLOTILLA_MODEL"] for n, s in services.items() if n != "nats"} == {"/models/llama"}
    assert services["gateway"]["environment"]["FLOTILLA_API_KEY"] == "k"
    assert services["gateway"]["ports"][0]["published"] == "9000"
    assert {v["target"]: v["source"] for v in services["worker"]["volumes"]}["/models"] == "/srv/models"


# ------------------------------------------------------------------ compose == chart
def chart_services(docs) -> dict[str, dict]:
    return flotilla_workloads(docs)


def test_same_services_as_the_chart(stack, chart):
    compose_services = {name.removesuffix("-gpu") for name in stack} - {"nats"}
    assert compose_services == set(chart_services(chart)) == set(SERVICES)
    nats_pods = [d for d in of_kind(chart, "StatefulSet")
                 if d["metadata"]["labels"].get("app.kubernetes.io/name") == "nats"]
    assert [c["name"] for c in nats_pods[0]["spec"]["template"]["spec"]["containers"]][0] == "nats"
    for name, workload in chart_services(chart).items():
        assert stack[name]["command"] == container(workload)["command"], name


def test_same_environment_variable_names_as_the_chart(stack, chart):
    workloads = chart_services(chart)
    for name in stack:
        if name == "nats":
            continue
        service = name.removesuffix("-gpu")
        assert set(stack[name]["environment"]) == set(env(workloads[service])), name
    for name, workload in chart_services(helm_template()).items():  # without an API key
        assert set(env(workload)) <= set(stack[name]["environment"]), name


def test_same_values_where_they_must_agree(stack, chart):
    workloads = chart_services(chart)
    for name in SERVICES:
        ours, theirs = stack[name]["environment"], env(workloads[name])
        assert ours["FLOTILLA_MODEL"] == theirs["FLOTILLA_MODEL"]["value"] == "smollm2"
        assert ours["FLOTILLA_NATS_URL"].startswith("nats://")
        if name in ("tokenizer", "worker"):
            assert ours["FLOTILLA_CACHE_DIR"] == theirs["FLOTILLA_CACHE_DIR"]["value"] == "/cache"
        if name in ("scheduler", "worker"):
            assert ours["FLOTILLA_REPLICA_ID"] == "0"  # one replica; the chart's is the pod index
    assert stack["gateway"]["environment"]["FLOTILLA_PORT"] == env(workloads["gateway"])["FLOTILLA_PORT"]["value"]
    assert stack["worker"]["image"] == container(workloads["worker"])["image"]
    gpu_worker = flotilla_workloads(helm_template({"worker": {"gpus": 1}}))["worker"]
    assert stack["worker-gpu"]["image"] == container(gpu_worker)["image"]


def test_same_health_checks_as_the_chart(stack, chart):
    """Compose's healthcheck is the chart's readiness probe: the same command, or for the
    gateway the same GET /health/ready (what `shared.healthcheck gateway` requests)."""
    workloads = chart_services(chart)
    for name in stack:
        if name == "nats":
            continue
        service = name.removesuffix("-gpu")
        test = stack[name]["healthcheck"]["test"]
        assert test[0] == "CMD" and test[1:] == HEALTHCHECK + [service], name
        readiness = container(workloads[service])["readinessProbe"]
        if service == "gateway":
            assert readiness["httpGet"]["path"] == "/health/ready"
        else:
            assert readiness["exec"]["command"] == test[1:], name
    nats_pod = [d for d in of_kind(chart, "StatefulSet")
                if d["metadata"]["labels"].get("app.kubernetes.io/name") == "nats"][0]
    nats_container = nats_pod["spec"]["template"]["spec"]["containers"][0]
    liveness = nats_container["livenessProbe"]["httpGet"]
    assert liveness["path"] in stack["nats"]["healthcheck"]["test"][-1]
    monitor_port = {p["name"]: p["containerPort"] for p in nats_container["ports"]}["monitor"]
    assert f":{monitor_port}/" in stack["nats"]["healthcheck"]["test"][-1]
    assert nats_container["image"] == stack["nats"]["image"]
