"""Custom rewards as users have them: the Flow-GRPO reference's factory form, ``(scores, info)``
returns and float [B, 3, H, W] images; one call on a dummy batch in preflight, so a wrong
signature or return is one error before any model loads; values that are not numbers, or not
representable, refused; a deadline on every call into the user's code."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import fault_rewards
from trainer.config import ConfigError, load_config
from trainer.preflight.imports import check_imports
from trainer.rewards import (RewardError, build_reward_manager, build_reward_manager_from_config,
                             clear_reward_manager_cache)

B = 4
IMAGES = torch.arange(B * 6 * 10 * 3).remainder(251).to(torch.uint8).view(B, 6, 10, 3)
PROMPTS = ["a cat", "a dog", "two cups", "a red car"]
META = [{"sample_id": f"s{i}"} for i in range(B)]
SEEN: dict = {}


# ---- the reference's form, written as flow_grpo/rewards.py writes its rewards ----------------
def mean_pixel_score():
    """A factory: builds once, returns _fn; converts a float NCHW [0, 1] tensor back to uint8
    NHWC exactly as the reference's rewards do."""
    SEEN["built"] = SEEN.get("built", 0) + 1

    def _fn(images, prompts, metadata):
        SEEN["images"] = images
        if isinstance(images, torch.Tensor):
            images = (images * 255).round().clamp(0, 255).to(torch.uint8).cpu().numpy()
            images = images.transpose(0, 2, 3, 1)  # NCHW -> NHWC
        return np.array([float(im.mean()) for im in images]), {}

    return _fn


def device_factory(device):
    SEEN["device"] = device

    def _fn(images, prompts, metadata):
        return [float(len(p)) for p in prompts], {"note": "info is discarded"}

    return _fn


def multi_factory():
    def _fn(images, prompts, metadata):
        return {"words": [len(p.split()) for p in prompts], "chars": [len(p) for p in prompts]}, {}

    return _fn


multi_factory.components = ("words", "chars")


def star_args(*args):
    return [float(args[0].dtype == torch.uint8)] * len(args[1])


def uint8_factory():
    def _fn(images, prompts, metadata):
        return images.float().mean(dim=(1, 2, 3))

    return _fn


uint8_factory.image_layout = "uint8_bhwc"


# ---- shapes that preflight must refuse, each in one line --------------------------------------
def two_args(images, prompts):
    return [0.0] * len(prompts)


def returns_number(images, prompts, metadata):
    return 0.5


def returns_short(images, prompts, metadata):
    return [0.5]


def factory_of_nothing():
    return 3


def raises_inside(images, prompts, metadata):
    return [metadata[i]["include"] for i in range(len(prompts))]


def here(name):
    return f"{__name__}.{name}"


def tiny(*sets):
    # the tiny recipe without its toy scorer: the custom reward alone, weighed 1
    return load_config("tiny", ["reward.scorer_path=none", "reward.required_components=[]",
                                "reward.component_weights={}", *sets])


@pytest.fixture(autouse=True)
def _fresh():
    clear_reward_manager_cache()
    SEEN.clear()
    yield
    clear_reward_manager_cache()


def test_reference_factory_with_scores_info_return_and_its_image_layout():
    manager = build_reward_manager(scorer_path=None, model_path=None, runtime="cpu",
                                   custom_reward_path=here("mean_pixel_score"))
    assert manager.components == ("mean_pixel_score",) and SEEN["built"] == 1
    scores, _ = manager.score(IMAGES, PROMPTS, META)
    seen = SEEN["images"]
    assert seen.dtype == torch.float32 and seen.shape == (B, 3, 6, 10)
    assert 0.0 <= seen.min() and seen.max() <= 1.0
    torch.testing.assert_close(scores["mean_pixel_score"], IMAGES.float().mean(dim=(1, 2, 3)))
    manager.score(IMAGES, PROMPTS, META)
    assert SEEN["built"] == 1  # adapted once, not per call


def test_factory_taking_device_and_a_declared_dict_of_components():
    manager = build_reward_manager(scorer_path=None, model_path=None, runtime="cpu",
                                   custom_reward_path=here("device_factory"))
    assert SEEN["device"] == torch.device("cpu")
    assert manager.score(IMAGES, PROMPTS, META)[0]["device_factory"].tolist() == [5, 5, 8, 9]
    clear_reward_manager_cache()
    multi = build_reward_manager(scorer_path=None, model_path=None, runtime="cpu",
                                 custom_reward_path=here("multi_factory"))
    scores, _ = multi.score(IMAGES, PROMPTS, META)
    assert scores["words"].tolist() == [2, 2, 2, 3] and scores["chars"].tolist() == [5, 5, 8, 9]


def test_image_layout_is_the_functions_choice_and_star_args_is_a_batch_function():
    for name, expected in (("uint8_factory", IMAGES.float().mean(dim=(1, 2, 3))),
                           ("star_args", torch.ones(B))):
        clear_reward_manager_cache()
        manager = build_reward_manager(scorer_path=None, model_path=None, runtime="cpu",
                                       custom_reward_path=here(name))
        torch.testing.assert_close(manager.score(IMAGES, PROMPTS, META)[0][name], expected)


