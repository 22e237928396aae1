#!/usr/bin/env bash
# Multi-process training with torchrun: tools/dist_train.sh CONFIG NPROC [train.py args ...]
# (NPROC processes per node; the variables for several nodes: tools/dist_run.sh).
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 CONFIG NPROC [train.py options]" >&2
  exit 2
fi
exec bash "$(dirname "$0")/dist_run.sh" train.py "$2" "$1" "${@:3}"
