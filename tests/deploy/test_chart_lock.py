"""The vendored NATS chart: Chart.yaml, Chart.lock and charts/ agree, and Helm's own
dependency check finds the lock in sync (no network: it stops before any download)."""

from __future__ import annotations

import shutil
import tarfile

import pytest
import yaml

from tests.deploy.tools import CHART


def chart_yaml() -> dict:
    return yaml.safe_load((CHART / "Chart.yaml").read_text())


def test_lock_and_vendored_archive_match_the_dependencies():
    declared = {d["name"]: d for d in chart_yaml()["dependencies"]}
    locked = {d["name"]: d for d in yaml.safe_load((CHART / "Chart.lock").read_text())["dependencies"]}
    assert set(declared) == set(locked) == {"nats"}
    for name, dep in declared.items():
        assert locked[name]["version"] == dep["version"]
        assert locked[name]["repository"] == dep["repository"]
    archives = sorted(p.name for p in (CHART / "charts").glob("*.tgz"))
    assert archives == [f"nats-{declared['nats']['version']}.tgz"]
    with tarfile.open(CHART / "charts" / archives[0]) as archive:
        meta = yaml.safe_load(archive.extractfile("nats/Chart.yaml").read())
    assert (meta["name"], str(meta["version"])) == ("nats", declared["nats"]["version"])
    assert declared["nats"]["condition"] == "nats.enabled"


def _dependency_build(chart_dir) -> str:
    import helm_python as helm

    with pytest.raises(helm.HelmError) as failure:  # it would download next: no network here
        helm.dependency_build(str(chart_dir))
    return str(failure.value)


def test_helm_finds_chart_lock_in_sync(tmp_path):
    copy = tmp_path / "flotilla"
    shutil.copytree(CHART, copy)
    assert "out of sync" not in _dependency_build(copy)
    # ... and it can tell: a lock whose digest does not match is refused.
    lock = yaml.safe_load((copy / "Chart.lock").read_text())
    lock["digest"] = "sha256:" + "0" * 64
    (copy / "Chart.lock").write_text(yaml.safe_dump(lock))
    assert "out of sync" in _dependency_build(copy)
