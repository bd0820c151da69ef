"""Rewards: scorers (built-in, custom functions, remote), the cached manager that runs them,
and GRPO advantages from their components.

Built-in scorers by dotpath (their heavy imports happen only when one is built):
``trainer.rewards.pickscore.PickScoreScorer``, ``trainer.rewards.hps.HPSv2Scorer``,
``trainer.rewards.aesthetic.AestheticScorer``, ``trainer.rewards.clipscore.CLIPScoreScorer``,
``trainer.rewards.jpeg.JpegCompressibilityScorer`` / ``JpegIncompressibilityScorer``.
"""
from trainer.rewards.advantages import STD_MODES, compute_advantages
from trainer.rewards.base import RewardError, RewardScorer
from trainer.rewards.manager import (RUNTIMES, RewardManager, build_reward_manager,
                                     clear_reward_manager_cache)
from trainer.rewards.remote import RemoteRewardError, RemoteScorer, RewardServer

__all__ = [
    "RUNTIMES", "STD_MODES", "RemoteRewardError", "RemoteScorer", "RewardError", "RewardManager",
    "RewardScorer", "RewardServer", "build_reward_manager", "clear_reward_manager_cache",
    "compute_advantages",
]
