"""The Helm chart, rendered by Helm's own engine for several value sets: lint, Kubernetes
schema validation of every manifest, and assertions on what the services get."""

from __future__ import annotations

import base64
import json

import pytest

from deploy.alerts import rule_groups
from deploy.dashboards import DASHBOARDS
from shared.healthcheck import SERVICES
from tests.deploy.tools import (
    KUBE_VERSIONS, container, env, flotilla_workloads, helm_error, helm_lint, helm_template,
    helm_template_text, of_kind, validate_kubernetes,
)

EXTERNAL_NATS = "nats://nats.messaging.svc:4222"
API_KEY = "sk-test-0123456789"
VALUE_SETS = {
    "defaults": {},
    "gpu-worker-2-replicas": {"worker": {"gpus": 1, "replicas": 2}},
    "tensor-parallel": {"worker": {"gpus": 1, "tensorParallelSize": 4, "replicas": 2}},
    "external-nats": {"nats": {"enabled": False}, "externalNats": {"url": EXTERNAL_NATS}},
    "api-key": {"apiKey": {"value": API_KEY}},
    "all-options": {
        "model": {"name": "/models/Llama-3.1-8B-Instruct",
                  "volume": {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}}},
        "cache": {"volume": {"persistentVolumeClaim": {"claimName": "flotilla-cache"}}},
        "apiKey": {"existingSecret": "inference-keys", "secretKey": "token"},
        "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
        "grafanaDashboards": {"enabled": True, "annotations": {"grafana_folder": "LLM serving"}},
        "prometheusRules": {"enabled": True, "labels": {"release": "prometheus"}},
        "gateway": {"autoscaling": {"enabled": True, "maxReplicas": 8},
                    "service": {"type": "LoadBalancer", "port": 80}},
        "tokenizer": {"autoscaling": {"enabled": True}},
        "worker": {"gpus": 2, "replicas": 3, "nodeSelector": {"gpu": "h100"},
                   "env": {"FLOTILLA_KV_CACHE_MEMORY": "40GiB", "FLOTILLA_LOG_LEVEL": "debug"},
                   "args": ["--dtype", "bfloat16"]},
        "imagePullSecrets": [{"name": "registry"}],
        "subjectNamespace": "team-a",
    },
}
HEALTHCHECK = ["python", "-m", "shared.healthcheck"]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: helm_template(values) for name, values in VALUE_SETS.items()}


def probe_command(probe: dict | None) -> list[str] | None:
    return None if probe is None else probe["exec"]["command"]


# ------------------------------------------------------------------ lint and schemas
@pytest.mark.parametrize("name", VALUE_SETS)
def test_helm_lint_strict_passes(name):
    report = helm_lint(VALUE_SETS[name])
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # warnings and errors
    assert not problems and not report["errors"], report


@pytest.mark.parametrize("name", VALUE_SETS)
@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_every_manifest_validates_against_the_kubernetes_schema(rendered, name, version):
    docs = rendered[name]
    assert docs
    for doc in docs:
        validate_kubernetes(doc, version)  # raises on an invalid or unknown-kind manifest


def test_the_schema_check_catches_a_bad_manifest(rendered):
    """The validator can fail: a misspelt probe field and a string replica count."""
    import copy

    import jsonschema

    worker = copy.deepcopy(flotilla_workloads(rendered["defaults"])["worker"])
    container(worker)["readinesProbe"] = container(worker).pop("readinessProbe")
    with pytest.raises(jsonschema.ValidationError):
        validate_kubernetes(worker, KUBE_VERSIONS[-1])
    gateway = copy.deepcopy(flotilla_workloads(rendered["defaults"])["gateway"])
    gateway["spec"]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        validate_kubernetes(gateway, KUBE_VERSIONS[0])


