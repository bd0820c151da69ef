"""kernels.check_schedule: a whole sampling schedule checked on the host, as each step's own
validation would check it, and the engine's sampler checking its schedule before any forward."""
from __future__ import annotations

import pytest
import torch

import flowgrpo_kernels as kernels


@pytest.mark.parametrize("sde_type,eta", [("sde", 0.7), ("cps", 0.5), ("cps", 1.5), ("dance", 0.3)])
def test_check_schedule_agrees_with_each_steps_own_validation(sde_type, eta):
    """kernels.check_schedule raises exactly when some step of the schedule would fail
    sde_step's own validation with float sigmas, and names every such step."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 8, generator=gen)
    schedules = [[1.0, 0.8, 0.5, 0.2, 0.0], [1.0, 0.8, 0.8, 0.2, 0.0], [1.2, 0.8, 0.5, 0.0],
                 [0.9, 0.5, 0.6, 0.1, 0.0], [1.0, float("nan"), 0.3, 0.0]]
    for sigmas in schedules:
        for sde_steps in ([], [0], [1, 2], list(range(len(sigmas) - 1))):
            bad = []
            for i in range(len(sigmas) - 1):
                stochastic = i in sde_steps
                try:
                    kernels.sde_step(x, x, sigmas[i], sigmas[i + 1],
                                     eta=eta if stochastic else 0.0,
                                     sde_type=sde_type if stochastic else "ode",
                                     noise=torch.zeros_like(x), backend="torch")
                except ValueError:
                    bad.append(i)
            if not bad:
                kernels.check_schedule(sigmas, sde_steps, eta=eta, sde_type=sde_type)
                continue
            with pytest.raises(ValueError) as err:
                kernels.check_schedule(sigmas, sde_steps, eta=eta, sde_type=sde_type)
            named = [i for i in range(len(sigmas) - 1) if f"step {i} (" in str(err.value)]
            assert named == bad, (sigmas, sde_steps, str(err.value))


def test_denoise_checks_its_schedule_before_any_forward():
    """The engine's sampler checks the whole schedule on the host up front (its steps then
    skip validation, which with sigma tensors syncs): a bad step late in the schedule fails
    before the first velocity call."""
    from trainer.engine.embedded.sampler import denoise

    calls = []

    def velocity(x, sigma):
        calls.append(1)
        return torch.zeros_like(x)

    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"step 2 \(0.5 -> 0.6\)"):
        denoise(velocity, x, [1.0, 0.8, 0.5, 0.6, 0.0], [1], eta=0.7, sde_type="sde",
                noise_fn=lambda i: torch.zeros_like(x))
    assert calls == []
    out = denoise(velocity, x, [1.0, 0.8, 0.5, 0.2, 0.0], [1], eta=0.7, sde_type="sde",
                  noise_fn=lambda i: torch.zeros_like(x))
    assert len(calls) == 4 and out.log_probs.shape == (2, 1)
