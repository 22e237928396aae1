#!/usr/bin/env bash
# Creates .venv/ in the repository root with the pinned OpenMMLab stack and mmdtn (editable).
#
# Idempotent: a second run checks each step and skips what is already in place. mmcv 2.1.0 exists on
# PyPI only as an sdist; it is built here with its compiled ops and the wheel is cached outside the
# repository (keyed by mmcv version, torch version and ops flavour), so later setups take seconds.
#
# Environment:
#   PYTHON=python3.11          interpreter used to create .venv
#   MMDTN_MMCV_OPS=auto|cpu|cuda
#                              auto (default): CUDA ops when nvcc is on PATH and a GPU is visible
#                              (nvidia-smi -L), CPU ops otherwise. Use `cuda` on a GPU-less build
#                              node of a cluster, `cpu` to skip the (long) CUDA build.
#   TORCH_CUDA_ARCH_LIST=9.0   GPU architectures of the CUDA ops ('8.0;9.0', '9.0+PTX', ...; part of
#                              the wheel cache key). Unset: those of the visible GPUs; with no GPU
#                              visible the CUDA build stops and asks for it.
#   CUDA_HOME=DIR              CUDA toolkit (default: the one nvcc on PATH belongs to)
#   MMDTN_CACHE=DIR            wheel cache (default: ${XDG_CACHE_HOME:-~/.cache}/mmdtn)
#   MMDTN_MIN_FREE_GB=12       free disk space required before installing
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV="$ROOT/.venv"
CACHE="${MMDTN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mmdtn}"
OPS="${MMDTN_MMCV_OPS:-auto}"
MIN_FREE_GB="${MMDTN_MIN_FREE_GB:-12}"
CONSTRAINTS="$ROOT/requirements/constraints.txt"
STEP=0
MINUTES_PER_ARCH=35  # building mmcv's CUDA ops for one GPU architecture with MAX_JOBS=2 (docs/get_started.md)

step() { STEP=$((STEP + 1)); printf '\n[setup %d/7] %s\n' "$STEP" "$*"; }
die() { printf '\nsetup failed: %s\n' "$*" >&2; exit 1; }
pip_q() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2>&1 | { grep -v "^WARNING: Location '" || true; }; return "${PIPESTATUS[0]}"; }

# The GPU architectures of TORCH_CUDA_ARCH_LIST as part of a file name, independent of their order and
# separators: '9.0;8.0+PTX' and '8.0+PTX 9.0' give 'sm80-ptx_sm90'.
arch_key() {
  printf '%s' "$1" | tr ' ;' '\n\n' | sed -e '/^$/d' | tr '[:upper:]' '[:lower:]' \
    | sed -e 's/\.//' -e 's/+ptx$/-ptx/' -e 's/^[0-9]/sm&/' | sort -u | paste -sd_ -
}

# link_missing_headers OUT SEARCH COMMAND...: runs the preprocessor COMMAND, whose include path ends
# with OUT, until it finds every header; each header it misses is linked into OUT from the first
# folder of SEARCH (':'-separated) that has it. The folders before OUT keep precedence, so OUT holds
# only the headers they lack. Prints the linked headers, one a line.
link_missing_headers() {
  local out=$1 log missing dir found
  local -a search
  IFS=: read -r -a search <<< "$2"
  shift 2
  mkdir -p "$out"
  while ! log=$(LC_ALL=C "$@" 2>&1); do
    missing=$(printf '%s\n' "$log" | sed -n 's/.*fatal error: \(.*\): No such file or directory.*/\1/p' | head -n 1)
    if [ -z "$missing" ] || [ -e "$out/$missing" ]; then
      printf '%s\n' "$log" | tail -n 20 >&2
      return 1
    fi
    found=
    for dir in "${search[@]}"; do
      [ -f "$dir/$missing" ] && { found="$dir/$missing"; break; }
    done
    [ -n "$found" ] || { echo "header $missing is in none of: ${search[*]}" >&2; return 1; }
    mkdir -p "$out/$(dirname "$missing")"
    ln -s "$found" "$out/$missing"
    echo "$missing"
  done
}

