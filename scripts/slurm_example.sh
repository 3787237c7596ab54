#!/usr/bin/env bash
# Example SLURM job: one launch.py per node; every node computes the same placement.
# The node count comes from the job, so one script serves every config:
#   sbatch --nodes=2 scripts/slurm_example.sh            # CONF=math_7b (the default)
#   CONF=math_32b sbatch --nodes=4 scripts/slurm_example.sh
# Check the binding first: python launch.py conf=math_32b world.nodes=4 --dry-run
#SBATCH --job-name=pipeline_rl
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
set -euo pipefail
CONF=${CONF:-math_7b}
# Node 0's address, taken from SLURM's own node list (no host-name conventions assumed).
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# launch.py reads SLURM_NODEID on each node; SLURM's CUDA_VISIBLE_DEVICES, when set, is split
# among the node's processes, not replaced.
srun --kill-on-bad-exit=1 bash -c "source .venv/bin/activate && python launch.py conf=$CONF world.nodes=$SLURM_NNODES $*"
