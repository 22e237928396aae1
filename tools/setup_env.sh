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

step() { STEP=$((STEP + 1)); printf '\n[setup %d/7] %s\n' "$STEP" "$*"; }
die() { printf '\nsetup failed: %s\n' "$*" >&2; exit 1; }
pip_q() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2>&1 | { grep -v "^WARNING: Location '" || true; }; return "${PIPESTATUS[0]}"; }

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
case "$OPS" in
  auto)
    if command -v nvcc >/dev/null 2>&1 && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then
      OPS=cuda
    else
      OPS=cpu
    fi ;;
  cpu|cuda) ;;
  *) die "MMDTN_MMCV_OPS must be auto, cpu or cuda (got '$OPS')" ;;
esac
if [ "$OPS" = cuda ]; then
  command -v nvcc >/dev/null 2>&1 || die "MMDTN_MMCV_OPS=cuda but nvcc is not on PATH"
  CUDA_TAG="cu$(nvcc --version | sed -n 's/.*release \([0-9]*\)\.\([0-9]*\).*/\1\2/p')"
else
  CUDA_TAG=cpu
fi
WHEEL_DIR="$CACHE/wheels/mmcv-$MMCV_VER-torch$TORCH_VER-$CUDA_TAG"
ops_ok() {
  "$VENV/bin/python" - "$MMCV_VER" "$1" <<'PY' 2>/dev/null
import sys
import mmcv
from mmcv.ops import nms, RoIAlign  # noqa: F401  (imports the compiled extension)
from mmcv.utils import ext_loader
ext = ext_loader.load_ext('_ext', ['nms'])
assert mmcv.__version__ == sys.argv[1], mmcv.__version__
if sys.argv[2] == 'cuda':
    import torch.utils.cpp_extension  # noqa: F401
    from mmcv.ops import get_compiling_cuda_version
    assert get_compiling_cuda_version() != 'not available'
PY
}
if ops_ok "$OPS"; then
  echo "mmcv $MMCV_VER with $OPS ops already installed"
else
  if ! ls "$WHEEL_DIR"/mmcv-*.whl >/dev/null 2>&1; then
    echo "no cached wheel in $WHEEL_DIR: building mmcv $MMCV_VER from source with $OPS ops"
    echo "(about 6 minutes on 2 cores for CPU ops, much longer with CUDA ops)"
    BUILD=$(mktemp -d)
    trap 'rm -rf "$BUILD"' EXIT
    pip_q download --no-deps --no-binary :all: --no-build-isolation "mmcv==$MMCV_VER" -d "$BUILD" \
      || die "could not download the mmcv $MMCV_VER sdist"
    tar -xzf "$BUILD/mmcv-$MMCV_VER.tar.gz" -C "$BUILD"
    # torch 2.14's headers need C++20; mmcv 2.1.0 asks for C++14/17.
    sed -i -e 's/-std=c++14/-std=c++20/g' -e 's/-std=c++17/-std=c++20/g' "$BUILD/mmcv-$MMCV_VER/setup.py"
    grep -q 'std=c++20' "$BUILD/mmcv-$MMCV_VER/setup.py" || die "could not patch mmcv's C++ standard"
    mkdir -p "$WHEEL_DIR"
    if [ "$OPS" = cuda ]; then
      export FORCE_CUDA=1
    else
      export FORCE_CUDA=0 CUDA_VISIBLE_DEVICES=""
    fi
    export MMCV_WITH_OPS=1 MAX_JOBS="${MAX_JOBS:-$(nproc)}"
    ( cd "$BUILD" && "$VENV/bin/python" -m pip --disable-pip-version-check wheel --no-build-isolation --no-deps \
        -w "$BUILD/dist" "./mmcv-$MMCV_VER" > "$BUILD/build.log" 2>&1 ) \
      || { tail -40 "$BUILD/build.log" >&2; die "building mmcv $MMCV_VER failed (log above)"; }
    mv "$BUILD"/dist/mmcv-*.whl "$WHEEL_DIR/"
    unset FORCE_CUDA CUDA_VISIBLE_DEVICES
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
import mmcv, mmdet, mmengine, mmseg, timm, torch
import os
import mmdtn
from mmdtn import available_backends
if 'cpu' not in available_backends('cpu') and os.environ.get('MMDTN_WITH_OPS') != '0':
    raise SystemExit("mmdtn's CPU kernels did not build; MMDTN_WITH_OPS=0 installs without them")
print(f'mmdtn {mmdtn.__version__}: torch {torch.__version__}, mmcv {mmcv.__version__}, mmengine {mmengine.__version__}, '
      f'mmdet {mmdet.__version__}, mmseg {mmseg.__version__}, timm {timm.__version__}')
PY
echo "ready: activate with 'source .venv/bin/activate'"
