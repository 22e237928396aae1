#!/usr/bin/env bash
# The end-to-end GPU check of the DTN detectors (docs/dev/gpu_e2e.md). On a machine with one
# NVIDIA GPU, Python and a CUDA build of PyTorch but no network: installs the OpenMMLab stack
# from the wheels brought along (requirements/gpu_e2e_wheels.txt), builds mmcv 2.1.0's CUDA ops
# for this GPU and this torch with every core (or installs such a wheel brought along), then
# tools/dev/gpu_e2e.py trains RetinaNet PVT-Tiny and Mask R-CNN PVT-Tiny and Swin-T, with DTN and
# with LN, through tools/dist_train.sh CONFIG 1 --amp (NCCL, one process), once more with
# model.backbone.with_cp=True, evaluates each through tools/dist_test.sh and prints one table a
# detector. Everything stops by the time budget; what did not run says so in the tables.
#
#   bash tools/dev/gpu_e2e.sh                 # on the GPU machine
#   bash tools/dev/gpu_e2e.sh --dry-run       # on a CPU with the project's .venv (no set-up)
#   bash tools/dev/gpu_e2e.sh --only retinanet_pvt-t-dtn_fpn_1x_coco   # one detector
#   PYTHON=... TORCH_CUDA_ARCH_LIST=9.0 bash tools/dev/gpu_e2e.sh --build-mmcv
#                                             # ahead of time, without a GPU: the mmcv wheel only,
#                                             # into $WHEELS/<key>/ for the GPU run to install
# Other options go to `gpu_e2e.py run` (--only, --jobs, --cfg-options).
#
# Environment:
#   PYTHON     the Python with torch (default: /opt/torch/.venv/bin/python3 where it exists,
#              else python3; --dry-run: .venv/bin/python)
#   WHEELS     the wheels brought along (default work_dirs/gpu_e2e_wheels), written where there
#              is network by: python tools/dev/gpu_e2e.py fetch --dest work_dirs/gpu_e2e_wheels
#   OUT        results.md, results.json, the logs and the mmcv wheel built here
#              (default work_dirs/gpu_e2e/<UTC time>)
#   SCRATCH    the installed stack, data, configs, checkpoints (default /tmp/mmdtn_gpu_e2e;
#              --dry-run: $OUT/scratch)
#   BUDGET_S   seconds for everything, set-up included (default 480): no run starts later and
#              running ones are stopped
#   MMCV_WHEEL a wheel of mmcv 2.1.0 with CUDA ops for this Python, torch and GPU (default: the one
#              in $WHEELS/mmcv-2.1.0-torch<version>-cu<cuda>-sm<arch>/, as this script leaves
#              it in $OUT/mmcv_wheel/); without one mmcv is built here
#   TORCH_CUDA_ARCH_LIST  GPU architectures of mmcv's CUDA ops (default: this GPU's)
#   MAX_JOBS   compiler processes of the mmcv build (default: every core)
#   CUDA_HOME  the CUDA toolkit (default: torch's choice, from nvcc on PATH or /usr/local/cuda)
#   E2E_COMMIT the commit to name in the report, where the checkout has no .git
#
# Last run on a GPU: not run on a GPU yet. After a run, results.md's "time" line gives the
# seconds of each part (wheels, mmcv, data and configs, the ops check, trainings and
# evaluations); they belong here, with the date, GPU and commit.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT" || exit 1
START=$(date +%s)
DRIVER="$ROOT/tools/dev/gpu_e2e.py"
BUDGET_GIVEN=${BUDGET_S:-}
BUDGET_S=${BUDGET_S:-480}
DRY=0
BUILD_ONLY=0
ARGS=()
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    --build-mmcv) BUILD_ONLY=1 ;;
    -h|--help) sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) ARGS+=("$arg") ;;
  esac
