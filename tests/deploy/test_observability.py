"""The chart's dashboards and alert rules are what deploy/ makes (``python -m deploy``),
and well formed: unique panel ids and refIds, every panel with a query, every alert with
a severity and a comparison the live test can take off."""

from __future__ import annotations

import json
import re

from deploy.__main__ import DASHBOARD_DIR, RULES_FILE, generated, main
from deploy.alerts import ALERTS
from deploy.dashboards import DASHBOARDS


def test_checked_in_files_are_the_generators_output():
    stale = [str(path) for path, text in generated().items()
             if not path.exists() or path.read_text() != text]
    assert not stale, f"run `python -m deploy` and commit: {stale}"
    assert sorted(DASHBOARD_DIR.glob("*.json")) == sorted(
        path for path in generated() if path.suffix == ".json"), "a stale dashboard file"


def test_check_mode_notices_a_stale_file(tmp_path, monkeypatch, capsys):
    import deploy.__main__ as generator

    stale = tmp_path / "flotilla-rules.yaml"
    stale.write_text("groups: []\n")
    monkeypatch.setattr(generator, "generated", lambda: {stale: RULES_FILE.read_text()})
    monkeypatch.setattr(generator, "CHART", tmp_path / "a" / "b")
    assert main(["--check"]) == 1 and stale.read_text() == "groups: []\n"
    assert main([]) == 0 and stale.read_text() == RULES_FILE.read_text()
    assert "stale" in capsys.readouterr().out


def test_dashboards_are_well_formed():
    uids = set()
    for name, make in DASHBOARDS.items():
        board = make()
        uids.add(board["uid"])
        assert json.loads(json.dumps(board)) == board
        ids = [panel["id"] for panel in board["panels"]]
        assert len(ids) == len(set(ids)), name
        for panel in board["panels"]:
            if panel["type"] == "row":
                continue
            ref_ids = [target["refId"] for target in panel["targets"]]
            assert ref_ids and len(ref_ids) == len(set(ref_ids)), (name, panel["title"])
            assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
    assert len(uids) == len(DASHBOARDS)


def test_every_alert_has_a_severity_and_a_comparison_to_strip():
    for alert in ALERTS:
        rule = alert.rule()
        assert rule["labels"]["severity"] in ("info", "warning", "critical")
        assert re.fullmatch(r"[<>]=? [0-9.]+", alert.comparison), alert.name
        assert rule["expr"].endswith(alert.comparison)
