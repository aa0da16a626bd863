#!/usr/bin/env bash
# Multi-node EAGLE-3 training under SLURM: one torchrun per node, DeepSpeed ZeRO inside.
#
#   sbatch --nodes 4 --gpus-per-node 8 scripts/launch_slurm.sh \
#       method=eagle3 target=hf target.name=meta-llama/Llama-3.1-8B-Instruct \
#       data=/shared/runs/llama8b-data out=/shared/runs/llama8b-eagle3 deepspeed=zero2 precision=bf16 device=cuda
#
# Any argument is a Hydra override for `draftsmith train`. out= and data= must be on a filesystem
# every node sees (checkpoints are written by all ranks, published by rank 0). Resubmitting with
# resume=true continues exactly from the latest checkpoint.
#SBATCH --job-name=draftsmith-train
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --output=%x-%j.out
set -euo pipefail

NNODES=${SLURM_NNODES:-1}
NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-$(nvidia-smi -L 2>/dev/null | wc -l || echo 1)}}
[ "$NPROC_PER_NODE" -ge 1 ] 2>/dev/null || NPROC_PER_NODE=1
MASTER_ADDR=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-$(hostname)}" 2>/dev/null | head -n 1 || hostname)
MASTER_PORT=${MASTER_PORT:-29500}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

echo "draftsmith train: ${NNODES} node(s) x ${NPROC_PER_NODE} process(es), rendezvous ${MASTER_ADDR}:${MASTER_PORT}"
srun --kill-on-bad-exit=1 torchrun \
    --nnodes "${NNODES}" \
    --nproc_per_node "${NPROC_PER_NODE}" \
    --rdzv_id "${SLURM_JOB_ID:-draftsmith}" \
    --rdzv_backend c10d \
    --rdzv_endpoint "${MASTER_ADDR}:${MASTER_PORT}" \
    -m draftsmith.cli train "$@"