done
OUT=${OUT:-$ROOT/work_dirs/gpu_e2e/$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

say() { printf '[gpu_e2e %3ds] %s\n' "$(($(date +%s) - START))" "$*"; }
die() {
  say "set-up failed: $*" >&2
  printf 'set-up failed: %s\n' "$*" > "$OUT/setup_failed.txt"
  exit 1
}

if [ "$DRY" = 1 ]; then
  if [ -z "${PYTHON:-}" ]; then
    PYTHON=python3
    [ -x "$ROOT/.venv/bin/python" ] && PYTHON="$ROOT/.venv/bin/python"
  fi
  SCRATCH=${SCRATCH:-$OUT/scratch}
  deadline=()
  [ -n "$BUDGET_GIVEN" ] && deadline=(--deadline "$((START + BUDGET_S))")
  say "dry run on the CPU with $PYTHON: results in $OUT"
  exec "$PYTHON" "$DRIVER" run --dry-run --scratch "$SCRATCH" --out "$OUT" "${deadline[@]}" \
    "${ARGS[@]}"
fi

if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  [ -x /opt/torch/.venv/bin/python3 ] && PYTHON=/opt/torch/.venv/bin/python3
fi
WHEELS=${WHEELS:-$ROOT/work_dirs/gpu_e2e_wheels}
SCRATCH=${SCRATCH:-/tmp/mmdtn_gpu_e2e}
SITE="$SCRATCH/site"
mkdir -p "$SCRATCH"
say "Python $PYTHON, wheels $WHEELS, results $OUT, scratch $SCRATCH, budget ${BUDGET_S} s"

# 1. torch sees the GPU (--build-mmcv: torch is a CUDA build; the architecture is given).
[ "$BUILD_ONLY" = 0 ] || [ -n "${TORCH_CUDA_ARCH_LIST:-}" ] \
  || die "--build-mmcv needs TORCH_CUDA_ARCH_LIST, the GPU's architecture (9.0 for H100 and H200)"
read -r TORCH_VER CUDA_VER GPU_ARCH < <(BUILD_ONLY=$BUILD_ONLY "$PYTHON" -c '
import os, torch
assert torch.version.cuda, "torch is not a CUDA build"
gpu = os.environ["BUILD_ONLY"] == "0"
assert not gpu or torch.cuda.is_available(), "no GPU visible to torch"
arch = "%d.%d" % torch.cuda.get_device_capability(0) if gpu else "none"
print(torch.__version__.split("+")[0], torch.version.cuda, arch)
' 2> "$OUT/torch_check.log") || die "$PYTHON has no CUDA build of torch that sees a GPU: $(tail -n 1 "$OUT/torch_check.log")"
ARCH=${TORCH_CUDA_ARCH_LIST:-$GPU_ARCH}
say "torch $TORCH_VER (CUDA $CUDA_VER), GPU capability $GPU_ARCH, mmcv ops for $ARCH"

# 2. The wheels brought along, into $SITE (first on PYTHONPATH; the machine's packages stay);
#    --build-mmcv: those that build mmcv.
t0=$(date +%s)
BUILD_TOOLS=()
[ "$BUILD_ONLY" = 1 ] && BUILD_TOOLS=(--build-tools)
"$PYTHON" "$DRIVER" install --wheels "$WHEELS" --site "$SITE" "${BUILD_TOOLS[@]}" \
  || die "installing the wheels from $WHEELS"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"  # ninja, for torch's extension build
WHEELS_S=$(($(date +%s) - t0))
say "wheels installed in ${WHEELS_S} s"

# 3. The data and configs, and mmcv with CUDA ops (a wheel brought along, or built here): both
#    in the background, each in its own process group (stopped with the script).
SETSID=$(command -v setsid || true)
BUILD_PID=
PREPARE_PID=
stop_background() {
  local pid
  for pid in $BUILD_PID $PREPARE_PID; do
    kill -0 "$pid" 2> /dev/null && { kill -TERM -- "-$pid" 2> /dev/null || kill -TERM "$pid"; }
  done
}
trap stop_background EXIT
if [ "$BUILD_ONLY" = 0 ]; then
  $SETSID "$PYTHON" "$DRIVER" prepare --scratch "$SCRATCH" "${ARGS[@]}" > "$OUT/prepare.log" 2>&1 &
  PREPARE_PID=$!
fi

ARCH_KEY=$(source "$ROOT/tools/setup_env.sh" && arch_key "$ARCH") || die "tools/setup_env.sh's arch_key"
MMCV_VER=$(sed -n 's/^mmcv==\([0-9.]*\).*/\1/p' "$ROOT/requirements/gpu_e2e_wheels.txt")
KEY="mmcv-$MMCV_VER-torch$TORCH_VER-cu${CUDA_VER/./}-$ARCH_KEY"
PIP_WHEEL=$(ls "$WHEELS"/pip-*.whl 2> /dev/null | head -n 1)
pip_run() {  # the Python's pip, or pip from its wheel where it has none
  if "$PYTHON" -c 'import pip' 2> /dev/null; then
    "$PYTHON" -m pip --disable-pip-version-check "$@"
  else
    "$PYTHON" "$PIP_WHEEL/pip" --disable-pip-version-check "$@"
  fi
}
MMCV_WHEEL=${MMCV_WHEEL:-$(ls "$WHEELS/$KEY"/mmcv-*.whl 2> /dev/null | head -n 1)}
t0=$(date +%s)
if [ -n "$MMCV_WHEEL" ]; then
  MMCV_ROUTE="wheel brought along ($(basename "$MMCV_WHEEL"))"
else
  SDIST="$WHEELS/mmcv-$MMCV_VER.tar.gz"
  [ -f "$SDIST" ] || die "neither a wheel in $WHEELS/$KEY/ nor the sdist $SDIST"
  CUDA_HOME=${CUDA_HOME:-$("$PYTHON" -c 'from torch.utils.cpp_extension import CUDA_HOME; print(CUDA_HOME or "")')}
  [ -x "$CUDA_HOME/bin/nvcc" ] || die "no CUDA toolkit (nvcc) found; set CUDA_HOME"
  JOBS=${MAX_JOBS:-$(nproc)}
  MMCV_ROUTE="built here from the sdist (MAX_JOBS=$JOBS, TORCH_CUDA_ARCH_LIST=$ARCH, $("$CUDA_HOME/bin/nvcc" --version | sed -n 's/.*\(release [0-9.]*\).*/nvcc \1/p'))"
  BUILD="$SCRATCH/mmcv_build"
  build_mmcv() {
    rm -rf "$BUILD" && mkdir -p "$BUILD" && tar -xzf "$SDIST" -C "$BUILD" || return 1
    local src="$BUILD/mmcv-$MMCV_VER"
    # recent torch headers need C++20; mmcv 2.1.0 asks for C++14/17 (as tools/setup_env.sh)
    sed -i -e 's/-std=c++14/-std=c++20/g' -e 's/-std=c++17/-std=c++20/g' "$src/setup.py"
    # Headers torch includes that the toolkit lacks, linked from torch's NVIDIA packages into a
    # folder searched after the toolkit's (tools/setup_env.sh's link_missing_headers).
    local py_inc torch_inc nv_incs linked
    py_inc=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
    torch_inc=$("$PYTHON" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "include"))')
    nv_incs=$("$PYTHON" -c 'import glob, site; print(":".join(sorted(d for p in site.getsitepackages() for d in glob.glob(p + "/nvidia/*/include"))))')
    grep -rhoE '^\s*#include <(ATen|c10|THC|torch)/[^>]+>' "$src/mmcv/ops/csrc/common" \
      "$src/mmcv/ops/csrc/pytorch" | sed 's/^\s*//' | sort -u > "$BUILD/torch_headers.cu"
    if linked=$(source "$ROOT/tools/setup_env.sh" && link_missing_headers "$BUILD/cuda_include" \
        "$nv_incs" "$CUDA_HOME/bin/nvcc" -E -std=c++20 -I"$torch_inc" \
        -I"$torch_inc/torch/csrc/api/include" -I"$py_inc" -I"$CUDA_HOME/include" \
        -I"$BUILD/cuda_include" "$BUILD/torch_headers.cu" -o /dev/null); then
      [ -n "$linked" ] && export CUDA_INC_PATH="$BUILD/cuda_include" \
        && echo "headers linked from torch's NVIDIA packages: $(echo $linked)"
    else
      echo "warning: torch's headers did not preprocess with $CUDA_HOME (above); building anyway"
    fi
    MMCV_WITH_OPS=1 FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS="$JOBS" \
      pip_run wheel -v --no-build-isolation --no-deps --no-index -w "$BUILD/dist" "$src"
  }
  export -f build_mmcv pip_run
  export BUILD SDIST MMCV_VER PYTHON CUDA_HOME ARCH JOBS ROOT PIP_WHEEL
  say "building mmcv $MMCV_VER: $MMCV_ROUTE (log: $OUT/mmcv_build.log)"
  $SETSID bash -c build_mmcv > "$OUT/mmcv_build.log" 2>&1 &
  BUILD_PID=$!
  next=$(($(date +%s) + 30))
  while kill -0 "$BUILD_PID" 2> /dev/null; do
    sleep 2
    if [ "$(date +%s)" -ge "$next" ]; then
      units=$(grep -oE '^\s*\[[0-9]+/[0-9]+\]' "$OUT/mmcv_build.log" | tail -n 1 | tr -d ' ')
      say "mmcv build: ${units:-starting} units compiled"
      next=$((next + 30))
    fi
  done
  if ! wait "$BUILD_PID"; then
    grep -m 10 -E '^\s*FAILED: |: (fatal )?error:|undefined reference|Error' "$OUT/mmcv_build.log" >&2
    die "building mmcv failed after $(($(date +%s) - t0)) s (first errors above; log: $OUT/mmcv_build.log)"
  fi
  MMCV_WHEEL=$(ls "$BUILD"/dist/mmcv-*.whl | head -n 1)
  # kept for the next run: brought along from $OUT/mmcv_wheel/ into $WHEELS/, it skips the build
  mkdir -p "$OUT/mmcv_wheel/$KEY" && cp "$MMCV_WHEEL" "$OUT/mmcv_wheel/$KEY/"
  mkdir -p "$WHEELS/$KEY" 2> /dev/null && cp "$MMCV_WHEEL" "$WHEELS/$KEY/" 2> /dev/null
fi
pip_run install -q --no-index --no-deps --upgrade --target "$SITE" "$MMCV_WHEEL" \
  > "$OUT/mmcv_install.log" 2>&1 || die "installing $MMCV_WHEEL: $(tail -n 3 "$OUT/mmcv_install.log")"
MMCV_S=$(($(date +%s) - t0))
say "mmcv: $MMCV_ROUTE, ready after ${MMCV_S} s"
if [ "$BUILD_ONLY" = 1 ]; then
  say "the wheel for the GPU run: $(ls "$WHEELS/$KEY"/mmcv-*.whl) ($(du -h "$WHEELS/$KEY"/mmcv-*.whl | cut -f 1))"
  exit 0
fi

# 4. mmcv's CUDA ops of the detectors once on the GPU (a failure is reported, the runs go on).
t0=$(date +%s)
"$PYTHON" "$DRIVER" ops-check --out "$OUT" > "$OUT/ops_check.log" 2>&1 \
  || say "mmcv's CUDA ops failed: $(tail -n 1 "$OUT/ops_check.log")"
OPS_S=$(($(date +%s) - t0))

wait "$PREPARE_PID"
PREPARE_RC=$?
say "data and configs: exit $PREPARE_RC ($(tail -n 1 "$OUT/prepare.log"))"
[ "$PREPARE_RC" = 0 ] || die "preparing the data and configs: $(tail -n 5 "$OUT/prepare.log")"
SETUP_S=$(($(date +%s) - START))
cat > "$OUT/setup.json" <<EOF
{"set-up_s": $SETUP_S, "wheels_s": $WHEELS_S, "mmcv_s": $MMCV_S, "ops check_s": $OPS_S,
 "mmcv_route": "$MMCV_ROUTE"}
EOF
say "set-up done in ${SETUP_S} s; training and evaluating until $((BUDGET_S)) s"

# 5. The runs and the tables (results.md, results.json).
"$PYTHON" "$DRIVER" run --scratch "$SCRATCH" --out "$OUT" --deadline "$((START + BUDGET_S - 5))" \
  "${ARGS[@]}"
RC=$?
say "done (exit $RC): $OUT/results.md"
exit $RC
