"""A real Prometheus server for tests: Debian's ``prometheus`` package, fetched once with
``apt-get download`` and unpacked with ``dpkg -x`` into ~/.cache/flotilla/prometheus/
(the first run needs apt's package lists; later runs read the cache), then started on a
free port with a config the test writes."""

from __future__ import annotations

import glob
import json
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

from cli.stack import free_port

CACHE = Path("~/.cache/flotilla/prometheus").expanduser()


def prometheus_binaries() -> tuple[Path, Path]:
    """(prometheus, promtool), unpacked from Debian's package on first use."""
    binary, promtool = CACHE / "usr/bin/prometheus", CACHE / "usr/bin/promtool"
    if not binary.exists():
        if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
            raise RuntimeError("the live Prometheus test needs Debian's prometheus package: "
                               "apt-get and dpkg fetch it into " + str(CACHE))
        with tempfile.TemporaryDirectory() as download:
            subprocess.run(["apt-get", "download", "prometheus"], cwd=download, check=True,
                           capture_output=True)
            (deb,) = glob.glob(f"{download}/prometheus_*.deb")
            unpacked = Path(tempfile.mkdtemp(prefix="prometheus-", dir=CACHE.parent))
            subprocess.run(["dpkg", "-x", deb, str(unpacked)], check=True)
            try:  # whole or not at all: a half-unpacked cache never stays
                unpacked.rename(CACHE)
            except OSError:  # another test process got there first
                shutil.rmtree(unpacked)
    return binary, promtool


class Prometheus:
    """A Prometheus scraping ``targets`` every second, evaluating ``rule_files``."""

    def __init__(self, work_dir: Path, targets: list[str], rule_files: list[Path]) -> None:
        CACHE.parent.mkdir(parents=True, exist_ok=True)
        self.binary, self.promtool = prometheus_binaries()
        self.port = free_port()
        self.work_dir = work_dir
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "rule_files": [str(path) for path in rule_files],
                  "scrape_configs": [{"job_name": "flotilla", "static_configs": [
                      {"targets": targets}]}]}
        self.config_file = work_dir / "prometheus.yml"
        self.config_file.write_text(yaml.safe_dump(config))
        self.log = work_dir / "prometheus.log"
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> None:
        with open(self.log, "a") as log:
            self.process = subprocess.Popen(
                [str(self.binary), f"--config.file={self.config_file}",
                 f"--storage.tsdb.path={self.work_dir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=1):
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("Prometheus was not ready: " + self.log.read_text()[-3000:])

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def api(self, path: str, **params) -> dict | list:
        """GET /api/v1/<path>: its ``data``; raises on an error reply (a bad query)."""
        query = "?" + urllib.parse.urlencode(params) if params else ""
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=10) as reply:
                body = json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{path} {params}: {exc.read().decode()}") from None
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """An instant query's series (a vector's samples)."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data["resultType"])
        return data["result"]
