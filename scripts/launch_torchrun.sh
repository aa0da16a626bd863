#!/usr/bin/env bash
# Multi-node draftsmith with torchrun: run this script once on every node (same arguments, NODE_RANK differs).
#
#   NNODES=2 NODE_RANK=0 NPROC_PER_NODE=8 MASTER_ADDR=node0 bash scripts/launch_torchrun.sh train \
#       method=eagle3 target=hf target.name=meta-llama/Llama-3.1-8B-Instruct device=cuda precision=bf16 \
#       deepspeed=zero2 data=/shared/runs/llama8b-data out=/shared/runs/llama8b-eagle3
#   (then the same on node1 with NODE_RANK=1)
#
# The first argument is the draftsmith command (train, the default, or data-gen: its ranks split the prompts);
# the rest are its Hydra overrides. out= and data= must be on a filesystem every node sees.
# DRY_RUN=1 prints the exact command line of every node (node_rank 0 .. NNODES-1) and runs nothing.
set -euo pipefail

COMMAND=train
case "${1:-}" in train | data-gen) COMMAND=$1; shift ;; esac

gpu_count() { # GPUs on this node (1 when there is none: one CPU process)
    local n=0
    if command -v nvidia-smi >/dev/null 2>&1; then n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true); fi
    [ "$n" -ge 1 ] 2>/dev/null && echo "$n" || echo 1
}

NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
NPROC_PER_NODE=${NPROC_PER_NODE:-$(gpu_count)}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
TORCHRUN=${TORCHRUN:-torchrun}
# CPU threads: each process takes the cores it may use divided by the processes on its node, and OpenMP
# waits passively (draftsmith.core.procenv); an OMP_NUM_THREADS or OMP_WAIT_POLICY set here is kept.

node_command() { # node_command <node rank> <overrides...>: the command line of that node
    local node=$1
    shift
    printf '%q ' "$TORCHRUN" --nnodes "$NNODES" --node_rank "$node" --nproc_per_node "$NPROC_PER_NODE" \
        --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" -m draftsmith.cli "$COMMAND" "$@" | sed 's/ $//'
    echo
}

if [ "${DRY_RUN:-0}" = 1 ]; then
    for ((node = 0; node < NNODES; node++)); do
        echo "# node $node of $NNODES ($NPROC_PER_NODE processes)"
        node_command "$node" "$@"
    done
    exit 0
fi
echo "draftsmith $COMMAND: node $NODE_RANK of $NNODES, $NPROC_PER_NODE process(es), rendezvous $MASTER_ADDR:$MASTER_PORT" >&2
exec "$TORCHRUN" --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$NPROC_PER_NODE" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" -m draftsmith.cli "$COMMAND" "$@"
