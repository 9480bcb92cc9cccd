#!/usr/bin/env bash
# vLLM 0.26.0 peer kit installer -- runs on the offline GPU machine (build the kit with build_kit.sh).
#
#   bash install.sh [DIR]      DIR = folder holding vkit.tar.part-* (default: this script's folder)
#   eval "$(bash install.sh)"  same, and sets PYTHONPATH in the calling shell
#
# Result:  /tmp/vsite/site               put on PYTHONPATH (vllm + extra wheels)
#          /tmp/vsite/bin/vllm           `vllm` CLI (e.g. vllm bench throughput ...)
#          /tmp/vsite/bin/vkit_bench.py  fallback: runs vllm.benchmarks.{throughput,latency}
#                                        without the CLI's serve/openai imports
#          /tmp/vsite/env.sh             PYTHONPATH, PATH and offline env vars
#          /tmp/vkit_check_imports.py
# Only the `export PYTHONPATH=...` line goes to stdout; progress goes to stderr.
# Idempotent: a second run with the same parts only re-checks (stamp file in the site dir).
# Env overrides (for testing): VKIT_PYTHON (python3), VKIT_DEST (/tmp/vsite),
#                              VKIT_CHECK_DST (/tmp/vkit_check_imports.py)
set -euo pipefail

KIT_ID=c15fac0a9c7369d8
NPARTS=2
HERE="$(cd "${1:-$(dirname "${BASH_SOURCE[0]}")}" && pwd)"
# A kit built by build_kit.sh names its parts in SHA256SUMS: its id and part count come from there.
if [ -f "$HERE/SHA256SUMS" ] && command -v sha256sum >/dev/null 2>&1; then
  KIT_ID=$(sha256sum "$HERE/SHA256SUMS" | cut -c1-16)
  NPARTS=$(grep -c 'vkit.tar.part-' "$HERE/SHA256SUMS")
fi
DEST="${VKIT_DEST:-/tmp/vsite}"
SITE="$DEST/site"
PY="${VKIT_PYTHON:-python3}"
CHECK_DST="${VKIT_CHECK_DST:-/tmp/vkit_check_imports.py}"
STAMP="$SITE/.vkit-installed"

log() { echo "[vkit] $*" >&2; }

pip_target() {  # pip_target WHEEL...
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --disable-pip-version-check --target "$SITE" "$@" >&2 && return 0
  # Fallback without pip: a wheel is a zip laid out for site-packages.
  log "pip failed; unpacking the wheels directly"
  "$PY" - "$SITE" "$@" >&2 <<'PYEOF'
import os, sys, zipfile
site = sys.argv[1]
for w in sys.argv[2:]:
    with zipfile.ZipFile(w) as z:
        for n in z.namelist():
            parts = n.split("/")
            if parts[0].endswith(".data"):
                if len(parts) > 2 and parts[1] in ("purelib", "platlib") and not n.endswith("/"):
                    dst = os.path.join(site, *parts[2:])
                    os.makedirs(os.path.dirname(dst), exist_ok=True)
                    with z.open(n) as src, open(dst, "wb") as out:
                        out.write(src.read())
                continue
            z.extract(n, site)
print("unpacked", len(sys.argv) - 2, "wheels")
PYEOF
}

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$KIT_ID" ] && [ -f "$SITE/vllm/__init__.py" ]; then
  log "already installed (kit $KIT_ID) in $SITE"
else
  t0=$(date +%s)
  shopt -s nullglob
  parts=( "$HERE"/vkit.tar.part-* )
  shopt -u nullglob
  if [ "${#parts[@]}" -ne "$NPARTS" ]; then
    log "ERROR: expected $NPARTS files $HERE/vkit.tar.part-*, found ${#parts[@]}"; exit 1
  fi
  if [ -f "$HERE/SHA256SUMS" ] && command -v sha256sum >/dev/null 2>&1; then
    if ! (cd "$HERE" && sha256sum -c --quiet SHA256SUMS >&2); then
      log "ERROR: checksum mismatch in $HERE (a part is truncated or corrupt)"; exit 1
    fi
  fi

  rm -rf "$DEST"
  mkdir -p "$DEST"
  log "extracting ${#parts[@]} parts to $DEST"
  if command -v xz >/dev/null 2>&1 && command -v tar >/dev/null 2>&1; then
    cat "${parts[@]}" | xz -dc | tar -xf - -C "$DEST"
  else
    cat "${parts[@]}" | "$PY" -c '
import sys, tarfile
kw = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}
with tarfile.open(fileobj=sys.stdin.buffer, mode="r|xz") as t:
    t.extractall(sys.argv[1], **kw)
