#!/usr/bin/env bash
# Multi-node draftsmith under SLURM: one torchrun per node (srun, one task per node), c10d rendezvous on the
# first node, DeepSpeed ZeRO inside.
#
#   sbatch --nodes 2 --gpus-per-node 8 scripts/launch_slurm.sh \
#       method=eagle3 target=hf target.name=meta-llama/Llama-3.1-8B-Instruct \
#       data=/shared/runs/llama8b-data out=/shared/runs/llama8b-eagle3 deepspeed=zero2 precision=bf16 device=cuda
#
# The first argument may name the draftsmith command (train, the default, or data-gen); every other argument
# is a Hydra override for it. out= and data= must be on a filesystem every node sees (checkpoints are written
# by all ranks, published by rank 0). Resubmitting with resume=true continues exactly from the latest
# checkpoint, with the same nodes x GPUs (see docs/cluster.md).
# DRY_RUN=1 (e.g. `DRY_RUN=1 SLURM_NNODES=2 SLURM_GPUS_ON_NODE=8 bash scripts/launch_slurm.sh ...` on a login
# node) prints the exact srun command line and runs nothing.
#SBATCH --job-name=draftsmith
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --output=%x-%j.out
set -euo pipefail

COMMAND=train
case "${1:-}" in train | data-gen) COMMAND=$1; shift ;; esac

gpu_count() { # GPUs on this node (1 when there is none: one CPU process)
    local n=0
    if command -v nvidia-smi >/dev/null 2>&1; then n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true); fi
    [ "$n" -ge 1 ] 2>/dev/null && echo "$n" || echo 1
}

first_host() { # the first host of the job's node list (this host outside SLURM)
    local hosts=""
    if [ -n "${SLURM_JOB_NODELIST:-}" ] && command -v scontrol >/dev/null 2>&1; then
        hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST" 2>/dev/null || true)
    fi
    if [ -n "$hosts" ]; then echo "$hosts" | head -n 1; else hostname; fi
}

NNODES=${SLURM_NNODES:-1}
# SLURM_GPUS_ON_NODE is set under --gpus-per-node; a bare number, or type:count on some sites
NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-$(gpu_count)}}
NPROC_PER_NODE=${NPROC_PER_NODE##*:}
MASTER_ADDR=${MASTER_ADDR:-$(first_host)}
MASTER_PORT=${MASTER_PORT:-29500}
# CPU threads: each process takes the cores it may use divided by the processes on its node, and OpenMP
# waits passively (draftsmith.core.procenv); an OMP_NUM_THREADS or OMP_WAIT_POLICY set here is kept.
cd "${SLURM_SUBMIT_DIR:-.}"

cmd=(srun --kill-on-bad-exit=1 --ntasks-per-node=1
    torchrun --nnodes "$NNODES" --nproc_per_node "$NPROC_PER_NODE"
    --rdzv_id "${SLURM_JOB_ID:-draftsmith}" --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT"
    -m draftsmith.cli "$COMMAND" "$@")
if [ "${DRY_RUN:-0}" = 1 ]; then
    echo "# $NNODES node(s) x $NPROC_PER_NODE process(es), rendezvous $MASTER_ADDR:$MASTER_PORT"
    printf '%q ' "${cmd[@]}" | sed 's/ $//'
    echo
    exit 0
fi
echo "draftsmith $COMMAND: $NNODES node(s) x $NPROC_PER_NODE process(es), rendezvous $MASTER_ADDR:$MASTER_PORT" >&2
exec "${cmd[@]}"
