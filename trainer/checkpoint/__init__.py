"""Crash-safe checkpoints (torch.distributed.checkpoint), exact resume, and export.

    Checkpointer(root, task, parts={"fsdp": actor, "ema": ema}, state=run_state, ...)
    save_checkpoint(checkpointer, step) -> Path | None   every rank; None = failed and counted
    load_checkpoint(checkpointer, path) -> Path          every rank; newest COMMITTED iteration
    latest_committed(path, task="t2i") -> Path | None

``python -m trainer export`` lives in ``trainer.checkpoint.export`` (imported on demand: it
needs diffusers and peft).
"""
from trainer.checkpoint.contract import ContractMismatchError
from trainer.checkpoint.layout import CheckpointError, latest_committed
from trainer.checkpoint.load import load_checkpoint
from trainer.checkpoint.save import Checkpointer, save_checkpoint

__all__ = ["Checkpointer", "save_checkpoint", "load_checkpoint", "latest_committed",
           "CheckpointError",
           "ContractMismatchError"]
