"""Several weighted scorers from ``[reward.scorers.NAME]`` tables: the TOML form, the old
single-scorer keys, the static and import stages of preflight (one line per problem), and the
built manager's weights feeding the advantages."""
from __future__ import annotations

import math

import pytest
import torch

from trainer.config import ConfigError, load_config
from trainer.preflight import preflight
from trainer.preflight.imports import check_imports
from trainer.rewards import build_reward_manager_from_config, clear_reward_manager_cache
from trainer.rewards.advantages import compute_advantages
from trainer.rewards.base import RewardScorer

TOML = """
[reward]
runtime = "cpu"
required_components = ["jpeg_incompressibility"]
component_weights = {}

[reward.scorers.jpeg_incompressibility]
weight = 2.0
quality = 80

[reward.scorers.ocr]
weight = 0.5
engine = "test_rewards_new_scorers.scripted_engine"
required = true

[reward.scorers.brightness]
path = "test_rewards_config.BrightnessScorer"
weight = 1.0
gain = 3.0
"""


class BrightnessScorer(RewardScorer):
    components = ("brightness",)

    def __init__(self, *, gain: float = 1.0, device=None):
        self.gain = gain

    def score(self, images, prompts, metadata):
        return {"brightness": self.gain * images.float().mean(dim=(1, 2, 3)) / 255}


def custom_area(images, prompts, metadata):
    return [float(images.shape[1] * images.shape[2])] * len(prompts)


@pytest.fixture(autouse=True)
def _fresh():
    clear_reward_manager_cache()
    yield
    clear_reward_manager_cache()


def recipe(tmp_path, text=TOML, extra=()):
    path = tmp_path / "r.toml"
    path.write_text(text)
    return _merge(path, extra)


def _merge(path, extra):
    # the tiny recipe with the reward section of ``path`` on top
    import tomllib
    data = tomllib.loads(path.read_text())
    sets = []
    for key, value in data["reward"].items():
        if key != "scorers":
            sets.append(f"reward.{key}={_json(value)}")
    sets.append(f"reward.scorers={_json(data['reward'].get('scorers', {}))}")
    return load_config("tiny", sets + list(extra))


def _json(v):
    import json
    return json.dumps(v) if not isinstance(v, str) else v


def test_scorer_tables_load_pass_both_stages_and_weigh_components(tmp_path):
    from test_rewards_new_scorers import SCRIPT
    cfg = recipe(tmp_path)
    assert cfg.reward.scorers["ocr"]["weight"] == 0.5
    preflight(cfg, world_size=1)
    check_imports(cfg)
    manager = build_reward_manager_from_config(cfg.reward)
    assert set(manager.components) == {"jpeg_incompressibility", "ocr", "brightness"}
    assert manager.weights == {"jpeg_incompressibility": 2.0, "ocr": 0.5, "brightness": 1.0}
    assert manager.required == ["jpeg_incompressibility", "ocr"]
    SCRIPT.clear()
    SCRIPT.update({v: [("cat", 0.9)] for v in range(256)})
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (4, 16, 16, 3), dtype=torch.uint8, generator=g)
    components, _ = manager.score(images, ['"cat"', '"dog"', '"cat"', '"cot"'], [{}] * 4)
    assert components["ocr"].tolist() == pytest.approx([1.0, 0.0, 1.0, 2 / 3])
    torch.testing.assert_close(components["brightness"],
                               3.0 * images.float().mean(dim=(1, 2, 3)) / 255)
    adv, _, failed = compute_advantages(components, torch.tensor([0, 0, 1, 1]),
                                        weights=manager.weights, required=manager.required,
                                        std_mode="group")
    assert not failed and adv.shape == (4,)
    # the OCR weight matters: halving it changes the advantages
    adv2, _, _ = compute_advantages(components, torch.tensor([0, 0, 1, 1]),
                                    weights={**manager.weights, "ocr": 0.25},
                                    required=manager.required, std_mode="group")
    assert not torch.allclose(adv, adv2)


def test_old_single_scorer_keys_still_work():
    cfg = load_config("tiny", ["reward.custom_reward_path=test_rewards_config.custom_area",
                               'reward.component_weights={"color": 1, "count": 1, '
                               '"position": 1, "custom_area": 0.5}'])
    preflight(cfg, world_size=1)
    check_imports(cfg)
    manager = build_reward_manager_from_config(cfg.reward)
    assert set(manager.components) == {"color", "count", "position", "custom_area"}
    assert manager.weights == {"color": 1.0, "count": 1.0, "position": 1.0, "custom_area": 0.5}


