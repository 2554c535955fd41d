#!/bin/bash
# Several machines under Slurm: one `ppmedia train` per node, meeting at torchrun's c10d rendezvous on the
# first node; each starts its 8 ranks through torch.distributed.run. Here GLM-4.5V fully fine-tuned on
# 2 nodes x 8 x 80 GB (pp 4 x dp 4 with FSDP2: about 54 GB of weights, gradients and moments per GPU;
# recipes/glm4_5v.yaml freezes the language side to fit one node, `--freeze ''` trains it all).
#
#   sbatch recipes/sbatch.sh
#
#SBATCH --job-name=ppmedia-glm4_5v
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
set -euo pipefail

HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
srun ppmedia train recipes/glm4_5v.yaml --model /path/to/GLM-4.5V --freeze '' --pp 4 --dp 4 \
    --nnodes "$SLURM_NNODES" --nproc-per-node 8 --rdzv-endpoint "$HEAD:29500" --rdzv-id "$SLURM_JOB_ID"