def test_preflight_runs_the_reference_factory_on_a_dummy_batch():
    check_imports(tiny(f"reward.custom_reward_path={here('mean_pixel_score')}"))
    assert SEEN["built"] == 1 and SEEN["images"].shape[1] == 3  # called, in its layout


@pytest.mark.parametrize("name, expected", [
    ("two_args", "takes ['images', 'prompts']; wanted fn(images, prompts, metadata)"),
    ("returns_number", "returned one number for a batch of 2"),
    ("returns_short", "expected shape [2], got [1]"),
    ("factory_of_nothing", "is a factory (takes nothing) but returned int, not a function"),
    ("raises_inside", "raised KeyError: 'include'"),
])
def test_a_wrong_signature_or_return_is_one_preflight_error(name, expected):
    with pytest.raises(ConfigError) as err:
        check_imports(tiny(f"reward.custom_reward_path={here(name)}"))
    lines = str(err.value).splitlines()
    assert len(lines) == 2 and expected in lines[1], str(err.value)
    assert "wanted fn(images, prompts, metadata)" in lines[1]


def test_launch_dry_run_refuses_a_wrong_return_before_any_model_loads(capsys):
    from trainer.launch import main
    code = main(["--config", "tiny", "--dry-run", "--set", "reward.scorer_path=none",
                 "--set", "reward.required_components=[]", "--set",
                 "reward.component_weights={}", "--set",
                 f"reward.custom_reward_path={here('returns_number')}"])
    err = capsys.readouterr().err
    assert code == 2 and "returned one number for a batch of 2" in err
    assert "Traceback" not in err


def test_numbers_as_strings_are_refused_not_coerced():
    manager = build_reward_manager(scorer_path=None, model_path=None, runtime="cpu",
                                   custom_reward_path="fault_rewards.strings")
    with pytest.raises(RewardError, match=r"values must be numbers .*\[0\]='0.5' \(str\)"):
        manager.score(IMAGES, PROMPTS, META)
    with pytest.raises(ConfigError, match="values must be numbers"):
        check_imports(tiny("reward.custom_reward_path=fault_rewards.strings"))


def test_a_reward_beyond_float32_is_refused_not_turned_into_inf():
    manager = build_reward_manager(scorer_path=None, model_path=None, runtime="cpu",
                                   custom_reward_path="fault_rewards.huge")
    with pytest.raises(RewardError, match=r"beyond float32's range .*\[0\]=1e\+300"):
        manager.score(IMAGES, PROMPTS, META)
    with pytest.raises(ConfigError, match="beyond float32's range"):
        check_imports(tiny("reward.custom_reward_path=fault_rewards.huge"))


@pytest.fixture
def release_hung_rewards():
    fault_rewards.RELEASE.clear()
    yield
    fault_rewards.RELEASE.set()


def test_a_hanging_reward_misses_its_deadline_naming_function_and_deadline(release_hung_rewards):
    manager = build_reward_manager(scorer_path=None, model_path=None, runtime="cpu",
                                   custom_reward_path="fault_rewards.hangs",
                                   custom_timeout_s=0.3)
    start = time.monotonic()
    with pytest.raises(RewardError) as err:
        manager.score(IMAGES, PROMPTS, META)
    assert time.monotonic() - start < 2.0
    assert "custom reward fault_rewards.hangs did not return within 0.3 s" in str(err.value)
    assert "reward.custom_timeout_s" in str(err.value)
    # preflight's dummy call is bounded by the same deadline
    with pytest.raises(ConfigError, match="fault_rewards.hangs did not return within 0.3 s"):
        check_imports(tiny("reward.custom_reward_path=fault_rewards.hangs",
                           "reward.custom_timeout_s=0.3"))


def test_the_config_deadline_reaches_the_manager(release_hung_rewards):
    cfg = tiny("reward.custom_reward_path=fault_rewards.hangs", "reward.custom_timeout_s=0.2")
    manager = build_reward_manager_from_config(cfg.reward)
    with pytest.raises(RewardError, match="within 0.2 s"):
        manager.score(IMAGES, PROMPTS, META)
    with pytest.raises(ConfigError, match=r"custom_timeout_s=0(\.0)? must be > 0"):
        check_imports(tiny("reward.custom_reward_path=fault_rewards.hangs",
                           "reward.custom_timeout_s=0"))


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_run_whose_reward_hangs_exits_1_naming_it(tmp_path):
    """Through the CLI on the toy recipe: the reward answers preflight, then hangs in the first
    rollout; the run stops at the deadline with one line, not silence or a traceback."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "trainer", "launch", "--config", "toy",
           "--set", f"logging.run_dir={tmp_path / 'run'}", "--set", "data.eval_prompt_data=none",
           "--set", "logging.progress=false", "--set", "logging.tensorboard=false",
           "--set", "rollout.rollout_batch_size=2", "--set", "train.num_rollouts=1",
           "--set", "reward.scorer_path=none", "--set", "reward.required_components=[]",
           "--set", "reward.component_weights={}",
           "--set", "reward.custom_reward_path=fault_rewards.hangs_after_preflight",
           "--set", "reward.custom_timeout_s=3"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(root / "tests")]),
               HF_HUB_OFFLINE="1")
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "error: rank 0: custom reward fault_rewards.hangs_after_preflight did not return " \
           "within 3 s (reward.custom_timeout_s)" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - start < 240