# ------------------------------------------------------------------ defaults
def test_defaults_run_every_service_with_real_probes(rendered):
    workloads = flotilla_workloads(rendered["defaults"])
    assert set(workloads) == set(SERVICES)
    kinds = {name: w["kind"] for name, w in workloads.items()}
    assert kinds == {"gateway": "Deployment", "tokenizer": "Deployment",
                     "scheduler": "StatefulSet", "worker": "StatefulSet", "kvstore": "DaemonSet"}
    for name, workload in workloads.items():
        c = container(workload)
        assert c["name"] == name
        assert c["command"] == ["python", "-m", f"services.{name}"]
        assert c["image"] == "flotilla:0.1.0"
        assert c["startupProbe"] and c["readinessProbe"]
    worker, scheduler = container(workloads["worker"]), container(workloads["scheduler"])
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert probe_command(worker[kind]) == HEALTHCHECK + ["worker"]
    assert probe_command(scheduler["livenessProbe"]) == HEALTHCHECK + ["scheduler", "--live"]
    assert probe_command(scheduler["readinessProbe"]) == HEALTHCHECK + ["scheduler"]
    tokenizer = container(workloads["tokenizer"])
    assert probe_command(tokenizer["readinessProbe"]) == HEALTHCHECK + ["tokenizer"]
    assert "livenessProbe" not in tokenizer  # queue-group health: see values.yaml
    gateway = container(workloads["gateway"])
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/health/ready", "port": "http"}
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/health/live", "port": "http"}
    assert gateway["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert env(workloads["gateway"])["FLOTILLA_PORT"] == {"value": "8000"}


def test_defaults_bundle_nats_with_jetstream_and_point_every_service_at_it(rendered):
    docs = rendered["defaults"]
    nats_services = [d for d in of_kind(docs, "Service") if d["metadata"]["name"] == "demo-nats"]
    assert len(nats_services) == 1, "the NATS chart's client Service"
    ports = {port["name"]: port["port"] for port in nats_services[0]["spec"]["ports"]}
    assert ports["nats"] == 4222
    for name, workload in flotilla_workloads(docs).items():
        assert env(workload)["FLOTILLA_NATS_URL"] == {"value": "nats://demo-nats.inference.svc:4222"}, name
    (config_map,) = [d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"] == "demo-nats-config"]
    assert '"jetstream"' in config_map["data"]["nats.conf"]
    (nats,) = [d for d in of_kind(docs, "StatefulSet") if d["metadata"]["name"] == "demo-nats"]
    assert nats["spec"]["volumeClaimTemplates"], "JetStream file store on a volume"
    # a 3-node cluster, and the gateways keep stored responses in 3 copies for an hour
    assert nats["spec"]["replicas"] == 3 and '"cluster"' in config_map["data"]["nats.conf"]
    gateway = flotilla_workloads(docs)["gateway"]
    assert env(gateway)["FLOTILLA_RESPONSE_RETENTION_S"] == {"value": "3600"}
    assert env(gateway)["FLOTILLA_RESPONSE_STORE_REPLICAS"] == {"value": "3"}


def test_defaults_namespace_replica_ids_cpu_and_security(rendered):
    workloads = flotilla_workloads(rendered["defaults"])
    for name, workload in workloads.items():
        assert env(workload)["FLOTILLA_NAMESPACE"] == {"value": "demo"}, name
        assert env(workload)["FLOTILLA_MODEL"] == {"value": "smollm2"}
        assert "FLOTILLA_API_KEY" not in env(workload)
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert container(workload)["securityContext"]["readOnlyRootFilesystem"] is True
        assert "nvidia.com/gpu" not in str(workload)
    for name in ("scheduler", "worker"):
        assert env(workloads[name])["FLOTILLA_REPLICA_ID"] == {"valueFrom": {"fieldRef": {
            "fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}}
        assert workloads[name]["spec"]["replicas"] == 1
    assert env(workloads["worker"])["FLOTILLA_DEVICE"] == {"value": "cpu"}
    assert env(workloads["worker"])["FLOTILLA_TENSOR_PARALLEL_SIZE"] == {"value": "1"}
    assert not of_kind(rendered["defaults"], "Secret")
    assert {d["metadata"]["name"] for d in of_kind(rendered["defaults"], "PodDisruptionBudget")} >= {
        f"demo-flotilla-{name}" for name in SERVICES}


# ------------------------------------------------------------------ GPU
def test_gpu_worker_with_two_replicas(rendered):
    workloads = flotilla_workloads(rendered["gpu-worker-2-replicas"])
    worker = workloads["worker"]
    assert worker["spec"]["replicas"] == 2
    assert workloads["scheduler"]["spec"]["replicas"] == 2, "one scheduler per worker"
    assert container(worker)["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container(worker)["image"] == "flotilla:0.1.0-cuda"
    assert env(worker)["FLOTILLA_DEVICE"] == {"value": "cuda"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in \
        worker["spec"]["template"]["spec"]["tolerations"]
    for name in ("gateway", "tokenizer", "scheduler"):
        assert "nvidia.com/gpu" not in str(workloads[name]), name
        assert container(workloads[name])["image"] == "flotilla:0.1.0"


def test_tensor_parallel_worker_requests_a_gpu_per_rank(rendered):
    workloads = flotilla_workloads(rendered["tensor-parallel"])
    worker = workloads["worker"]
    assert env(worker)["FLOTILLA_TENSOR_PARALLEL_SIZE"] == {"value": "4"}
    assert container(worker)["resources"]["limits"]["nvidia.com/gpu"] == 4, "max(gpus, size)"
    assert worker["spec"]["replicas"] == 2 and workloads["scheduler"]["spec"]["replicas"] == 2
    for name in ("gateway", "tokenizer", "scheduler", "kvstore"):
        assert "FLOTILLA_TENSOR_PARALLEL_SIZE" not in env(workloads[name]), name
    more_gpus = flotilla_workloads(helm_template({"worker": {"gpus": 8, "tensorParallelSize": 2}}))
    assert container(more_gpus["worker"])["resources"]["limits"]["nvidia.com/gpu"] == 8
    cpu = flotilla_workloads(helm_template({"worker": {"tensorParallelSize": 2}}))["worker"]
    assert env(cpu)["FLOTILLA_TENSOR_PARALLEL_SIZE"] == {"value": "2"}  # processes on CPU
    assert env(cpu)["FLOTILLA_DEVICE"] == {"value": "cpu"} and "nvidia.com/gpu" not in str(cpu)


# ------------------------------------------------------------------ NATS
def test_external_nats_replaces_the_bundled_one(rendered):
    docs = rendered["external-nats"]
    assert not [d for d in docs if d["metadata"].get("labels", {}).get("app.kubernetes.io/name") == "nats"]
    for name, workload in flotilla_workloads(docs).items():
        assert env(workload)["FLOTILLA_NATS_URL"] == {"value": EXTERNAL_NATS}, name


def test_each_release_gets_its_own_subject_namespace_on_a_shared_nats():
    values = VALUE_SETS["external-nats"]
    alpha, beta = helm_template(values, release="alpha"), helm_template(values, release="beta")
    for release, docs in (("alpha", alpha), ("beta", beta)):
        for name, workload in flotilla_workloads(docs).items():
            assert env(workload)["FLOTILLA_NAMESPACE"] == {"value": release}, (release, name)
            assert env(workload)["FLOTILLA_NATS_URL"] == {"value": EXTERNAL_NATS}
    names = lambda docs: {(d["kind"], d["metadata"]["name"]) for d in docs}  # noqa: E731
    assert not names(alpha) & names(beta), "two releases in one namespace must not collide"
    custom = flotilla_workloads(helm_template({**values, "subjectNamespace": "team-a"}, release="alpha"))
    assert {env(w)["FLOTILLA_NAMESPACE"]["value"] for w in custom.values()} == {"team-a"}


# ------------------------------------------------------------------ API key
def test_api_key_comes_from_a_secret(rendered):
    docs = rendered["api-key"]
    (secret,) = of_kind(docs, "Secret")
    assert secret["metadata"]["name"] == "demo-flotilla-api-key"
    assert base64.b64decode(secret["data"]["api-key"]).decode() == API_KEY
    workloads = flotilla_workloads(docs)
    assert env(workloads["gateway"])["FLOTILLA_API_KEY"] == {"valueFrom": {"secretKeyRef": {
        "name": "demo-flotilla-api-key", "key": "api-key"}}}
    for name in ("tokenizer", "scheduler", "worker"):
        assert "FLOTILLA_API_KEY" not in env(workloads[name])
    assert API_KEY not in str([d for d in docs if d["kind"] != "Secret"]), "the key only in the Secret"
    annotations = workloads["gateway"]["spec"]["template"]["metadata"]["annotations"]
    assert "checksum/api-key" in annotations, "a new key rolls the gateways"


def test_api_key_from_an_existing_secret(rendered):
    docs = rendered["all-options"]
    assert not of_kind(docs, "Secret")
    assert env(flotilla_workloads(docs)["gateway"])["FLOTILLA_API_KEY"] == {"valueFrom": {
        "secretKeyRef": {"name": "inference-keys", "key": "token"}}}


# ------------------------------------------------------------------ the other options
def test_model_volume_cache_autoscaling_monitoring_and_overrides(rendered):
    docs = rendered["all-options"]
    workloads = flotilla_workloads(docs)
    for name in ("tokenizer", "worker"):
        pod = workloads[name]["spec"]["template"]["spec"]
        mounts = {m["name"]: m for m in container(workloads[name])["volumeMounts"]}
        assert mounts["models"] == {"name": "models", "mountPath": "/models", "readOnly": True}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "models"
        assert volumes["cache"]["persistentVolumeClaim"]["claimName"] == "flotilla-cache"
        assert env(workloads[name])["FLOTILLA_MODEL"] == {"value": "/models/Llama-3.1-8B-Instruct"}
    for name in ("gateway", "scheduler"):
        assert "models" not in str(container(workloads[name]).get("volumeMounts"))
    hpas = {d["spec"]["scaleTargetRef"]["name"]: d for d in of_kind(docs, "HorizontalPodAutoscaler")}
    assert set(hpas) == {"demo-flotilla-gateway", "demo-flotilla-tokenizer"}
    assert hpas["demo-flotilla-gateway"]["spec"]["maxReplicas"] == 8
    for name in ("gateway", "tokenizer"):
        assert "replicas" not in workloads[name]["spec"], "the HPA owns the replica count"
    (monitor,) = of_kind(docs, "ServiceMonitor")
    assert monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    (service,) = [d for d in of_kind(docs, "Service") if d["metadata"]["name"] == "demo-flotilla-gateway"]
    assert service["spec"]["type"] == "LoadBalancer" and service["spec"]["ports"][0]["port"] == 80
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (pod_monitor,) = of_kind(docs, "PodMonitor")  # the kvstore's tiers, on each node's pod
    (kvstore,) = [d for d in of_kind(docs, "DaemonSet") if d["metadata"]["name"] == "demo-flotilla-kvstore"]
    assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= \
        kvstore["spec"]["template"]["metadata"]["labels"].items()
    assert pod_monitor["spec"]["podMetricsEndpoints"][0]["port"] in [
        port["name"] for port in container(kvstore)["ports"]]
    worker = workloads["worker"]
    assert worker["spec"]["replicas"] == 3 and workloads["scheduler"]["spec"]["replicas"] == 3
    assert container(worker)["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert worker["spec"]["template"]["spec"]["nodeSelector"] == {"gpu": "h100"}
    assert env(worker)["FLOTILLA_KV_CACHE_MEMORY"] == {"value": "40GiB"}
    assert env(worker)["FLOTILLA_LOG_LEVEL"] == {"value": "debug"}, "service env wins"
    assert env(workloads["gateway"])["FLOTILLA_LOG_LEVEL"] == {"value": "info"}
    assert container(worker)["args"] == ["--dtype", "bfloat16"]
    assert {env(w)["FLOTILLA_NAMESPACE"]["value"] for w in workloads.values()} == {"team-a"}
    for workload in workloads.values():
        assert workload["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "registry"}]


def test_dashboards_and_alert_rules_ship_when_asked(rendered):
    """The generated files (deploy/) in a ConfigMap for Grafana's sidecar and a
    PrometheusRule, each only when its flag is on."""
    def dashboards(docs):
        return [d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-dashboards")]

    assert not dashboards(rendered["defaults"]) and not of_kind(rendered["defaults"], "PrometheusRule")
    (config_map,) = dashboards(rendered["all-options"])
    assert config_map["metadata"]["name"] == "demo-flotilla-dashboards"
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "LLM serving"}
    shipped = {name: json.loads(text) for name, text in config_map["data"].items()}
    assert shipped == {f"flotilla-{name}.json": make() for name, make in DASHBOARDS.items()}
    (rules,) = of_kind(rendered["all-options"], "PrometheusRule")
    assert rules["metadata"]["labels"]["release"] == "prometheus"
    assert rules["spec"] == rule_groups()
    alerts = {rule["alert"]: rule for rule in rules["spec"]["groups"][0]["rules"]}
    assert alerts["FlotillaVeryHighTimeToFirstToken"]["expr"].endswith("> 30")
    assert alerts["FlotillaKVCacheNearlyFull"]["for"] == "10m"


def test_disabled_services_are_not_rendered():
    workloads = flotilla_workloads(helm_template({"gateway": {"enabled": False}}))
    assert set(workloads) == {"tokenizer", "scheduler", "worker", "kvstore"}


# ------------------------------------------------------------------ failures
@pytest.mark.parametrize("values, message", [
    ({"model": {"name": ""}}, "flotilla: set model.name"),
    ({"model": {"name": None}}, "flotilla: set model.name"),
    ({"nats": {"enabled": False}}, "set externalNats.url"),
    ({"scheduler": {"replicas": 3}}, "scheduler.replicas (3) must equal worker.replicas (1)"),
    ({"model": {"name": "/models/llama"}}, "model.volume is empty"),
    ({"worker": {"replica": 2}}, "additional properties 'replica' not allowed"),  # schema
    ({"subjectNamespace": "a.b"}, "/subjectNamespace"),
    ({"externalNats": {"url": "http://nats:4222"}}, "/externalNats/url"),
    ({"worker": {"gpus": -1}}, "/worker/gpus"),
    ({"worker": {"tensorParallelSize": 0}}, "/worker/tensorParallelSize"),
])
def test_bad_values_fail_with_a_clear_message(values, message):
    with pytest.raises(helm_error()) as failure:
        helm_template_text(values)
    assert message in str(failure.value)


def test_render_command_for_developers_without_the_helm_cli(capsys, tmp_path):
    from tests.deploy.render import main

    values = tmp_path / "values.yaml"
    values.write_text("worker:\n  replicas: 2\n")
    assert main(["-f", str(values), "--set", "worker.gpus=1", "--release", "r1"]) == 0
    manifests = capsys.readouterr().out
    assert "nvidia.com/gpu: 1" in manifests and "name: r1-flotilla-worker" in manifests
    assert main(["--set", "model.name="]) == 1
    assert "flotilla: set model.name" in capsys.readouterr().err
    assert main(["--lint"]) == 0


# ------------------------------------------------------------------ kvstore
def test_kvstore_runs_on_every_node_and_shares_its_shm_with_the_workers(rendered):
    workloads = flotilla_workloads(rendered["defaults"])
    kvstore, worker = workloads["kvstore"], workloads["worker"]
    assert kvstore["kind"] == "DaemonSet" and "replicas" not in kvstore["spec"]
    node_name = {"valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
    assert env(kvstore)["FLOTILLA_NODE_ID"] == node_name
    assert env(worker)["FLOTILLA_KV_NODE_ID"] == env(workloads["scheduler"])["FLOTILLA_KV_NODE_ID"] == node_name
    assert env(kvstore)["FLOTILLA_KV_SHM_DIR"] == {"value": "/kv-shm"}
    assert env(kvstore)["FLOTILLA_KV_HOST_MEMORY"] == {"value": "4GiB"}
    assert env(kvstore)["FLOTILLA_KV_DISK_DIR"] == {"value": ""}  # no disk tier by default
    for workload in (kvstore, worker):
        mounts = {m["name"]: m["mountPath"] for m in container(workload)["volumeMounts"]}
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        assert mounts["kv-shm"] == "/kv-shm"
        assert volumes["kv-shm"]["hostPath"] == {"path": "/dev/shm", "type": "Directory"}
    for name in ("gateway", "tokenizer", "scheduler"):
        assert "kv-shm" not in str(workloads[name]["spec"]["template"]["spec"]["volumes"])
    assert probe_command(container(kvstore)["readinessProbe"]) == HEALTHCHECK + ["kvstore"]
    assert container(kvstore)["ports"] == [{"name": "metrics", "containerPort": 9464,
                                            "protocol": "TCP"}]


def test_kvstore_disk_tier_and_off():
    on = flotilla_workloads(helm_template({"kvstore": {"hostMemory": "32GiB", "disk": {
        "enabled": True, "size": "500GiB",
        "volume": {"hostPath": {"path": "/mnt/nvme/kv", "type": "Directory"}}}}}))["kvstore"]
    assert env(on)["FLOTILLA_KV_DISK_DIR"] == {"value": "/kv-disk"}
    assert env(on)["FLOTILLA_KV_DISK_SIZE"] == {"value": "500GiB"}
    assert env(on)["FLOTILLA_KV_HOST_MEMORY"] == {"value": "32GiB"}
    volumes = {v["name"]: v for v in on["spec"]["template"]["spec"]["volumes"]}
    assert volumes["kv-disk"]["hostPath"]["path"] == "/mnt/nvme/kv"
    off = flotilla_workloads(helm_template({"kvstore": {"enabled": False}}))
    assert "kvstore" not in off
    assert "FLOTILLA_KV_NODE_ID" not in env(off["worker"])
    assert "kv-shm" not in str(off["worker"])
