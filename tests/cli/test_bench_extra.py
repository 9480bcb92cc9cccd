"""Serving installs no bench extra: ``flotilla`` still starts, and ``flotilla bench`` says
what to install instead of a traceback."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Run the CLI with the bench extra's libraries made unimportable (None in sys.modules).
WITHOUT_BENCH_EXTRA = """
import sys
for name in ("httpx", "tqdm", "matplotlib"):
    sys.modules[name] = None
from cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_BENCH_EXTRA, *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_serve_parses_without_the_bench_extra():
    result = run_cli("serve", "--help")
    assert result.returncode == 0, result.stderr
    assert "--model" in result.stdout


def test_bench_without_the_extra_says_what_to_install():
    result = run_cli("bench", "serve", "--num-prompts", "3")
    assert result.returncode == 1
    assert "httpx is missing" in result.stderr
    assert "pip install -e '.[bench]'" in result.stderr
    assert "Traceback" not in result.stderr
