#!/usr/bin/env bash
# Multi-node launch with torchrun: run this same script on every node.
#   NNODES=2 NPROC=8 MASTER=host0:29500 JOB=exp1 bash launch/torchrun_multinode.sh parallel.world_size=16 parallel.dp_shard=16
# Every rank runs the hyperpar driver as one worker; all ranks share one run dir named after --rdzv-id.
set -euo pipefail
: "${NNODES:?number of nodes}" "${NPROC:?processes per node}" "${MASTER:?host:port of the rendezvous}"
JOB=${JOB:-hyperpar-$(date +%Y%m%d-%H%M%S)}
exec torchrun --nnodes "$NNODES" --nproc-per-node "$NPROC" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER" --rdzv-id "$JOB" \
  -m hyperpar "$@"