# Sourced (by the tests), the script only defines the functions above.
if (return 0 2>/dev/null); then return 0; fi

step "checking prerequisites (Python 3.11, C++ compiler, disk space)"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for cand in python3.11 python3; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
      PY=$cand; break
    fi
  done
fi
[ -n "$PY" ] || die "Python 3.11 was not found on PATH (tried python3.11, python3). Install it or set PYTHON=/path/to/python3.11."
"$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || die "$PY is not Python 3.11 ($("$PY" --version 2>&1))."
"$PY" -c 'import venv' 2>/dev/null || die "$PY has no venv module (Debian/Ubuntu: apt-get install python3.11-venv)."
CXX_BIN="${CXX:-}"
[ -n "$CXX_BIN" ] || for cand in c++ g++ clang++; do command -v "$cand" >/dev/null 2>&1 && { CXX_BIN=$cand; break; }; done
[ -n "$CXX_BIN" ] || die "no C++ compiler found (c++, g++ or clang++): mmcv's ops are compiled from source. Debian/Ubuntu: apt-get install g++."
free_kb=$(df -Pk "$ROOT" | awk 'NR==2 {print $4}')
[ "$free_kb" -ge $((MIN_FREE_GB * 1024 * 1024)) ] || \
  die "only $((free_kb / 1024 / 1024)) GiB free under $ROOT; the environment needs about ${MIN_FREE_GB} GiB (PyTorch's CUDA build is large). Free space or set MMDTN_MIN_FREE_GB."
echo "python: $PY ($("$PY" --version 2>&1)); compiler: $CXX_BIN; free: $((free_kb / 1024 / 1024)) GiB"
gpu_visible() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; }
case "$OPS" in
  auto)
    if command -v nvcc >/dev/null 2>&1 && gpu_visible; then
      OPS=cuda
    else
      OPS=cpu
    fi ;;
  cpu|cuda) ;;
  *) die "MMDTN_MMCV_OPS must be auto, cpu or cuda (got '$OPS')" ;;
esac
if [ "$OPS" = cuda ]; then
  command -v nvcc >/dev/null 2>&1 || die "MMDTN_MMCV_OPS=cuda but nvcc is not on PATH"
  if [ -z "${CUDA_HOME:-}" ]; then
    # nvcc on PATH may be a wrapper script; nvcc itself reports the toolkit it belongs to.
    CUDA_HOME=$(nvcc -dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n 1)
    CUDA_HOME=$(cd "$CUDA_HOME" 2>/dev/null && pwd -P) || die "could not locate the CUDA toolkit of $(command -v nvcc); set CUDA_HOME"
  fi
  [ -x "$CUDA_HOME/bin/nvcc" ] && [ -f "$CUDA_HOME/include/cuda_runtime.h" ] \
    || die "CUDA_HOME=$CUDA_HOME is not a CUDA toolkit (no bin/nvcc or include/cuda_runtime.h)"
  export CUDA_HOME
  CUDA_TAG="cu$("$CUDA_HOME/bin/nvcc" --version | sed -n 's/.*release \([0-9]*\)\.\([0-9]*\).*/\1\2/p')"
  if [ -n "${TORCH_CUDA_ARCH_LIST:-}" ]; then
    [[ "$TORCH_CUDA_ARCH_LIST" =~ ^[A-Za-z0-9.+\;\ ]+$ ]] \
      || die "TORCH_CUDA_ARCH_LIST='$TORCH_CUDA_ARCH_LIST' is not a list of architectures such as '8.0;9.0'"
  elif ! gpu_visible; then
    die "MMDTN_MMCV_OPS=cuda with no GPU visible needs TORCH_CUDA_ARCH_LIST, the compute capabilities of the
