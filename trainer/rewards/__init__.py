"""Rewards: scorers (built-in, custom functions, remote), the cached manager that runs them,
and GRPO advantages from their components.

Built-in scorers, by short name in ``[reward.scorers.NAME]`` or by dotpath (their heavy
imports happen only when one is built): see ``trainer.rewards.spec.BUILTIN_SCORERS``. Custom
reward functions, in our form or the Flow-GRPO reference's: ``function``; clients of the
reference's reward servers: ``flowgrpo_server``; every HTTP request bounded: ``bounded_http``.
Video batches (uint8 [B, F, H, W, 3]): image scorers per frame under a stated aggregation,
the temporal-consistency term, and the dispatch between them: ``video``.

Names resolve lazily (PEP 562): ``trainer.rewards.spec``, which preflight imports, must not
pull torch in through this package.
"""
import importlib

_EXPORTS = {
    "STD_MODES": "trainer.rewards.advantages", "compute_advantages": "trainer.rewards.advantages",
    "RewardError": "trainer.rewards.base", "RewardScorer": "trainer.rewards.base",
    "RUNTIMES": "trainer.rewards.manager", "RewardManager": "trainer.rewards.manager",
    "build_reward_manager": "trainer.rewards.manager",
    "build_reward_manager_from_config": "trainer.rewards.manager",
    "clear_reward_manager_cache": "trainer.rewards.manager",
    "RemoteRewardError": "trainer.rewards.remote", "RemoteScorer": "trainer.rewards.remote",
    "RewardServer": "trainer.rewards.serve",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'trainer.rewards' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