def test_a_custom_reward_without_a_weight_beside_component_weights_is_refused():
    """The tiny (and toy) recipe weighs its three toy components: a custom reward added
    beside them used to weigh 0 without a word, so training ignored it."""
    cfg = load_config("tiny", ["reward.custom_reward_path=test_rewards_config.custom_area"])
    with pytest.raises(ConfigError) as err:
        check_imports(cfg)
    assert "'custom_area' (reward.custom_reward_path) are produced but have no weight" \
        in str(err.value)
    clear_reward_manager_cache()
    with pytest.raises(ValueError, match="'custom_area' .* have no weight"):
        build_reward_manager_from_config(cfg.reward)  # the rank refuses it too
    # weight 0 says "log it, do not train on it" explicitly
    check_imports(load_config("tiny", [
        "reward.custom_reward_path=test_rewards_config.custom_area",
        'reward.component_weights={"color": 1, "count": 1, "position": 1, "custom_area": 0}']))


@pytest.mark.parametrize("sets, expected", [
    (['reward.scorers={"ocr": {"weight": "high"}}'],
     "reward.scorers.ocr.weight='high' must be a finite number"),
    (['reward.scorers={"pickscor": {"weight": 1}}'],
     "reward.scorers.pickscor: 'pickscor' is not a built-in scorer"),
    (['reward.scorers={"mine": {"path": "not a path"}}'],
     "reward.scorers.mine.path='not a path' is not a dotpath"),
    (['reward.scorers={"pickscore": {"model_path": "/nowhere/PickScore"}}'],
     "reward.scorers.pickscore.model_path='/nowhere/PickScore' does not exist"),
    (['reward.scorers={"ocr": {}}', "reward.scorer_path=trainer.rewards.hps.HPSv2Scorer"],
     "reward.scorer_path='trainer.rewards.hps.HPSv2Scorer' and [reward.scorers] are both set"),
])
def test_static_stage_names_each_problem(sets, expected):
    with pytest.raises(ConfigError) as err:
        preflight(load_config("tiny", sets), world_size=1)
    assert expected in str(err.value)


@pytest.mark.parametrize("sets, expected", [
    (['reward.scorers={"jpeg_incompressibility": {"qualty": 80}}'],
     "reward.scorers.jpeg_incompressibility: trainer.rewards.jpeg.JpegIncompressibilityScorer "
     "has no option(s) ['qualty'] (its options: ['quality'])"),
    (['reward.scorers={"mine": {"path": "test_rewards_config.Nope"}}'],
     "reward.scorers.mine: reward scorer path 'test_rewards_config.Nope': module "
     "'test_rewards_config' has no attribute 'Nope'"),
    (["reward.custom_reward_path=test_rewards_config.custom_aera"],
     "reward.custom_reward_path: custom reward path 'test_rewards_config.custom_aera'"),
    (['reward.scorers={"vlm_judge": {"model": "x"}}'],
     "reward.scorers.vlm_judge: trainer.rewards.vlm_judge.VLMJudgeScorer needs option(s) "
     "['endpoint']"),
    (['reward.scorers={"vlm_judge": {"endpoint": "localhost:8000"}}'],
     "endpoint='localhost:8000' is not an http(s) URL"),
    (['reward.scorers={"geneval": {"detector": "test_rewards_config.no_detector"}}'],
     "geneval detector 'test_rewards_config.no_detector'"),
    (['reward.scorers={"geneval": {}}'],
     "geneval needs detector = \"pkg.mod.make_detector\": no PyPI package we know ships a COCO "
     "detector's weights in its wheel"),
    (['reward.scorers={"toy": {"weight": 2}}', 'reward.component_weights={"color": 1}',
      "reward.required_components=[]"],
     "component 'color' is weighed twice"),
    (['reward.scorers={"ocr": {"engine": "test_rewards_new_scorers.scripted_engine"}}',
      'reward.required_components=["colour"]', 'reward.component_weights={}'],
     "required components ['colour'] are produced by no scorer"),
])
def test_import_stage_names_each_problem_in_one_line(sets, expected):
    # the tiny recipe's own toy weights and requirements cleared first
    cfg = load_config("tiny", ["reward.component_weights={}", "reward.required_components=[]"]
                      + sets)
    with pytest.raises(ConfigError) as err:
        check_imports(cfg)
    lines = str(err.value).splitlines()
    assert any(expected in line for line in lines), str(err.value)
    assert len(lines) <= 3  # the header and one line per problem, not a traceback


def test_launch_dry_run_fails_at_preflight_on_an_option_typo(capsys):
    from trainer.launch import main
    code = main(["--config", "tiny", "--dry-run", "--set",
                 'reward.scorers={"jpeg_compressibility": {"qualty": 5}}'])
    err = capsys.readouterr().err
    assert code == 2 and "has no option(s) ['qualty']" in err and "Traceback" not in err
