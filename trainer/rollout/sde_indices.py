"""Which denoising steps get SDE noise in one rollout: ``resolve_sde_indices``.

The rules live in ``trainer.config.sampling.SamplingConfig`` (one owner for every sampling key); this
is the rollout-side entry point. The resolved set decides where the engine injects noise; the
trained subset (``SamplingConfig.trained_steps``) is what the actor replays.
"""
from __future__ import annotations

from typing import Any, Mapping

from trainer.config.sampling import SamplingConfig, SamplingError


def resolve_sde_indices(sampling: "Mapping[str, Any] | SamplingConfig", *,
                        rollout_id: int | None) -> list[int]:
    """The sorted noise steps of one rollout (``rollout_id=None``: evaluation).

    Raises one ``ValueError`` listing every problem of the sampling table.
    """
    try:
        config = SamplingConfig.from_dict(sampling)
    except SamplingError as exc:
        raise ValueError("invalid SDE step configuration:\n  - "
                         + "\n  - ".join(exc.problems)) from None
    return config.noise_steps(rollout_id)
