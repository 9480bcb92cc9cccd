"""The few Grafana JSON shapes the dashboards use (schemaVersion 39): a time-series panel
of PromQL targets, a row, and a dashboard with a Prometheus data source variable and a
``model_name`` variable. Plain dicts: five shapes do not need a dashboard SDK."""

from __future__ import annotations

from dataclasses import dataclass, field

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
WIDTH = 24  # Grafana's grid columns
PANEL_HEIGHT = 8
# every query filters on the variable; the live test substitutes ".*"
MODEL = 'model_name=~"$model_name"'
RATE = "$__rate_interval"


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    targets: list[tuple[str, str]]  # (PromQL, legend)
    unit: str = "short"
    width: int = 12
    stack: bool = False
    max_value: float | None = None


@dataclass(frozen=True)
class Row:
    title: str
    panels: list[Panel] = field(default_factory=list)


def _panel(panel: Panel, panel_id: int, x: int, y: int) -> dict:
    defaults: dict = {"unit": panel.unit, "custom": {
        "drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never",
        "stacking": {"mode": "normal" if panel.stack else "none", "group": "A"}}}
    if panel.max_value is not None:
        defaults |= {"min": 0, "max": panel.max_value}
    return {
        "id": panel_id, "type": "timeseries", "title": panel.title,
        "description": panel.description, "datasource": DATASOURCE,
        "gridPos": {"h": PANEL_HEIGHT, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
        "targets": [{"datasource": DATASOURCE, "expr": expr, "legendFormat": legend,
                     "range": True, "refId": chr(ord("A") + index)}
                    for index, (expr, legend) in enumerate(panel.targets)],
    }


def _layout(rows: list[Row]) -> list[dict]:
    """Rows one under another; each row's panels left to right, wrapping at the grid's width."""
    panels, y, panel_id = [], 0, 1
    for row in rows:
        panels.append({"id": panel_id, "type": "row", "title": row.title, "collapsed": False,
                       "gridPos": {"h": 1, "w": WIDTH, "x": 0, "y": y}, "panels": []})
        panel_id, y, x = panel_id + 1, y + 1, 0
        for panel in row.panels:
            if x + panel.width > WIDTH:
                x, y = 0, y + PANEL_HEIGHT
            panels.append(_panel(panel, panel_id, x, y))
            panel_id, x = panel_id + 1, x + panel.width
        y += PANEL_HEIGHT
    return panels


def dashboard(uid: str, title: str, description: str, rows: list[Row]) -> dict:
    model_query = "label_values(vllm:num_requests_running, model_name)"
    return {
        "uid": uid, "title": title, "description": description, "tags": ["flotilla"],
        "editable": True, "graphTooltip": 1, "refresh": "30s", "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"}, "timezone": "browser", "version": 1,
        "annotations": {"list": []}, "links": [],
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource",
             "query": "prometheus", "current": {}, "hide": 0, "refresh": 1},
            {"name": "model_name", "label": "Model", "type": "query", "datasource": DATASOURCE,
             "query": {"query": model_query, "refId": "model_name"}, "definition": model_query,
             "includeAll": True, "multi": True, "allValue": ".*", "current": {},
             "refresh": 2, "sort": 1, "hide": 0},
        ]},
        "panels": _layout(rows),
    }


def queries(board: dict) -> list[str]:
    """Every PromQL expression of a dashboard's panels (what the live test evaluates)."""
    return [target["expr"] for panel in board["panels"] for target in panel.get("targets", [])]