GPUs that will run the ops, e.g. TORCH_CUDA_ARCH_LIST=8.0 (A100), 9.0 (H100, H200), '8.0;9.0' (both).
On a GPU node, nvidia-smi --query-gpu=name,compute_cap --format=csv prints them. Each architecture
adds about ${MINUTES_PER_ARCH} minutes of compilation on 2 cores."
  fi
  echo "mmcv ops: cuda (toolkit $CUDA_HOME, $CUDA_TAG)"
else
  CUDA_TAG=cpu
fi

step "virtual environment at .venv/"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "exists"
else
  rm -rf "$VENV"
  "$PY" -m venv "$VENV" || die "could not create $VENV"
  echo "created"
fi
pip_q install -c "$CONSTRAINTS" -r "$ROOT/requirements/build.txt" "pip<26" || die "could not install build tools (requirements/build.txt)"

step "PyTorch (requirements/torch.txt)"
pip_q install -c "$CONSTRAINTS" -r "$ROOT/requirements/torch.txt" || die "could not install PyTorch (requirements/torch.txt)"
"$VENV/bin/python" -c 'import torch, torchvision; print("torch", torch.__version__, "| torchvision", torchvision.__version__, "| CUDA build", torch.version.cuda, "| GPU visible", torch.cuda.is_available())'

step "mmcv with compiled ops (requirements/mmcv.txt)"
MMCV_VER=$(sed -n 's/^mmcv==\([0-9.]*\).*/\1/p' "$ROOT/requirements/mmcv.txt")
TORCH_VER=$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')
if [ "$OPS" = cuda ]; then
  if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
    TORCH_CUDA_ARCH_LIST=$("$VENV/bin/python" -c 'import torch; print(";".join(sorted({"%d.%d" % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})))') || true
    [ -n "$TORCH_CUDA_ARCH_LIST" ] || die "PyTorch sees no GPU to build mmcv's CUDA ops for; set TORCH_CUDA_ARCH_LIST (e.g. 9.0 for H100)"
    echo "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST (the visible GPUs)"
  fi
  export TORCH_CUDA_ARCH_LIST
  CUDA_TAG="$CUDA_TAG-$(arch_key "$TORCH_CUDA_ARCH_LIST")"
fi
WHEEL_DIR="$CACHE/wheels/mmcv-$MMCV_VER-torch$TORCH_VER-$CUDA_TAG"
ops_ok() {
  "$VENV/bin/python" - "$MMCV_VER" "$1" "$(basename "$WHEEL_DIR")" <<'PY' 2>/dev/null
import sys
from importlib.metadata import distribution
import mmcv
from mmcv.ops import nms, RoIAlign  # noqa: F401  (imports the compiled extension)
from mmcv.utils import ext_loader
ext = ext_loader.load_ext('_ext', ['nms'])
assert mmcv.__version__ == sys.argv[1], mmcv.__version__
if sys.argv[2] == 'cuda':
    import torch.utils.cpp_extension  # noqa: F401
    from mmcv.ops import get_compiling_cuda_version
    assert get_compiling_cuda_version() != 'not available'
    # Built for this TORCH_CUDA_ARCH_LIST: installed from the wheel cache folder of this key.
    assert f'/{sys.argv[3]}/' in distribution('mmcv').read_text('direct_url.json')
PY
}
if ops_ok "$OPS"; then
  echo "mmcv $MMCV_VER with $OPS ops already installed"
