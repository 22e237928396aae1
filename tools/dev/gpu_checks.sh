#!/usr/bin/env bash
# The DTN Triton backend's checks and measurements on a GPU node, one step after the other, each
# step's output kept in $OUT (default work_dirs/gpu_checks/<step>.log). docs/dev/kernels.md.
#
#   bash tools/dev/gpu_checks.sh                  # every step, in this order
#   bash tools/dev/gpu_checks.sh tests layer      # some of them
#   STEP_SECONDS=300 bash tools/dev/gpu_checks.sh # each step stopped after 300 s (its log kept)
#
# Steps:
#   probe      cuBLAS alone on the layer's 8 products at the un-pooled stage shapes, where
#              $GEMM_PROBE names the probe script (a copy of shared/gpu/gemm_probe.py)
#   tests      the Triton tests compiled, on CUDA tensors
#   layer      a layer against LayerNorm at every stage shape: GPU and host time, kernels
#   backbones  whole PVT-Tiny, PVTv2-b0 and Swin-T backbones against the stock ones, 800 x 1344,
#              batch 2, float16 autocast: time, the host's part of it, memory
# PYTHON selects the interpreter (default: python).
set -uo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python}
OUT=${OUT:-work_dirs/gpu_checks}
STEPS=(probe tests layer backbones)

norm() { "$PYTHON" tools/dev/benchmark_norm.py --device cuda --dtype float16 "$@"; }

run_step() {
    case "$1" in
        probe) if [[ -n ${GEMM_PROBE:-} ]]; then "$PYTHON" "$GEMM_PROBE";
               else echo "probe: GEMM_PROBE is not set; skipped"; fi ;;
        tests) TRITON_INTERPRET=0 "$PYTHON" -m pytest -q -p no:cacheprovider \
                   tests/test_dtn_triton.py tests/test_triton_launch.py ;;
        layer) norm --tables traffic model time kernels --backends triton ;;
        backbones) "$PYTHON" tools/analysis/benchmark_backbones.py --device cuda \
                       --autocast float16 --batches 2 --skip flops ;;
    esac
}

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 0
fi
selected=("$@")
[[ ${#selected[@]} -eq 0 ]] && selected=("${STEPS[@]}")
for step in "${selected[@]}"; do
    if [[ ! " ${STEPS[*]} " == *" $step "* ]]; then
        echo "tools/dev/gpu_checks.sh: no step '$step'; the steps are: ${STEPS[*]}" >&2
        exit 2
    fi
done
if ! "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2> /dev/null; then
    echo "tools/dev/gpu_checks.sh: $PYTHON sees no CUDA GPU (torch.cuda.is_available() is False);" \
         "these checks run on a GPU node (on CPUs: make test)" >&2
    exit 1
fi

mkdir -p "$OUT"
export -f run_step norm  # for the time-limited steps' shells
export PYTHON
failed=()
for step in "${selected[@]}"; do
    echo "== $step ($(date -u +%H:%M:%S), log: $OUT/$step.log) =="
    start=$SECONDS
    if [[ -n ${STEP_SECONDS:-} ]]; then
        timeout "$STEP_SECONDS" bash -c "run_step $step" 2>&1 | tee "$OUT/$step.log"
    else
        run_step "$step" 2>&1 | tee "$OUT/$step.log"
    fi
    status=${PIPESTATUS[0]}
    echo "== $step: exit $status after $((SECONDS - start)) s =="
    [[ $status -ne 0 ]] && failed+=("$step")
done
if [[ ${#failed[@]} -gt 0 ]]; then
    echo "tools/dev/gpu_checks.sh: failed or stopped: ${failed[*]} (logs in $OUT)" >&2
    exit 1
fi
