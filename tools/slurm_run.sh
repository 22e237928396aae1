#!/usr/bin/env bash
# Runs on a slurm cluster, behind slurm_train.sh and slurm_test.sh:
# tools/slurm_run.sh PARTITION JOB_NAME TOOL [TOOL args] runs tools/TOOL with --launcher=slurm.
# GPUS (total tasks, default 8), GPUS_PER_NODE (default 8), CPUS_PER_TASK (default 5),
# SRUN_ARGS (extra srun options), PYTHON (default: python). With GPUS_PER_NODE=0 the tasks run on
# CPU (gloo) and no GPU is requested.
set -euo pipefail
if [ $# -lt 3 ]; then
  echo "usage: $0 PARTITION JOB_NAME TOOL [TOOL options]" >&2
  exit 2
fi
PARTITION=$1
JOB_NAME=$2
TOOL=$3
GPUS=${GPUS:-8}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
CPUS_PER_TASK=${CPUS_PER_TASK:-5}
SRUN_ARGS=${SRUN_ARGS:-""}
PYTHON=${PYTHON:-python}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
if [ "$GPUS_PER_NODE" -gt 0 ]; then
  GRES="--gres=gpu:${GPUS_PER_NODE}"
  TASKS_PER_NODE=$GPUS_PER_NODE
else
  GRES=""
  TASKS_PER_NODE=${TASKS_PER_NODE:-$GPUS}
fi

set -x
# shellcheck disable=SC2086
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" \
srun -p "$PARTITION" \
    --job-name="$JOB_NAME" \
    $GRES \
    --ntasks="$GPUS" \
    --ntasks-per-node="$TASKS_PER_NODE" \
    --cpus-per-task="$CPUS_PER_TASK" \
    --kill-on-bad-exit=1 \
    $SRUN_ARGS \
    "$PYTHON" -u "$ROOT/tools/$TOOL" --launcher=slurm "${@:4}"
