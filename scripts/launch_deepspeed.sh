#!/usr/bin/env bash
# Multi-node draftsmith training with the DeepSpeed launcher: run once, on the first host of the hostfile;
# DeepSpeed starts the other nodes over ssh (pdsh by default) and forwards the variables of ./.deepspeed_env.
#
#   cat hostfile          # one line per node: <host> slots=<GPUs>
#   node0 slots=8
#   node1 slots=8
#   HOSTFILE=hostfile bash scripts/launch_deepspeed.sh train method=eagle3 target=hf \
#       target.name=meta-llama/Llama-3.1-8B-Instruct device=cuda precision=bf16 deepspeed=zero2 \
#       data=/shared/runs/llama8b-data out=/shared/runs/llama8b-eagle3
#
# NNODES (default: the hostfile's lines), NPROC_PER_NODE (default: the first host's slots), MASTER_ADDR
# (default: the first host) and MASTER_PORT override what the hostfile implies. --no_local_rank: draftsmith
# reads LOCAL_RANK from the environment, its Hydra command line takes no --local_rank flag.
# DRY_RUN=1 prints the exact command line and runs nothing.
set -euo pipefail

COMMAND=train
case "${1:-}" in train | data-gen) COMMAND=$1; shift ;; esac

HOSTFILE=${HOSTFILE:-hostfile}
if [ ! -f "$HOSTFILE" ]; then
    echo "launch_deepspeed.sh: no hostfile at $HOSTFILE; write one line per node, '<host> slots=<GPUs>', and set HOSTFILE." >&2
    exit 2
fi
hosts=$(grep -v -e '^[[:space:]]*#' -e '^[[:space:]]*$' "$HOSTFILE")
first=$(echo "$hosts" | head -n 1)
NNODES=${NNODES:-$(echo "$hosts" | wc -l | tr -d ' ')}
NPROC_PER_NODE=${NPROC_PER_NODE:-$(echo "$first" | sed -n 's/.*slots=\([0-9][0-9]*\).*/\1/p')}
NPROC_PER_NODE=${NPROC_PER_NODE:-1}
MASTER_ADDR=${MASTER_ADDR:-$(echo "$first" | awk '{print $1}')}
MASTER_PORT=${MASTER_PORT:-29500}
DEEPSPEED=${DEEPSPEED:-deepspeed}

cmd=("$DEEPSPEED" --hostfile "$HOSTFILE" --num_nodes "$NNODES" --num_gpus "$NPROC_PER_NODE"
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" --no_local_rank
    --module draftsmith.cli "$COMMAND" "$@")
if [ "${DRY_RUN:-0}" = 1 ]; then
    echo "# $NNODES node(s) x $NPROC_PER_NODE process(es), started from $MASTER_ADDR"
    printf '%q ' "${cmd[@]}" | sed 's/ $//'
    echo
    exit 0
fi
exec "${cmd[@]}"
