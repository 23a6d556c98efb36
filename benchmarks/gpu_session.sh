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
#   1. kernel correctness: `pytest --device cuda` over the kernel tests (marker gpu: tests/test_kernels_*.py,
#      tests/test_triton_memcheck.py), compiled on the GPU, $WORKERS processes (default 8; 0: one);
#      at most $TEST_LIMIT seconds (default 300). It fails if no kernel test ran there.
#   2. benchmarks/gpu_check.py: the divergence report, the kernel benchmark, then the step benchmark, in the
#      time left.
#   Logs (machine.txt, pytest.log, gpu_check.log) and the JSON/PNG results land under $OUT/<mode>/.
#   `verified` is the default GPU configuration (kernels/configs.py VERIFIED); `unverified` sets
#   CLOVER_KERNELS_UNVERIFIED=1, every change not yet run on a GPU (MMA-order weights with swapped operands,
#   the in-kernel split-K sum), for the model's kernels: the kernel tests call the kernels with every change
#   on in both modes. A change both runs pass and that times faster is promoted with one edit of
#   configs.VERIFIED and a RESULTS.md line. Further arguments go to pytest (e.g. -k attention, -x);
#   GPU_CHECK_ARGS to gpu_check.py (e.g. "--no-bench"). SESSION_DEVICE=interpret runs the same on a CPU in
#   Triton's interpreter (how tests/test_benchmarks.py checks this script).
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
device=${SESSION_DEVICE:-cuda}
[ "$device" = interpret ] && export TRITON_INTERPRET=1 || export TRITON_INTERPRET=0  # gpu_check.py's kernels
start=$SECONDS
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

# 1. The kernel tests on the device. Processes compile in parallel (a fresh machine has no Triton cache). The
# tuning table's configs as they stand: autotuning would spend minutes of device time checking nothing.
workers=()
if [ "${WORKERS:-8}" != 0 ] && python3 -c "import xdist" 2>/dev/null; then workers=(-n "${WORKERS:-8}"); fi
echo "== kernel tests: pytest --device $device (${workers[*]:-one process}) ==" | tee "$out/pytest.log"
CLOVER_AUTOTUNE=0 timeout "${TEST_LIMIT:-300}" python3 -m pytest --device "$device" -q -ra --durations=15 -p no:cacheprovider \
    "${workers[@]}" tests/test_kernels_*.py tests/test_triton_memcheck.py "$@" 2>&1 | tee -a "$out/pytest.log"
rc_tests=${PIPESTATUS[0]}
if [ "$rc_tests" = 4 ]; then  # a usage error (no CUDA device, a bad argument): nothing ran, nothing to report
    echo "gpu_session: the kernel tests could not start (pytest exit 4, above)" | tee -a "$out/pytest.log"
    exit 4
fi
ran=$(grep -oE "[0-9]+ kernel tests ran on $device" "$out/pytest.log" | grep -oE '^[0-9]+' | tail -1)
if [ -z "$ran" ] || [ "$ran" = 0 ]; then  # killed at its limit, or crashed before its summary
    echo "gpu_session: no count of kernel tests run on $device (pytest exit $rc_tests): not verified" \
        | tee -a "$out/pytest.log"
    [ "$rc_tests" = 0 ] && rc_tests=1
fi

# 2. The divergence report and the benchmarks, in the time left (570 s a device call; 20 kept for the rest).
left=$((550 - (SECONDS - start)))
timeout $((left > 30 ? left : 30)) python3 benchmarks/gpu_check.py --time-limit $((left > 40 ? left - 20 : 20)) \
    ${GPU_CHECK_ARGS:-} 2>&1 | tee "$out/gpu_check.log"
rc_report=${PIPESTATUS[0]}
[ "$out" != benchmarks/out/$mode ] && cp benchmarks/out/kernels.json benchmarks/out/kernels.png benchmarks/out/step.json \
    benchmarks/out/step.profile.json \
    "$out"/ 2>/dev/null
echo "gpu_session $mode: ${ran:-no} kernel tests ran on $device (pytest exit $rc_tests); report exit $rc_report;" \
    "$((SECONDS - start)) s"
[ "$rc_tests" = 0 ] && exit "$rc_report"
exit "$rc_tests"
