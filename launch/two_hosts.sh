#!/bin/bash
# Start one distamp job on two hosts, without a cluster scheduler.
#
# Usage: run the same command on both hosts (same code, same data paths),
# giving this host's rank, 0 on the first host and 1 on the second:
#
#   host-a$ launch/two_hosts.sh 0 examples/train_digits.py --epochs 3
#   host-b$ launch/two_hosts.sh 1 examples/train_digits.py --epochs 3
#
# Settings (environment variables):
#   HOSTS   the two hosts, first one is the master (default "host-a,host-b")
#   PORT    rendezvous port on the first host (default 29500); it must be
#           reachable from the second host
#   GPUS    GPU ids per host, e.g. "0,1,2,3"; empty for CPU workers
#   NPROC   CPU workers per host when GPUS is empty (default 2)
# Logs: log/workerlog.RANK on each host. Both hosts must resolve each other's
# names (see /etc/hosts). Firewall: allow PORT and the workers' gloo/NCCL
# ports between the two hosts only.

set -euo pipefail

if [ "$#" -lt 2 ]; then
    echo "usage: $0 NODE_RANK SCRIPT [SCRIPT_ARGS...]" >&2
    exit 2
fi

NODE_RANK=$1
shift
HOSTS=${HOSTS:-host-a,host-b}
PORT=${PORT:-29500}
MASTER_HOST=${HOSTS%%,*}

if [ -n "${GPUS:-}" ]; then
    WORKERS=(--gpus "$GPUS")
else
    WORKERS=(--nproc_per_node "${NPROC:-2}")
fi

exec distrun \
    --nnodes 2 \
    --node_rank "$NODE_RANK" \
    --master "$MASTER_HOST:$PORT" \
    "${WORKERS[@]}" \
    "$@"
