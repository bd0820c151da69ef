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


def test_cpu_threads_follow_the_budget_the_run_was_given(monkeypatch):
    """A run started with OMP_NUM_THREADS (a sweep gives each of its side-by-side runs one
    thread) splits that budget between trainer and engine, not the machine's cores; an engine
    restart, which calls the split again, does not halve it twice."""
    import os

    import torch

    from trainer.rollout import service

    before = torch.get_num_threads()
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    try:
        for preset, world, want in (("4", 1, 2), ("4", 2, 1), ("1", 1, 1), ("", 1, 8)):
            service.cpu_thread_budget.cache_clear()
            monkeypatch.setenv("OMP_NUM_THREADS", preset)
            for _ in range(2):  # the second call is an engine restart's
                service.share_cpu_cores(world)
                assert torch.get_num_threads() == want, (preset, world)
                assert os.environ["OMP_NUM_THREADS"] == str(want)
    finally:
        service.cpu_thread_budget.cache_clear()
        torch.set_num_threads(before)
