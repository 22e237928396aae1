#!/usr/bin/env bash
# Multi-process runs with torchrun, behind dist_train.sh and dist_test.sh:
# tools/dist_run.sh TOOL NPROC [TOOL args ...] runs tools/TOOL with --launcher pytorch.
# NPROC processes per node (one per GPU; on a machine without CUDA, CPU processes with gloo).
# Multi-node: NNODES, NODE_RANK, MASTER_ADDR, PORT (defaults 1, 0, 127.0.0.1, 29500).
# PYTHON selects the interpreter (default: python).
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 TOOL NPROC [TOOL options]" >&2
  exit 2
fi
TOOL=$1
GPUS=$2
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
PORT=${PORT:-29500}
MASTER_ADDR=${MASTER_ADDR:-"127.0.0.1"}
PYTHON=${PYTHON:-python}
ROOT=$(cd "$(dirname "$0")/.." && pwd)

PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" \
exec "$PYTHON" -m torch.distributed.run \
    --nnodes="$NNODES" \
    --node_rank="$NODE_RANK" \
    --master_addr="$MASTER_ADDR" \
    --nproc_per_node="$GPUS" \
    --master_port="$PORT" \
    "$ROOT/tools/$TOOL" \
    --launcher pytorch "${@:3}"
