"""What the Helm chart ships for operators, generated from code: Grafana dashboards
(dashboards.py) and Prometheus alert rules (alerts.py). ``python -m deploy`` writes them
into helm/flotilla/; tests/deploy/test_observability.py checks the checked-in files are
its output, and tests/integration/test_prometheus_live.py evaluates every query on a live
stack. A dev tool beside the chart, not part of the installed package."""
