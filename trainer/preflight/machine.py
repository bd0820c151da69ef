"""Preflight of the machine the launch runs on: does it have the GPUs the config asks for?

The static rules check a config against itself; these check it against this host, so an
8-GPU CUDA recipe launched (or ``--dry-run``) on a machine with fewer GPUs fails before any
process starts, with the reason and the ways out. On a multi-node launch each node runs its
own launch, so each checks its own GPUs against the ranks it starts (``launch.nproc``).
"""
from __future__ import annotations


def visible_gpu_count() -> int:
    """CUDA GPUs this process can use (CUDA_VISIBLE_DEVICES honoured)."""
    import torch  # local: the rest of preflight is torch-free; launch imports torch anyway
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_problems(*, device: str, nproc: int, nproc_given: bool,
                    gpu_count: int | None = None) -> list[str]:
    """Problems of running ``nproc`` ranks on ``device`` here (empty when it can)."""
    if device != "cuda":
        return []
    count = visible_gpu_count() if gpu_count is None else gpu_count
    if count >= nproc:
        return []
    source = "launch.nproc (--nproc)" if nproc_given else "the ranks per node"
    if count == 0:
        have = "this machine has no CUDA GPU (torch.cuda.is_available() is False)"
    else:
        have = f"this machine has {count} visible CUDA GPU(s)"
    return [f"launch.device='cuda' with {source}={nproc} needs {nproc} CUDA GPUs on each node, "
            f"and {have}: run it on a machine with {nproc} GPUs, lower --nproc (and the batch "
            f"sizes with it), or run on CPU with --set launch.device=cpu"]