' "$DEST"
  fi

  log "installing $(ls "$DEST"/wheels/*.whl | wc -l) wheels into $SITE"
  mkdir -p "$SITE"
  pip_target "$DEST"/wheels/*.whl

  # Device packages that the shipped wheels need at a minimum version: if the
  # device copy is older, install the shipped fallback wheel (it shadows the
  # device copy via PYTHONPATH); otherwise leave the device copy alone.
  fallback=$("$PY" - "$DEST/wheels_fallback" <<'PYEOF'
import glob, os, sys
from importlib.metadata import version, PackageNotFoundError
try:
    from packaging.version import Version
except Exception:  # packaging is on the device list, but be safe
    Version = lambda s: tuple(int(x) if x.isdigit() else 0 for x in s.split(".")[:3])
need = {"typing_extensions": ("typing-extensions", "4.15.0"), "anyio": ("anyio", "4.0.0")}
for stem, (dist, minimum) in need.items():
    try:
        have = version(dist)
        ok = Version(have) >= Version(minimum)
    except PackageNotFoundError:
        have, ok = "missing", False
    if not ok:
        for w in glob.glob(os.path.join(sys.argv[1], stem + "-*.whl")):
            print(w)
        print(f"device {dist} {have} < {minimum}: using shipped fallback", file=sys.stderr)
PYEOF
)
  if [ -n "$fallback" ]; then
    # shellcheck disable=SC2086
    pip_target $fallback
  fi

  mv "$DEST/vllm_pkg/vllm" "$DEST/vllm_pkg/vllm-0.26.0.dist-info" "$SITE/"
  rmdir "$DEST/vllm_pkg"

  mkdir -p "$DEST/bin"
  cat > "$DEST/bin/vllm" <<EOF
#!/usr/bin/env bash
# 'vllm' console script for the peer kit (vllm lives on PYTHONPATH, not pip-installed)
export PYTHONPATH="$SITE\${PYTHONPATH:+:\$PYTHONPATH}"
exec "\${VKIT_PYTHON:-python3}" -c 'import sys
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
sys.exit(main())' "\$@"
EOF
  cat > "$DEST/bin/vkit_bench.py" <<'EOF'
#!/usr/bin/env python3
"""Fallback for `vllm bench throughput|latency ARGS`: python3 vkit_bench.py throughput ARGS.
Imports only vllm.benchmarks.<kind> (not the CLI's serve/openai modules)."""
import importlib
import os
import sys


def main():
    if len(sys.argv) < 2 or sys.argv[1] not in ("throughput", "latency"):
        sys.exit("usage: vkit_bench.py {throughput|latency} [vllm bench args]")
    kind = sys.argv[1]
    # as `vllm bench` does (vllm/entrypoints/cli/main.py)
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    from vllm import platforms

    if platforms.current_platform.is_unspecified():
        from vllm.platforms.cpu import CpuPlatform

        platforms.current_platform = CpuPlatform()
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    mod = importlib.import_module(f"vllm.benchmarks.{kind}")
    parser = FlexibleArgumentParser(prog=f"vkit_bench.py {kind}")
    mod.add_cli_args(parser)
    args = parser.parse_args(sys.argv[2:])
    mod.main(args)


if __name__ == "__main__":
    main()
EOF
  chmod +x "$DEST/bin/vllm" "$DEST/bin/vkit_bench.py"
  cat > "$DEST/env.sh" <<EOF
# source $DEST/env.sh  -- environment for the vLLM peer kit (offline machine)
export PYTHONPATH="$SITE\${PYTHONPATH:+:\$PYTHONPATH}"
export PATH="$DEST/bin:\$PATH"
# no network here: keep HF hub / transformers / vLLM usage stats from trying to reach it
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
EOF
  echo "$KIT_ID" > "$STAMP"
  log "installed in $(( $(date +%s) - t0 ))s"
fi

# Optional MoE kernels add-on (only needed for MoE models), if it was transferred too.
if [ -f "$HERE/vkit-moe.tar.xz" ] && [ ! -f "$SITE/vllm/_moe_C_stable_libtorch.abi3.so" ]; then
  log "adding MoE kernels from $HERE/vkit-moe.tar.xz"
  "$PY" -c '
import sys, tarfile
kw = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}
with tarfile.open(sys.argv[1], "r:xz") as t:
    t.extractall(sys.argv[2], **kw)
' "$HERE/vkit-moe.tar.xz" "$SITE/vllm"  # (the archive holds the .so alone: vllm/'s file)
fi

if [ -f "$HERE/check_imports.py" ]; then
  cp -f "$HERE/check_imports.py" "$CHECK_DST"
else
  cp -f "$DEST/check_imports.py" "$CHECK_DST"
fi

log "ready: vllm $(sed -n 's/^Version: //p' "$SITE/vllm-0.26.0.dist-info/METADATA") in $SITE"
log "  source $DEST/env.sh      # PYTHONPATH + PATH (vllm CLI) + HF_HUB_OFFLINE etc."
log "  python3 $CHECK_DST [--smoke]"
echo "export PYTHONPATH=$SITE"
