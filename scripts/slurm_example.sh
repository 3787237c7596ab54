#!/usr/bin/env bash
# Example SLURM job: start Ray on the allocation the standard way (the head on the first node,
# a worker on each of the others), then run the driver once, on the head. The node count comes
# from the job, so one script serves every config:
#   sbatch --nodes=2 scripts/slurm_example.sh            # CONF=math_7b (the default)
#   CONF=math_32b sbatch --nodes=4 scripts/slurm_example.sh
# Check the placement first: python launch.py conf=math_32b --dry-run
# The checkout (with its .venv) and run_dir must be on a file system every node shares.
#SBATCH --job-name=pipeline_rl
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
set -euo pipefail
CONF=${CONF:-math_7b}
RAY_PORT=${RAY_PORT:-6379}
source .venv/bin/activate
nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
head=${nodes[0]}
head_ip=$(srun --nodes=1 --ntasks=1 -w "$head" hostname --ip-address | awk '{print $1}')
export RAY_ADDRESS="$head_ip:$RAY_PORT"

# `--block` keeps each `ray start` in the foreground of its srun step, so SLURM tracks it and
# ends it with the job. The workers wait for the head's GCS to answer before they join.
srun --nodes=1 --ntasks=1 -w "$head" \
    ray start --head --node-ip-address="$head_ip" --port="$RAY_PORT" \
    --num-cpus="$SLURM_CPUS_PER_TASK" --num-gpus="$SLURM_GPUS_PER_NODE" --include-dashboard=false --block &
for node in "${nodes[@]:1}"; do
    srun --nodes=1 --ntasks=1 -w "$node" \
        ray start --address="$RAY_ADDRESS" \
        --num-cpus="$SLURM_CPUS_PER_TASK" --num-gpus="$SLURM_GPUS_PER_NODE" --block &
done
# Until every node has joined (the driver would otherwise wait for the placement group anyway).
until [ "$(python -c 'import ray; ray.init(logging_level="ERROR"); print(len([n for n in ray.nodes() if n["Alive"]]))' 2>/dev/null)" = "$SLURM_NNODES" ]; do
    sleep 5
done

# One driver for the whole run; it places every process through Ray. Redis (start_server) runs
# beside trainer rank 0 on whichever node Ray puts it.
python launch.py conf="$CONF" world.nodes="$SLURM_NNODES" "$@"
