"""Chaos tests: real processes killed (kill -9) and restarted under load. They share the
integration tests' fixtures (the default model, its name)."""

from tests.integration.conftest import model_files, model_name  # noqa: F401 - fixtures


def pytest_configure(config):
    config.addinivalue_line("markers", "chaos: kills and restarts processes under load")
