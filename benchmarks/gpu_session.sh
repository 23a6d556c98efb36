#!/usr/bin/env bash
# A GPU session's checks in one device call (the device notes: one short prepared script per call).
#
# Here, on the development machine, once per session (needs the package registry):
#     bash benchmarks/gpu_session.sh prepare
#   unpacks bitsandbytes (the NF4 baseline; the GPU image lacks it) into .gpu_site/, ignored by git,
#   keeping only its CPU and CUDA 13 libraries (about 4 MB instead of a 43 MB wheel).
# Then through the device tool, one call per kernel configuration:
#     run(command="bash benchmarks/gpu_session.sh verified", carry=[".gpu_site"], timeout_s=570)
#     run(command="bash benchmarks/gpu_session.sh unverified", carry=[".gpu_site"], timeout_s=570)
#   kernel correctness and the kernel benchmark, then the step benchmark (gpu_check.py), its log and the
#   JSON/PNG results under $OUT/<mode>/. `verified` is the default GPU configuration (kernels/configs.py
#   VERIFIED); `unverified` sets CLOVER_KERNELS_UNVERIFIED=1, every change not yet run on a GPU (MMA-order
#   weights with swapped operands, the in-kernel split-K sum). A change both runs pass and that times faster
#   is promoted with one edit of configs.VERIFIED and a RESULTS.md line. Further arguments go to
#   gpu_check.py (e.g. --no-bench, --checks attention).
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = prepare ]; then
    # Kept out of git (and so carried only when named) without touching .gitignore; a fresh clone may lack info/.
    ex=$(git rev-parse --git-path info/exclude) && mkdir -p "$(dirname "$ex")" &&
        { grep -qx '/.gpu_site/' "$ex" 2>/dev/null || echo '/.gpu_site/' >> "$ex"; }
    bnb=$(grep -E '^bitsandbytes==' constraints.txt || echo bitsandbytes)
    tmp=$(mktemp -d)
    # The GPU image runs CPython 3.12 on x86-64; bitsandbytes' wheel is pure Python plus prebuilt libraries.
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
        -d "$tmp" "$bnb" || exit 1
    rm -rf .gpu_site && mkdir -p .gpu_site
    python3 -m zipfile -e "$tmp"/bitsandbytes-*.whl .gpu_site || exit 1
    find .gpu_site/bitsandbytes -name 'libbitsandbytes_*.so' ! -name '*_cpu.so' ! -name '*_cuda13*.so' -delete
    rm -rf "$tmp"
    du -sh .gpu_site
    exit 0
fi

mode=verified
case "${1:-}" in
    verified) shift ;;
    unverified) mode=unverified; shift; export CLOVER_KERNELS_UNVERIFIED=1 ;;
esac
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
[ -d .gpu_site ] && export PYTHONPATH="$PYTHONPATH:$PWD/.gpu_site"
export PYTHONUNBUFFERED=1
out="${OUT:-benchmarks/out}/$mode"
mkdir -p "$out" benchmarks/out
{
    date -u
    echo "kernels: $mode (CLOVER_KERNELS_UNVERIFIED=${CLOVER_KERNELS_UNVERIFIED:-0})"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem --format=csv
    # One interpreter for both (each start imports torch: seconds of device time).
    python3 -c "
import torch, triton
print('torch', torch.__version__, 'triton', triton.__version__)
try:
    import bitsandbytes
    print('bitsandbytes', bitsandbytes.__version__)
except Exception as e:
    print('bitsandbytes not importable:', type(e).__name__, e)" 2>&1
} 2>&1 | tee "$out/machine.txt"
timeout 550 python3 benchmarks/gpu_check.py --time-limit 530 "$@" 2>&1 | tee "$out/gpu_check.log"
rc=${PIPESTATUS[0]}
[ "$out" != benchmarks/out/$mode ] && cp benchmarks/out/kernels.json benchmarks/out/kernels.png benchmarks/out/step.json \
    benchmarks/out/step.profile.json \
    "$out"/ 2>/dev/null
exit "$rc"
