# The environment a multi-node run needs on every node. Sourced by launch_node.sh (and so by
# slurm.sbatch); every value is a default that a variable already set in the caller's
# environment overrides, so a cluster's own settings win.

# Rendezvous: node 0's address as the other nodes reach it, and a free TCP port there.
# torchrun's c10d rendezvous runs its store on node 0 at MASTER_ADDR:MASTER_PORT.
export MASTER_PORT="${MASTER_PORT:-29511}"

# NCCL. Set the network interface when the nodes have several (the one the nodes talk over,
# e.g. ib0 or eth0; `ip -br addr` lists them); NCCL otherwise picks one and may pick a
# management network. Leave InfiniBand on where there is one; NCCL_IB_DISABLE=1 forces TCP.
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"            # INFO prints the rings and the transport
# export NCCL_SOCKET_IFNAME=ib0                    # also GLOO_SOCKET_IFNAME for the CPU group
# export NCCL_IB_HCA=mlx5                          # which InfiniBand adapters NCCL may use
# export NCCL_IB_DISABLE=1                         # no InfiniBand: TCP sockets
# A collective that hangs (a node died) fails instead of waiting for ever.
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"

# One OpenMP thread per rank: eight ranks a node each spinning every core slow each other.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

# Models come from a cache every node can read (a shared file system), never the network
# mid-run: download once (`hf download stabilityai/stable-diffusion-3.5-medium`), then run
# offline. --model-path may be the hub id; it resolves from this cache.
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
# export HF_HOME=/shared/hf                        # the shared cache, if not ~/.cache/huggingface

# W&B's files on local scratch rather than the shared run directory (optional).
# export WANDB_DIR=/scratch/$USER/wandb
