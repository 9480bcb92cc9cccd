"""Every FLOTILLA_* variable the chart and the compose file set is a real setting of that
service and parses: a misspelt or mistyped one would otherwise be ignored, or stop the
service at start."""

from __future__ import annotations

import msgspec
import pytest

from services.gateway.config import GatewayConfig
from services.kvstore.config import KvStoreConfig
from services.scheduler.config import SchedulerConfig
from services.tokenizer.config import TokenizerConfig
from services.worker.config import WorkerConfig
from shared.config import ENV_PREFIX, load_config
from shared.healthcheck import HealthcheckConfig
from tests.deploy.tools import compose_config, env, flotilla_workloads, helm_template

CONFIGS = {"gateway": GatewayConfig, "tokenizer": TokenizerConfig,
           "scheduler": SchedulerConfig, "worker": WorkerConfig, "kvstore": KvStoreConfig}
# What the downward API gives a pod (pod index 0, a CPU request rounded up).
DOWNWARD = {"fieldRef": "0", "resourceFieldRef": "2", "secretKeyRef": "secret-value"}


def resolved(variables: dict[str, dict]) -> dict[str, str]:
    out = {}
    for name, var in variables.items():
        if "value" in var:
            out[name] = var["value"]
        else:
            (source,) = var["valueFrom"]
            out[name] = DOWNWARD[source]
    return out


def check(service: str, environ: dict[str, str]) -> object:
    config_cls = CONFIGS[service]
    fields = {f.name for f in msgspec.structs.fields(config_cls)}
    ours = {name for name in environ if name.startswith(ENV_PREFIX)}
    unknown = {name for name in ours if name.removeprefix(ENV_PREFIX).lower() not in fields}
    assert not unknown, f"{service} has no such settings: {sorted(unknown)}"
    config = load_config(config_cls, [], environ)  # SystemExit on a value it cannot parse
    probe_fields = {f.name for f in msgspec.structs.fields(HealthcheckConfig)}
    probe = load_config(HealthcheckConfig, [], environ)  # the probe reads the same variables
    for name in ("nats_url", "namespace", "replica_id", "port"):
        if name in fields and name in probe_fields:
            assert getattr(probe, name) == getattr(config, name), (service, name)
    return config


@pytest.mark.parametrize("values", [{"apiKey": {"value": "k"}}, {"worker": {"gpus": 1}}])
def test_chart_settings_are_real_and_parse(values):
    for service, workload in flotilla_workloads(helm_template(values)).items():
        config = check(service, resolved(env(workload)))
        if service == "worker":
            assert config.device == ("cuda" if values.get("worker") else "cpu")
            assert config.num_threads == 2 and config.replica_id == "0"
        if service == "gateway":
            assert config.port == 8000
            assert config.api_key == ("secret-value" if "apiKey" in values else "")
        assert config.log_json is True and config.namespace == "demo"


def test_compose_settings_are_real_and_parse():
    for name, service in compose_config("gpu")["services"].items():
        if name == "nats":
            continue
        config = check(name.removesuffix("-gpu"), service["environment"])
        assert config.nats_url == "nats://nats:4222" and config.namespace == "flotilla"
