"""The engine's compile warm-up geometry, read from the resolved (typed) sampling config.

CUDA runs compile the engine's blocks by default and ask ``engine_warmup`` for the geometry
before the first rollout; on the CPU nothing compiles under ``auto``, so this asks with
``blocks`` to reach the same code."""
from __future__ import annotations

import torch

from trainer.config import load_config
from trainer.rollout.service import engine_warmup

CPU = torch.device("cpu")


def test_warmup_geometry_comes_from_the_sampling_section():
    cfg = load_config("qwen-image-t2i-lora", [
        'rollout.sampling={"height": 512, "width": 448, "guidance_scale": 1.0}'])
    warm = engine_warmup(cfg.rollout, "blocks", CPU)
    assert warm == {"height": 512, "width": 448,
                    "batch": (cfg.rollout.wave_size or 1) * cfg.rollout.n_samples_per_prompt}


def test_cfg_doubles_the_warmup_batch_and_auto_skips_on_cpu():
    cfg = load_config("qwen-image-t2i-lora", ['rollout.sampling={"guidance_scale": 4.0}'])
    warm = engine_warmup(cfg.rollout, "blocks", CPU)
    assert warm["batch"] == 2 * (cfg.rollout.wave_size or 1) * cfg.rollout.n_samples_per_prompt
    assert engine_warmup(cfg.rollout, "auto", CPU) is None
