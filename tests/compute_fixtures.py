"""What the model-compute tests share: a one-block fixture model, one recorded rollout batch
of it (8 samples, 2 groups), a LoRA config and a stand-in trainer for ``update.train_on``."""
from __future__ import annotations

import pytest
import torch

from engine_fixtures import (ADAPTER_PATH, FixtureAdapter, build_fixture_model_dir,
                             make_request)
from trainer.actor.actor import Actor
from trainer.actor.model import build_optimizer
from trainer.config import load_config
from trainer.engine import launch_embedded_engine

PROMPTS = ["a red panda"] * 4 + ["a teacup"] * 4
IDS = [f"prompt:{g}:sample:{s}" for g in (7, 9) for s in range(4)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_fixture_model_dir(tmp_path_factory.mktemp("compute_model"))


@pytest.fixture(scope="module")
def adapter(model_dir):
    return FixtureAdapter(str(model_dir))


@pytest.fixture(scope="module")
def batch(model_dir, adapter):
    engine = launch_embedded_engine(adapter_path=ADAPTER_PATH, model_path=str(model_dir),
                                    adapter_options=None, device="cpu", dtype="fp32",
                                    lora=None, in_process=True)
    try:
        request = make_request(adapter, PROMPTS, IDS)
        return adapter.pack_trajectory(engine.generate(request), request)
    finally:
        engine.close()


def lora_cfg(*sets):
    return load_config(None, ["lora.rank=4", "lora.alpha=8", "fsdp.trainable_mode=lora",
                              "fsdp.param_dtype=fp32", "fsdp.master_dtype=fp32",
                              "train.num_updates_per_batch=2", "train.lr=0.05",
                              "train.clip_grad=1e9", "train.eps_clip=0.5", *sets])


def stand_in_trainer(adapter, cfg, model):
    """The actor ``update.train_on`` takes, on the CPU, without EMA."""
    return Actor(adapter, model, build_optimizer(model, cfg.train), train=cfg.train,
                 fsdp=cfg.fsdp, device="cpu", trainable_only=cfg.lora.rank > 0)
