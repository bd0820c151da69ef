"""Preflight rules of ``train.algorithm`` and ``train.grpo_guard`` (docs/algorithms.md).

Each refusal says why the combination cannot work. Torch-free, like every preflight module.
"""
from __future__ import annotations

from trainer.algorithms.schedule import ALGORITHMS, GRPO_FAMILY, reachable_steps
from trainer.config.sampling import SamplingConfig
from trainer.preflight.checker import Checker, flagged
from trainer.utils.values import is_int, is_number


def check_algorithm(c: Checker) -> None:
    t = c.cfg.train
    if not c.one_of("train.algorithm", t.algorithm, ALGORITHMS):
        return
    sampling, problems = SamplingConfig.check(c.cfg.rollout.sampling)
    if sampling is None or problems:
        return  # _check_sampling reports them; the rules below need a valid table
    if t.grpo_guard:
        _check_guard(c, sampling)
    if t.algorithm in ("flowgrpo_fast", "mixgrpo"):
        _check_windows(c, sampling)
    if t.algorithm == "diffusionnft":
        _check_nft(c, sampling)
    if t.mix_flash_ratio is not None:
        _check_flash(c)


def _check_guard(c: Checker, sampling: SamplingConfig) -> None:
    t = c.cfg.train
    if t.algorithm not in GRPO_FAMILY:
        c.error(f"{flagged('train.grpo_guard')} applies to the clipped-ratio objective of "
                f"{', '.join(GRPO_FAMILY)}; {flagged('train.algorithm')}={t.algorithm!r} has no "
                "likelihood ratio")
    if t.anchor != "replay":
        c.error(f"{flagged('train.grpo_guard')} needs {flagged('train.anchor')}='replay': its ratio "
                "normalisation uses the old policy's transition mean, which the actor's replay "
                f"computes and the engine does not record (got {t.anchor!r})")
    if sampling.log_prob_form != "gaussian":
        c.error(f"{flagged('train.grpo_guard')} needs the Gaussian log-density: the mean shift "
                "|mean - mean_old|^2 / (2 std^2) it adds back is that density's; "
                "sde_type='cps' with cps_log_prob='reference' scores the squared residual")


def _check_windows(c: Checker, sampling: SamplingConfig) -> None:
    t = c.cfg.train
    steps = sampling.num_inference_steps
    name = t.algorithm
    if sampling.sde_step_mode != "indices":
        c.error(f"{flagged('train.algorithm')}={name!r} chooses the SDE steps itself; "
                f"rollout.sampling.sde_step_mode={sampling.sde_step_mode!r} would contradict it "
                "(use 'indices', whose steps then serve evaluation only)")
    if name == "flowgrpo_fast":
        ok = _check_fast(c, steps)
        if ok and not sampling.init_same_noise:
            c.warn(f"{flagged('train.algorithm')}='flowgrpo_fast' without "
                   "rollout.sampling.init_same_noise: every candidate has its own x_T, so there "
                   "is no shared trunk to compute once (the reference's same_latent=False); set "
                   "it to share x_T and the ODE trunk within a group")
    else:
        ok = _check_mix(c, steps)
    if not ok:
        return
    reach = reachable_steps(t, steps)
    if 0 in reach and sampling.sde_type == "sde" and sampling.sigma_one == "refuse":
        c.error(f"{flagged('train.algorithm')}={name!r} can put SDE noise on step 0 (sigma 1), "
                "where sde_type='sde' is singular with sigma_one='refuse'; start the window at "
                "step 1 or set rollout.sampling.sigma_one='clamp_to_next' (the reference)")
    if sampling.sde_type == "cps" and sampling.cps_log_prob == "gaussian" and steps - 1 in reach:
        c.error(f"{flagged('train.algorithm')}={name!r} can put noise on the last step, where "
                "sde_type='cps' has no variance (cps_log_prob='gaussian')")


def _check_fast(c: Checker, steps: int) -> bool:
    t = c.cfg.train
    rng, size = t.fast_branch_range, t.fast_branch_steps
    if not (isinstance(rng, (list, tuple)) and len(rng) == 2 and all(is_int(x) for x in rng)):
        c.error(f"{flagged('train.fast_branch_range')} must be a pair [lo, hi] of integers, "
                f"got {rng!r}")
        return False
    if not is_int(size) or size < 1:
        c.error(f"{flagged('train.fast_branch_steps')} must be an integer >= 1, got {size!r}")
        return False
    lo, hi = rng
    if not 0 <= lo < hi <= steps:
        c.error(f"{flagged('train.fast_branch_range')}={list(rng)} must satisfy 0 <= lo < hi <= "
                f"num_inference_steps={steps}")
        return False
    if size > hi - lo:
        c.error(f"{flagged('train.fast_branch_steps')}={size} is larger than the branch range "
                f"{list(rng)} ({hi - lo} steps): no window fits")
        return False
    return True


