"""``TrainerState``: what a trainer carries across a checkpoint besides its weights and
optimizer (torchtitan's ``Stateful``): the counters below and this rank's RNG.

``state_dict()`` gives them under the names ``trainer_state.json`` stores (plus ``"rng"``, the
per-rank file's content); ``load_state_dict()`` restores them. The checkpointer holds this as
its ``state`` part and calls these two only. In ``trainer.loop.Trainer`` the counters are
read and set where the component moving them keeps them (``lr_steps``: the ``Actor``;
``policy_version``, ``sync_failures``, ``engine_restarts``: the ``RolloutService``); a test
double keeps them as plain attributes.

Design choices:

* ``load_state_dict`` brings the engine to the saved policy version by re-syncing the restored
  weights (``resync_engine``): the engine holds the base weights from construction, and the
  rollout driver refuses samples from an engine whose version differs from the trainer's.
* ``engine_restarts`` is saved for the record but not restored: the restart budget
  (``rollout.engine_max_restarts``) is per process, and a resumed run starts a fresh engine.
* The RNG is restored last, after everything else that might draw from it; ``"rng": None``
  (no file for this rank, a different world size) leaves it alone.
"""
from __future__ import annotations

from typing import Any

import torch

from trainer.checkpoint.layout import CheckpointError
from trainer.checkpoint.rng import capture_rng, restore_rng


class TrainerState:
    """Mixed into ``trainer.loop.Trainer`` (and test doubles): the counters start at 0."""

    policy_version: int = 0       # weights version the engine holds (one per successful sync)
    lr_steps: int = 0             # optimizer steps taken: the LR schedule's position
    next_rollout: int = 0         # the rollout the loop runs next
    sync_failures: int = 0        # weight syncs that failed (the engine kept the old version)
    checkpoint_failures: int = 0  # saves that failed (no COMMITTED marker was written)
    engine_restarts: int = 0      # engine restarts used of rollout.engine_max_restarts
    device: torch.device | None = None
    sender: Any = None            # the weight sender; None: no engine to re-sync (a test double)

    def counters(self) -> dict[str, int]:
        """The counters under their ``trainer_state.json`` names (no RNG: cheap per step)."""
        return {
            "rollout_id": int(self.next_rollout) - 1,
            "policy_version": int(self.policy_version),
            "lr_scheduler_steps": int(self.lr_steps),
            "weight_sync_failures": int(self.sync_failures),
            "checkpoint_failures": int(self.checkpoint_failures),
            "engine_restarts": int(self.engine_restarts),
        }

    def state_dict(self) -> dict[str, Any]:
        return {**self.counters(), "rng": capture_rng(self.device)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lr_steps = int(state["lr_scheduler_steps"])
        self.next_rollout = int(state["rollout_id"]) + 1
        self.checkpoint_failures = int(state.get("checkpoint_failures", 0))
        self.sync_failures = int(state.get("weight_sync_failures", 0))
        self.resync_engine(int(state["policy_version"]))
        if state.get("rng") is not None:
            restore_rng(state["rng"], self.device)

    def sync_weights(self, first: bool = False) -> None:
        raise NotImplementedError("a trainer with a weight sender syncs its own weights")

    def record_checkpoint_failure(self) -> int:
        """Count one failed save; returns the new count."""
        self.checkpoint_failures += 1
        return self.checkpoint_failures

    def resync_engine(self, version: int) -> None:
        """Push the current weights to the engine as policy ``version``.

        ``sync_weights()`` sends version ``policy_version + 1`` and advances to it only on
        success; the engine holds the base (version 0) from construction, so an ordinary step
        sync (adapter mode: the LoRA tensors) completes it. Version 0 (nothing synced before
        the save) repeats the first, full sync. Without a weight sender (a test double) only
        the version is set.
        """
        if self.sender is None:
            self.policy_version = version
            return
        getattr(self.sender, "request_full", lambda: None)()  # SGLang: a resume verifies whole
        if version == 0:
            self.sync_weights(first=True)
        else:
            self.policy_version = version - 1
            self.sync_weights()
        if self.policy_version != version:
            raise CheckpointError(f"re-syncing the engine to policy version {version} left "
                                  f"version {self.policy_version}")
