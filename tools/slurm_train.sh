#!/usr/bin/env bash
# Training on a slurm cluster: tools/slurm_train.sh PARTITION JOB_NAME CONFIG WORK_DIR [train.py args]
# (the variables that size the job: tools/slurm_run.sh)
set -euo pipefail
if [ $# -lt 4 ]; then
  echo "usage: $0 PARTITION JOB_NAME CONFIG WORK_DIR [train.py options]" >&2
  exit 2
fi
exec bash "$(dirname "$0")/slurm_run.sh" "$1" "$2" train.py "$3" --work-dir="$4" "${@:5}"
