#!/usr/bin/env bash
# Example SLURM job: one launch.py per node; every node computes the same placement.
# Submit with: sbatch scripts/slurm_example.sh   (adjust the resources to your config's world)
#SBATCH --job-name=pipeline_rl
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
set -euo pipefail
CONF=${CONF:-math_7b}
# Node 0's address, taken from SLURM's own node list (no host-name conventions assumed).
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# launch.py reads SLURM_NNODES / SLURM_NODEID on each node.
srun --kill-on-bad-exit=1 bash -c "source .venv/bin/activate && python launch.py conf=$CONF $*"