else
  if ! ls "$WHEEL_DIR"/mmcv-*.whl >/dev/null 2>&1; then
    echo "no cached wheel in $WHEEL_DIR: building mmcv $MMCV_VER from source with $OPS ops"
    echo "(about 6 minutes on 2 cores for CPU ops, much longer with CUDA ops)"
    export MMCV_WITH_OPS=1 MAX_JOBS="${MAX_JOBS:-$(nproc)}"
    BUILD=$(mktemp -d)
    trap 'rm -rf "$BUILD"' EXIT
    pip_q download --no-deps --no-binary :all: --no-build-isolation "mmcv==$MMCV_VER" -d "$BUILD" \
      || die "could not download the mmcv $MMCV_VER sdist"
    tar -xzf "$BUILD/mmcv-$MMCV_VER.tar.gz" -C "$BUILD"
    # torch 2.14's headers need C++20; mmcv 2.1.0 asks for C++14/17.
    sed -i -e 's/-std=c++14/-std=c++20/g' -e 's/-std=c++17/-std=c++20/g' "$BUILD/mmcv-$MMCV_VER/setup.py"
    grep -q 'std=c++20' "$BUILD/mmcv-$MMCV_VER/setup.py" || die "could not patch mmcv's C++ standard"
    mkdir -p "$WHEEL_DIR"
    build_wheel() {
      ( cd "$BUILD" && "$VENV/bin/python" -m pip --disable-pip-version-check wheel --no-build-isolation --no-deps \
          "$@" -w "$BUILD/dist" "./mmcv-$MMCV_VER" > "$BUILD/build.log" 2>&1 ) && return 0
      cp "$BUILD/build.log" "$WHEEL_DIR.failed.log"
      tail -40 "$BUILD/build.log" >&2
      grep -m 10 -E '^\s*FAILED: |: (fatal )?error:|undefined reference' "$BUILD/build.log" >&2 || true
      die "building mmcv $MMCV_VER failed (first errors above; full log: $WHEEL_DIR.failed.log)"
    }
    if [ "$OPS" = cuda ]; then
      export FORCE_CUDA=1
      # torch's headers include cuBLAS, cuSPARSE and cuSOLVER headers, which a toolkit assembled from
      # pip packages may lack. The headers this toolkit lacks are linked from the NVIDIA packages
      # PyTorch installed (the versions it was built with) into a folder that is searched after the
      # toolkit's include folder (torch's CUDA_INC_PATH): the toolkit's own headers always win.
      PY_INCLUDE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
      TORCH_INCLUDE=$("$VENV/bin/python" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "include"))')
      NVIDIA_INCLUDES=$(ls -d "$VENV"/lib/python3.11/site-packages/nvidia/*/include 2>/dev/null | paste -sd: -)
      grep -rhoE '^\s*#include <(ATen|c10|THC|torch)/[^>]+>' "$BUILD/mmcv-$MMCV_VER/mmcv/ops/csrc/common" \
        "$BUILD/mmcv-$MMCV_VER/mmcv/ops/csrc/pytorch" | sed 's/^\s*//' | sort -u > "$BUILD/torch_headers.cu"
      LINKED=$(link_missing_headers "$BUILD/cuda_include" "$NVIDIA_INCLUDES" "$CUDA_HOME/bin/nvcc" -E -std=c++20 \
          -I"$TORCH_INCLUDE" -I"$TORCH_INCLUDE/torch/csrc/api/include" -I"$PY_INCLUDE" -I"$CUDA_HOME/include" \
          -I"$BUILD/cuda_include" "$BUILD/torch_headers.cu" -o /dev/null) \
        || die "torch's headers do not preprocess with the CUDA toolkit at $CUDA_HOME (see above)"
      if [ -n "$LINKED" ]; then
        export CUDA_INC_PATH="$BUILD/cuda_include"
        echo "headers missing from $CUDA_HOME/include, taken from PyTorch's NVIDIA packages: $(echo $LINKED)"
      fi
      n_arch=$(arch_key "$TORCH_CUDA_ARCH_LIST" | tr _ '\n' | wc -l)
      echo "compiling mmcv's CUDA ops for TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST with MAX_JOBS=$MAX_JOBS: a long build,"
      echo "about $((MINUTES_PER_ARCH * n_arch * 2 / MAX_JOBS)) minutes ($MINUTES_PER_ARCH minutes per architecture on 2 cores); progress every 2 minutes"
      build_started=$SECONDS
      next_report=$((SECONDS + 120))
      build_wheel -v &
      build_pid=$!
      while kill -0 "$build_pid" 2>/dev/null; do
        sleep 5
        if [ "$SECONDS" -ge "$next_report" ] && kill -0 "$build_pid" 2>/dev/null; then
          done_units=$(grep -oE '^\s*\[[0-9]+/[0-9]+\]' "$BUILD/build.log" | tail -n 1 | tr -d '[] ' || true)
          echo "  $(((SECONDS - build_started) / 60)) min: ${done_units:-0/?} units compiled"
          next_report=$((next_report + 120))
        fi
      done
      wait "$build_pid" || exit 1
      echo "built in $(((SECONDS - build_started) / 60)) min"
    else
      export FORCE_CUDA=0 CUDA_VISIBLE_DEVICES=""
      build_wheel
    fi
    mv "$BUILD"/dist/mmcv-*.whl "$WHEEL_DIR/"
    rm -f "$WHEEL_DIR.failed.log"
    unset FORCE_CUDA CUDA_VISIBLE_DEVICES CUDA_INC_PATH
  else
    echo "using cached wheel from $WHEEL_DIR"
  fi
  pip_q install -c "$CONSTRAINTS" --no-deps --force-reinstall "$WHEEL_DIR"/mmcv-*.whl || die "could not install the mmcv wheel"
  # mmcv's own dependencies (addict, opencv, yapf, ...), without touching torch.
  pip_q install -c "$CONSTRAINTS" "mmcv==$MMCV_VER" --no-build-isolation || die "could not install mmcv's dependencies"
  ops_ok "$OPS" || die "mmcv was installed but its compiled ops do not import"
fi

step "OpenMMLab stack and tools (requirements/runtime.txt, requirements/tests.txt)"
pip_q install -c "$CONSTRAINTS" -r "$ROOT/requirements/runtime.txt" -r "$ROOT/requirements/tests.txt" \
  || die "could not install requirements/runtime.txt"

step "mmdtn (editable, with its C++ CPU kernels)"
KERNELS=$(ls "$ROOT"/mmdtn/models/layers/dtn/_cpu_kernels*.so 2>/dev/null | head -n 1 || true)
if [ -n "$KERNELS" ] && "$VENV/bin/python" -m pip show -q mmdtn >/dev/null 2>&1 \
    && [ -z "$(find "$ROOT/setup.py" "$ROOT/pyproject.toml" "$ROOT"/mmdtn/models/layers/dtn/csrc -newer "$KERNELS")" ]; then
  echo "already installed, kernels up to date"
else
  pip_q install -c "$CONSTRAINTS" --no-build-isolation --no-deps -e "$ROOT" || die "could not install mmdtn"
fi

step "checking the installation"
"$VENV/bin/python" - <<'PY' || die "the installed stack does not import"
import pkg_resources  # noqa: F401  (mmengine and mmcv need it: setuptools < 81)
import mmcv, mmdet, mmengine, mmpretrain, mmseg, timm, torch
import os
import mmdtn
from mmdtn import available_backends
if 'cpu' not in available_backends('cpu') and os.environ.get('MMDTN_WITH_OPS') != '0':
    raise SystemExit("mmdtn's CPU kernels did not build; MMDTN_WITH_OPS=0 installs without them")
print(f'mmdtn {mmdtn.__version__}: torch {torch.__version__}, mmcv {mmcv.__version__}, mmengine {mmengine.__version__}, '
      f'mmdet {mmdet.__version__}, mmseg {mmseg.__version__}, mmpretrain {mmpretrain.__version__}, '
      f'timm {timm.__version__}')
PY
echo "ready: activate with 'source .venv/bin/activate'"
