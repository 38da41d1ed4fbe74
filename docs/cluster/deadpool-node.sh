#!/usr/bin/env bash
# One `deadpool launch` per host: the host agent that starts this host's workers (actives + spares)
# and, on node rank 0, the coordinator. Started by srun (slurm.sbatch), a Kubernetes Indexed Job
# (k8s-indexed-job.yaml) or any scheduler that runs one copy per host. Usage:
#
#   deadpool-node.sh SCRIPT [SCRIPT ARGS...]
#
# Reads (SLURM sets the first two; anything else can export them):
#   NODE_RANK  (or SLURM_NODEID)   this host's index, 0..NNODES-1; 0 runs the coordinator
#   NNODES     (or SLURM_NNODES)   number of hosts
#   HEAD_ADDR                      node rank 0's address on the cluster network (an IP address)
#   DEADPOOL_SECRET                the job's shared secret, the same on every host (required)
#   MY_ADDR                        this host's address on the cluster network (default: first of `hostname -I`)
#   HOST_NAME (default: `hostname -s`), NPROC_PER_NODE (8), SPARES_PER_NODE (1),
#   COORD_PORT (29400), STORE_PORT (29500), EVENTS_DIR (.)
#   CHECKPOINT_DIR, CHECKPOINT_EVERY (100)  disk checkpoints on a shared filesystem (default: none)
#   RESUME=1 (or SLURM_RESTART_COUNT > 0: a requeued job)  go on from CHECKPOINT_DIR's newest checkpoint
set -euo pipefail

node_rank=${NODE_RANK:-${SLURM_NODEID:?set NODE_RANK (or run under srun)}}
nnodes=${NNODES:-${SLURM_NNODES:?set NNODES (or run under srun)}}
head_addr=${HEAD_ADDR:?set HEAD_ADDR to node rank 0s address}
: "${DEADPOOL_SECRET:?set DEADPOOL_SECRET, the same value on every host}"
my_addr=${MY_ADDR:-$(hostname -I | awk '{print $1}')}
coord_port=${COORD_PORT:-29400}
store_port=${STORE_PORT:-29500}
host_name=${HOST_NAME:-$(hostname -s)}

args=(
  --nnodes "$nnodes" --node-rank "$node_rank"
  --nproc-per-node "${NPROC_PER_NODE:-8}" --spares "${SPARES_PER_NODE:-1}"
  --host-name "$host_name"             # failure domain: snapshot copies and spares avoid the same host
  --bind-host "$my_addr"               # agent, workers, gloo and snapshot streams listen here
  --master-addr "$head_addr" --master-port "$store_port"
  --events "${EVENTS_DIR:-.}/deadpool-events-${host_name}.jsonl"
)
if [ -n "${CHECKPOINT_DIR:-}" ]; then
  args+=(--checkpoint-dir "$CHECKPOINT_DIR" --checkpoint-every "${CHECKPOINT_EVERY:-100}")
  if [ "${RESUME:-0}" = 1 ] || [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then
    args+=(--resume)
  fi
fi
if [ "$node_rank" -eq 0 ]; then
  args+=(--coordinator-port "$coord_port")      # the coordinator binds HEAD_ADDR:COORD_PORT
else
  args+=(--coordinator "tcp://${head_addr}:${coord_port}")
fi
exec python3 -m deadpool launch "${args[@]}" "$@"