def _check_mix(c: Checker, steps: int) -> bool:
    t = c.cfg.train
    ok = True
    for key in ("mix_window_size", "mix_shift_interval", "mix_window_stride"):
        value = getattr(t, key)
        if not is_int(value) or value < 1:
            c.error(f"{flagged('train.' + key)} must be an integer >= 1, got {value!r}")
            ok = False
    if not ok:
        return False
    max_start = steps - 2  # MixGRPO: the window's start stops at num_steps - 2
    if max_start < 1:
        c.error(f"{flagged('train.algorithm')}='mixgrpo' needs num_inference_steps >= 3, got {steps}")
        return False
    if t.mix_window_size > max_start:
        c.error(f"{flagged('train.mix_window_size')}={t.mix_window_size} is larger than the "
                f"{max_start} steps a MixGRPO window can cover (num_inference_steps - 2 = "
                f"{max_start}: the last two steps are never SDE)")
        return False
    last_start = ((max(t.num_rollouts, 1) - 1) // t.mix_shift_interval) * t.mix_window_stride
    if not t.mix_roll_back and last_start >= max_start:
        c.error(f"{flagged('train.algorithm')}='mixgrpo': after rollout "
                f"{(max_start + t.mix_window_stride - 1) // t.mix_window_stride * t.mix_shift_interval} "
                f"the window reaches step {max_start} and holds no step to train (the reference "
                f"then trains nothing); set {flagged('train.mix_roll_back')}, a larger "
                f"{flagged('train.mix_shift_interval')} or fewer rollouts")
    return True


def _check_flash(c: Checker) -> None:
    t = c.cfg.train
    if t.algorithm != "mixgrpo":
        c.error(f"{flagged('train.mix_flash_ratio')} is MixGRPO-Flash's; "
                f"{flagged('train.algorithm')}={t.algorithm!r} has no window to follow")
    if not is_number(t.mix_flash_ratio) or not 0 < t.mix_flash_ratio <= 1:
        c.error(f"{flagged('train.mix_flash_ratio')} must be in (0, 1], got {t.mix_flash_ratio!r}")
    if c.cfg.rollout.engine != "embedded":
        c.error(f"{flagged('train.mix_flash_ratio')}: the Flash tail is run by the embedded "
                f"engine only ({flagged('rollout.engine')}={c.cfg.rollout.engine!r})")


def _check_nft(c: Checker, sampling: SamplingConfig) -> None:
    t = c.cfg.train
    for key in ("nft_beta", "nft_adv_clip_max"):
        value = getattr(t, key)
        if not is_number(value) or not value > 0:
            c.error(f"{flagged('train.' + key)} must be a number > 0, got {value!r}")
    if not is_int(t.nft_old_decay_delay) or t.nft_old_decay_delay < 0:
        c.error(f"{flagged('train.nft_old_decay_delay')} must be an integer >= 0, "
                f"got {t.nft_old_decay_delay!r}")
    if not is_number(t.nft_old_decay_ramp) or t.nft_old_decay_ramp < 0:
        c.error(f"{flagged('train.nft_old_decay_ramp')} must be a number >= 0, "
                f"got {t.nft_old_decay_ramp!r}")
    if not is_number(t.nft_old_decay_cap) or not 0 <= t.nft_old_decay_cap < 1:
        c.error(f"{flagged('train.nft_old_decay_cap')} must be in [0, 1), got "
                f"{t.nft_old_decay_cap!r} (1 would freeze the old policy for good)")
    if c.cfg.rollout.engine != "embedded":
        c.error(f"{flagged('train.algorithm')}='diffusionnft' trains on the final latents of "
                f"the ODE rollout, which only the embedded engine returns "
                f"({flagged('rollout.engine')}={c.cfg.rollout.engine!r})")
    if not is_int(t.micro_batch_size):
        c.error(f"{flagged('train.algorithm')}='diffusionnft' needs an integer "
                f"{flagged('train.micro_batch_size')} (got {t.micro_batch_size!r}): 'auto' "
                "measures the GRPO replay, not the NFT step")
    if sampling.sde_step_mode == "every_step" or sampling.sde_resample_per_rollout:
        what = ("sde_step_mode='every_step'" if sampling.sde_step_mode == "every_step"
                else "sde_resample_per_rollout=true")
        c.error(f"{flagged('train.algorithm')}='diffusionnft' samples its training rollouts "
                f"with the ODE and trains no SDE step; rollout.sampling.{what} asks for SDE "
                "steps in every training rollout, which it would never use (keep fixed "
                "sde_indices for an SDE eval, or none)")


LORA_INIT_A: tuple[str, ...] = ("kaiming", "gaussian")


def check_reference_options(c: Checker) -> None:
    """The two reference behaviours offered as options (lora.init_a, ema.per_micro_batch)."""
    c.one_of("lora.init_a", c.cfg.lora.init_a, LORA_INIT_A)
    if not isinstance(c.cfg.ema.per_micro_batch, bool):
        c.error(f"{flagged('ema.per_micro_batch')} must be true or false, "
                f"got {c.cfg.ema.per_micro_batch!r}")
