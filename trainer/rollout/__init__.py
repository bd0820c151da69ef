"""The rollout driver: SDE-step resolution, candidate ids, waves over engines, artifacts.

    from trainer.rollout import RolloutDriver, resolve_sde_indices, prune_stale_artifacts
"""
from trainer.rollout.artifacts import load_group_sidecar, prune_stale_artifacts
from trainer.rollout.driver import RolloutDriver
from trainer.rollout.sde_indices import resolve_sde_indices

__all__ = ["RolloutDriver", "load_group_sidecar", "prune_stale_artifacts", "resolve_sde_indices"]
