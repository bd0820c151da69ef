"""DiffusionNFT's old policy survives a resume: a checkpoint saves it as its own part
(``nft_old``) and a resumed run continues from it, not from a fresh copy of the loaded
weights (which the decay has moved it away from)."""
from __future__ import annotations

import json

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_single_thread")]

# the old policy lags the current weights by half after the first rollout (cap 0.5 reached at
# once), so it differs from the weights a resume loads
NFT = ["rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=4",
       "train.micro_batch_size=4", "train.num_rollouts=2", "logging.progress=false",
       "logging.tensorboard=false", "data.eval_max_prompts=4", "train.algorithm=diffusionnft",
       "train.nft_old_decay_ramp=1.0", 'rollout.sampling=' + json.dumps(
           {"sde_resample_per_rollout": False, "timestep_fraction": 0.2})]


def _trainer(tmp_path, name):
    from trainer.config import load_config
    from trainer.loop import Trainer

    cfg = load_config("toy", [*NFT, f"logging.run_dir={tmp_path / name}"])
    return Trainer(cfg, rank=0, world=1, device="cpu")


def test_the_old_policy_after_a_resume_is_the_one_saved(tmp_path):
    from trainer.checkpoint import load_checkpoint, save_checkpoint

    first = _trainer(tmp_path, "first")
    try:
        first.train_step(0)
        assert save_checkpoint(first.checkpointer, 1) is not None
        saved_old = {n: t.clone() for n, t in first.actor.nft_old.params.items()}
        saved_current = {n: p.detach().clone() for n, p in first.model.named_parameters()
                         if p.requires_grad}
        root = first.checkpointer.root
    finally:
        first.close()
    assert any(not torch.equal(saved_old[n], saved_current[n]) for n in saved_old)

    resumed = _trainer(tmp_path, "resumed")
    try:
        load_checkpoint(resumed.checkpointer, root)
        current = {n: p.detach() for n, p in resumed.model.named_parameters() if p.requires_grad}
        for name, tensor in saved_current.items():
            assert torch.equal(current[name], tensor), name
        old = resumed.actor.nft_old.params
        assert old.keys() == saved_old.keys()
        for name, tensor in saved_old.items():
            assert torch.equal(old[name], tensor), name
        resumed.train_step(1)  # the update runs against the restored copy
    finally:
        resumed.close()
