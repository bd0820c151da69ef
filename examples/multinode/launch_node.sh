#!/usr/bin/env bash
# Start this node's part of a multi-node run: `python -m trainer launch` with torchrun's
# multi-node flags, on every node, with the same arguments. Run from the repository root.
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0.cluster RECIPE=sd3-t2i-lora \
#       bash examples/multinode/launch_node.sh --set logging.run_dir=/shared/runs/sd3
#   (and NODE_RANK=1 on the second node)
#
# Needs: NNODES, NODE_RANK (0..NNODES-1), MASTER_ADDR (node 0's address). Optional:
# MASTER_PORT (29511), NPROC_PER_NODE (8, the GPUs of a node), RECIPE (sd3-t2i-lora).
# Arguments are passed to `launch` (--set section.key=value, short flags).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=env.sh
source "$here/env.sh"

missing=()
for name in NNODES NODE_RANK MASTER_ADDR; do
    [[ -n "${!name:-}" ]] || missing+=("$name")
done
if (( ${#missing[@]} )); then
    echo "launch_node.sh: set ${missing[*]} (NNODES: the node count, NODE_RANK: this node's" \
         "index from 0, MASTER_ADDR: node 0's address)" >&2
    exit 2
fi

exec "${PYTHON:-python}" -m trainer launch --config "${RECIPE:-sd3-t2i-lora}" \
    --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc "${NPROC_PER_NODE:-8}" \
    --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" "$@"
