#!/usr/bin/env bash
# Multi-process testing with torchrun: tools/dist_test.sh CONFIG CHECKPOINT NPROC [test.py args ...]
# (NPROC processes per node; the variables for several nodes: tools/dist_run.sh).
set -euo pipefail
if [ $# -lt 3 ]; then
  echo "usage: $0 CONFIG CHECKPOINT NPROC [test.py options]" >&2
  exit 2
fi
exec bash "$(dirname "$0")/dist_run.sh" test.py "$3" "$1" "$2" "${@:4}"
