#!/usr/bin/env bash
# Build the vLLM 0.26.0 peer kit from PyPI, on any Linux machine that reaches the registry.
#
#   bash benchmarks/peers/vllm/build_kit.sh [OUT]     OUT defaults to benchmarks/peers/vllm/kit
#
# The GPU machines are offline and run Python 3.12 with torch 2.11 + CUDA 13 preinstalled, which
# is what vllm 0.26.0 pins. The kit is vLLM's wheel slimmed to what a dense bf16 model needs on
# Hopper (FlashAttention-3 kept; FA2, the MoE kernels, DeepGEMM, the SM100 attention sources and the
# vllm-rs binary dropped), plus the wheels the image lacks (requirements-kit.txt), packed with xz
# and split into parts of at most PART_MIB (a device call carries at most 64 MiB).
#
# OUT receives: vkit.tar.part-*, SHA256SUMS, install.sh, check_imports.py, vllm_offline.py,
# README.md and, with VKIT_MOE=1, vkit-moe.tar.xz (the MoE kernels as an add-on).
# Env: VKIT_PIP (python3 -m pip), PART_MIB (47), VKIT_XZ_LEVEL (9), VKIT_MOE (0),
#      VKIT_DOWNLOADS (a folder of already-downloaded wheels to reuse; default: a temp folder).
set -euo pipefail

VLLM_VERSION=0.26.0
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="$(mkdir -p "${1:-$HERE/kit}" && cd "${1:-$HERE/kit}" && pwd)"
PIP="${VKIT_PIP:-python3 -m pip}"
PART_MIB="${PART_MIB:-47}"
WORK="$(mktemp -d /tmp/vkit-build.XXXXXX)"
DL="${VKIT_DOWNLOADS:-$WORK/downloads}"
STAGE="$WORK/stage"
trap 'rm -rf "$WORK"' EXIT

log() { echo "[build_kit] $*" >&2; }

# Wheels for the GPU machines' interpreter, whatever python runs pip here.
TARGET=(--only-binary=:all: --no-deps --python-version 3.12 --implementation cp
        --abi cp312 --abi abi3 --abi none
        --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64
        --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)

download() {  # download DEST PIP-ARGS...
  local dest="$1"; shift
  mkdir -p "$dest"
  # shellcheck disable=SC2086
  $PIP download --disable-pip-version-check -q "${TARGET[@]}" -d "$dest" "$@" >&2
}

log "downloading vllm==$VLLM_VERSION and the extra wheels into $DL"
download "$DL/vllm" "vllm==$VLLM_VERSION"
download "$DL/wheels" -r "$HERE/requirements-kit.txt"
download "$DL/wheels_fallback" -r "$HERE/requirements-fallback.txt"
vllm_wheel=$(ls "$DL"/vllm/vllm-"$VLLM_VERSION"-*.whl)

log "unpacking and slimming $(basename "$vllm_wheel")"
mkdir -p "$STAGE/vllm_pkg" "$STAGE/wheels" "$STAGE/wheels_fallback"
# Wheels are deflated zips, which xz cannot shrink: store them uncompressed (same files, same
# RECORD) so that the one xz pass compresses them with the rest.
restore_wheels() {  # restore_wheels DEST WHEEL...
  python3 - "$@" <<'PYEOF'
import copy, os, sys, zipfile
dest = sys.argv[1]
for src in sys.argv[2:]:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(
            os.path.join(dest, os.path.basename(src)), "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info)
            stored = copy.copy(info)  # zin reads through its own ZipInfo: leave that one as it is
            stored.compress_type = zipfile.ZIP_STORED
            zout.writestr(stored, data)
PYEOF
}
restore_wheels "$STAGE/wheels" "$DL"/wheels/*.whl
restore_wheels "$STAGE/wheels_fallback" "$DL"/wheels_fallback/*.whl
python3 -m zipfile -e "$vllm_wheel" "$STAGE/vllm_pkg"
pkg="$STAGE/vllm_pkg/vllm"
moe_so="_moe_C_stable_libtorch.abi3.so"
if [ "${VKIT_MOE:-0}" = 1 ]; then
  log "packing the MoE kernels as vkit-moe.tar.xz"
  tar -C "$pkg" -cf - "$moe_so" | xz -T0 -6 > "$OUT/vkit-moe.tar.xz"
fi
# Not needed for a dense bf16 model on Hopper: FA2 (FA3 serves sm_90), MoE, DeepGEMM (FP8 MoE),
# the SM100 attention sources, and the Rust frontend binary.
rm -rf "$pkg/vllm_flash_attn/_vllm_fa2_C.abi3.so" "$pkg/$moe_so" "$pkg/vllm-rs" \
       "$pkg/third_party/deep_gemm" "$pkg/third_party/fmha_sm100"
for need in _C_stable_libtorch.abi3.so vllm_flash_attn/_vllm_fa3_C.abi3.so cumem_allocator.abi3.so; do
  [ -f "$pkg/$need" ] || { log "ERROR: $need missing from the wheel"; exit 1; }
done

cp "$HERE/check_imports.py" "$STAGE/"
{
  echo "vLLM $VLLM_VERSION peer kit, built $(date -u +%Y-%m-%dT%H:%M:%SZ) by build_kit.sh"
  echo; echo "wheels:"; (cd "$STAGE/wheels" && ls)
  echo; echo "fallback wheels (only if the device copy is too old):"; (cd "$STAGE/wheels_fallback" && ls)
  echo; echo "compiled vllm pieces:"; (cd "$STAGE" && find vllm_pkg -name '*.so' | sort)
} > "$STAGE/MANIFEST.txt"

log "packing (xz -${VKIT_XZ_LEVEL:-9}: ~15 minutes on a busy 2-core machine)"
rm -f "$OUT"/vkit.tar.part-* "$OUT/SHA256SUMS"
tar -C "$STAGE" -cf - . | xz -T0 -"${VKIT_XZ_LEVEL:-9}" \
  | split -b "${PART_MIB}M" - "$OUT/vkit.tar.part-"
(cd "$OUT" && sha256sum vkit.tar.part-* > SHA256SUMS)
cp "$HERE/install.sh" "$HERE/check_imports.py" "$HERE/vllm_offline.py" "$HERE/README.md" "$OUT/"

log "kit in $OUT:"
(cd "$OUT" && ls -l vkit.tar.part-* && cat SHA256SUMS) >&2
