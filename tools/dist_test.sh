#!/usr/bin/env bash
# Multi-process testing with torchrun: tools/dist_test.sh CONFIG CHECKPOINT NPROC [test.py args ...]
# NPROC processes per node (one per GPU; on a machine without CUDA, CPU processes with gloo).
# Multi-node: NNODES, NODE_RANK, MASTER_ADDR, PORT (defaults 1, 0, 127.0.0.1, 29500).
# PYTHON selects the interpreter (default: python).
set -euo pipefail
if [ $# -lt 3 ]; then
  echo "usage: $0 CONFIG CHECKPOINT NPROC [test.py options]" >&2
  exit 2
fi
CONFIG=$1
CHECKPOINT=$2
GPUS=$3
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
    "$ROOT/tools/test.py" \
    "$CONFIG" \
    "$CHECKPOINT" \
    --launcher pytorch "${@:4}"
