#!/usr/bin/env bash
# Testing on a slurm cluster: tools/slurm_test.sh PARTITION JOB_NAME CONFIG CHECKPOINT [test.py args]
# (the variables that size the job: tools/slurm_run.sh)
set -euo pipefail
if [ $# -lt 4 ]; then
  echo "usage: $0 PARTITION JOB_NAME CONFIG CHECKPOINT [test.py options]" >&2
  exit 2
fi
exec bash "$(dirname "$0")/slurm_run.sh" "$1" "$2" test.py "$3" "$4" "${@:5}"
