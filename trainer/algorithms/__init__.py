"""The training algorithms beside Flow-GRPO (``train.algorithm``, ``train.grpo_guard``): which
steps a rollout samples with SDE noise and trains (``schedule``), the engine's shared trunk
(``trainer.engine.embedded.trunk``) and the GRPO-Guard loss of a micro-batch (``guard_step``).
The maths is in ``flowgrpo_kernels`` (nft, guard, windows, ode_solvers); docs/algorithms.md
gives each formula, its source and every departure. Torch-free at import: preflight reads
``ALGORITHMS``.
"""
from trainer.algorithms.schedule import (ALGORITHMS, GRPO_FAMILY, algorithm_noise_steps,
                                         training_sampling)

__all__ = ["ALGORITHMS", "GRPO_FAMILY", "algorithm_noise_steps", "training_sampling"]
