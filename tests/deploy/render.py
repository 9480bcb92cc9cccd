"""`helm template` and `helm lint` for helm/flotilla without the Helm CLI, through the
Helm engine the tests use (helm-python-sdk, installed by the test extra):

    .venv/bin/python -m tests.deploy.render [--release R] [-n NS] [-f values.yaml] [--set k=v] [--lint]
"""

from __future__ import annotations

import argparse
import json
import sys

import yaml

from tests.deploy.tools import helm_lint, helm_template_text


def merge(base: dict, override: dict) -> dict:
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merge(base[key], value)
        else:
            base[key] = value
    return base


def main(argv: list[str] | None = None) -> int:
    import helm_python as helm

    parser = argparse.ArgumentParser(prog="python -m tests.deploy.render", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--release", default="flotilla")
    parser.add_argument("-n", "--namespace", default="default")
    parser.add_argument("-f", "--values", action="append", default=[], help="values file")
    parser.add_argument("--set", action="append", default=[], help="like helm --set")
    parser.add_argument("--lint", action="store_true", help="lint (strict) instead of rendering")
    args = parser.parse_args(argv)
    values: dict = {}
    for path in args.values:
        merge(values, yaml.safe_load(open(path)) or {})
    for expression in args.set:
        merge(values, helm.parse_set_string(expression))
    try:
        if args.lint:
            report = helm_lint(values)
            print(json.dumps(report, indent=2))
            return 1 if report["errors"] or any(m["severity"] >= 2 for m in report["messages"]) else 0
        print(helm_template_text(values, release=args.release, namespace=args.namespace))
    except helm.HelmError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
