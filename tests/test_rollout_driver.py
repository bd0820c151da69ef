"""The rollout driver: groups, stable sample ids, waves over engines, sidecar round trip,
retention, evaluation, and every input error at once."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from engine_fixtures import ADAPTER_PATH, SAMPLING, FixtureAdapter, build_fixture_model_dir
from trainer.engine import launch_embedded_engine
from trainer.rollout import RolloutDriver, load_group_sidecar, prune_stale_artifacts

pytestmark = pytest.mark.usefixtures("torch_single_thread")

RECORDS = [{"prompt": p, "metadata": {"prompt_id": f"pid{i}", "source": "test"}}
           for i, p in enumerate(["a red panda", "a teacup", "a lighthouse"])]
N = 2
TRAIN_SAMPLING = {**SAMPLING, "sde_resample_per_rollout": True, "num_sde_steps": 2,
                  "sde_pool": [1, 2, 3, 4]}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model_dir = build_fixture_model_dir(tmp_path_factory.mktemp("fixture_rollout"))
    engines = [launch_embedded_engine(adapter_path=ADAPTER_PATH, model_path=str(model_dir),
                                      adapter_options=None, device="cpu", dtype="fp32", lora=None,
                                      in_process=True) for _ in range(2)]
    yield FixtureAdapter(str(model_dir)), engines
    for e in engines:
        e.close()


def _driver(adapter, engines, **kw):
    kw.setdefault("sampling", TRAIN_SAMPLING)
    return RolloutDriver(adapter, engines, seed=42, task="t2i", **kw)


def test_batch_layout_and_stable_ids(setup):
    adapter, engines = setup
    driver = _driver(adapter, engines[:1])
    batch = driver.generate(RECORDS, N, rollout_id=5, policy_version=0)
    assert len(batch) == 6 and batch.images.shape == (6, 32, 32, 3)
    assert batch.sample_ids == [f"prompt:pid{g}:sample:{s}" for g in range(3) for s in range(N)]
    assert batch.group_index.tolist() == [0, 0, 1, 1, 2, 2]
    assert batch.prompts == [r["prompt"] for r in RECORDS for _ in range(N)]
    want = sorted(np.random.default_rng(5).choice(np.array([1, 2, 3, 4]), 2, replace=False).tolist())
    assert batch.sde_indices == want and batch.log_probs.shape == (6, 2)
    assert batch.rollout_id == 5 and batch.policy_version == 0
    meta = batch.metadata[3]
    assert meta["source"] == "test" and meta["slot"] == 1 and meta["group_index"] == 1
    assert meta["sample_id"] == "prompt:pid1:sample:1" and len(meta["sampling_fingerprint"]) == 16
    positional = _driver(adapter, engines[:1], sample_id_mode="positional")
    assert positional.sample_ids(RECORDS, 2)[2] == ["prompt:2:sample:0", "prompt:2:sample:1"]


def test_init_same_noise_shares_x_t_within_a_group_only(setup):
    """init_same_noise: a group's candidates start from one x_T (the first candidate's), their
    SDE step noise still differs; other groups and the default are unaffected."""
    adapter, engines = setup
    sampling = {**TRAIN_SAMPLING, "sde_pool": [1, 2], "num_sde_steps": 1}
    shared = _driver(adapter, engines[:1], sampling={**sampling, "init_same_noise": True})
    own = _driver(adapter, engines[:1], sampling=sampling)
    a = shared.generate(RECORDS, N, rollout_id=3, policy_version=0, write_artifacts=False)
    b = own.generate(RECORDS, N, rollout_id=3, policy_version=0, write_artifacts=False)
    step = a.sde_indices[0]
    x_in = a.latents[:, 0]  # x at the first SDE step: only ODE steps (and x_T) before it
    for g in range(len(RECORDS)):
        r0, r1 = 2 * g, 2 * g + 1
        assert torch.equal(x_in[r0], x_in[r1]), f"group {g} does not share x_T (step {step})"
        assert not torch.equal(a.next_latents[r0, 0], a.next_latents[r1, 0])  # own step noise
        assert not torch.equal(b.latents[r0, 0], b.latents[r1, 0])            # default: own x_T
    assert not torch.equal(x_in[0], x_in[2])  # groups differ
    assert torch.equal(a.latents[0::2], b.latents[0::2])  # slot 0 keeps its own x_T
    request = adapter.build_rollout_request(["p", "p", "q"], ["i0", "i1", "j0"],
                                            {**SAMPLING, "init_same_noise": True}, rollout_id=0,
                                            seed=1, group_index=[0, 0, 1])
    assert request["extra_sampling_params"]["initial_noise_ids"] == ["i0", "i0", "j0"]
    evaluation = adapter.build_rollout_request(["p", "p"], ["i0", "i1"],
                                               {**SAMPLING, "init_same_noise": True},
                                               rollout_id=None, seed=1, group_index=[0, 0])
    assert "initial_noise_ids" not in evaluation["extra_sampling_params"]  # eval: own x_T
    with pytest.raises(ValueError, match="init_same_noise needs driver_xt"):
        adapter.build_rollout_request(["p"], ["i0"], {**SAMPLING, "init_same_noise": True,
                                                      "driver_xt": False}, rollout_id=0, seed=1)


def test_waves_over_engines_give_the_same_rollout(setup):
    adapter, engines = setup
    one = _driver(adapter, engines[:1]).generate(RECORDS, N, rollout_id=1, policy_version=0)
    two = _driver(adapter, engines).generate(RECORDS, N, rollout_id=1, policy_version=0,
                                             progress=True)
    assert torch.equal(one.latents, two.latents) and torch.equal(one.log_probs, two.log_probs)
    assert torch.equal(one.images, two.images) and one.sample_ids == two.sample_ids
    # a request of two groups: same ids and steps, a valid batch (numerics may differ with
    # the batch, so only the layout is compared)
    wide = _driver(adapter, engines, wave_size=2).generate(RECORDS, N, rollout_id=1, policy_version=0)
    assert wide.sample_ids == one.sample_ids and wide.group_index.tolist() == one.group_index.tolist()
    assert engines[0].health()["generate_calls"] > 0 and engines[1].health()["generate_calls"] > 0


def test_sidecar_round_trip_and_retention(setup, tmp_path):
    adapter, engines = setup
    driver = _driver(adapter, engines, artifact_root=str(tmp_path), retention=2)
    batches = {r: driver.generate(RECORDS, N, rollout_id=r, policy_version=0) for r in range(4)}
    task_dir = tmp_path / "t2i"
    assert sorted(p.name for p in task_dir.iterdir()) == ["rollout_0000002", "rollout_0000003"]
    directory = task_dir / "rollout_0000003"
    files = sorted(p.name for p in directory.iterdir())
    assert files == sorted([f"group_{g:08d}.safetensors" for g in range(3)]
                           + [f"group_{g:08d}_sample_{s:04d}.png" for g in range(3) for s in range(N)])
    batch = batches[3]
    for g in range(3):
        rows = load_group_sidecar(directory / f"group_{g:08d}.safetensors")
        idx = list(range(g * N, (g + 1) * N))
        ref = batch.select(idx)
        for field in ("latents", "next_latents", "log_probs", "sigmas", "sigmas_next", "images"):
            assert torch.equal(getattr(rows, field), getattr(ref, field)), field
        assert rows.sample_ids == ref.sample_ids and rows.sde_indices == ref.sde_indices
        assert rows.group_index.tolist() == [g] * N and rows.rollout_id == 3
        for key in ref.conditions:
            assert torch.equal(rows.conditions[key], ref.conditions[key]), key
        assert rows.metadata[0]["weight_checksum"] == engines[0].checksum()
        png = np.asarray(Image.open(directory / f"group_{g:08d}_sample_0001.png"))
        assert np.array_equal(png, batch.images[g * N + 1].numpy())
    assert batch.metadata[0]["sidecar"].endswith("rollout_0000003/group_00000000.safetensors")
    # evaluation writes beside, under eval/, named by policy version, and prunes nothing
    driver.generate(RECORDS[:1], 1, rollout_id=None, policy_version=0)
    assert (tmp_path / "eval" / "t2i" / "rollout_0000000" / "group_00000000.safetensors").exists()
    assert sorted(p.name for p in task_dir.iterdir()) == ["rollout_0000002", "rollout_0000003"]
    # no artifacts when asked not to
    driver.generate(RECORDS[:1], 1, rollout_id=4, policy_version=0, write_artifacts=False)
    assert not (task_dir / "rollout_0000004").exists()


def test_prune_stale_artifacts(tmp_path):
    for rid in (1, 2, 3, 4, 9):
        (tmp_path / f"rollout_{rid:07d}").mkdir()
    (tmp_path / "notes").mkdir()
    removed = prune_stale_artifacts(tmp_path, current_rollout_id=4, retention=2)
    assert sorted(p.name for p in removed) == ["rollout_0000001", "rollout_0000002",
                                               "rollout_0000004", "rollout_0000009"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "rollout_0000003"]
    (tmp_path / "rollout_0000000").mkdir()
    assert prune_stale_artifacts(tmp_path, current_rollout_id=5, retention=0) == []


def test_evaluation_uses_the_fixed_indices(setup):
    adapter, engines = setup
    batch = _driver(adapter, engines[:1]).generate(RECORDS[:1], 2, rollout_id=None, policy_version=0)
    assert batch.sde_indices == SAMPLING["sde_indices"] and batch.rollout_id is None


def test_bad_input_is_reported_at_once(setup):
    adapter, engines = setup
    with pytest.raises(ValueError) as info:
        RolloutDriver(adapter, [], sampling={**SAMPLING, "sde_indices": [0]}, seed="s", task="a/b",
                      wave_size=0, sample_id_mode="random")
    text = str(info.value)
    for fragment in ("no engines", "seed must be", "task must be", "wave_size", "sample_id_mode",
                     "SDE step 0"):
        assert fragment in text, fragment
    driver = _driver(adapter, engines[:1])
    with pytest.raises(ValueError) as info:
        driver.generate([{"prompt": 3}, {"metadata": {}}], 0, rollout_id=0, policy_version=0)
    assert "n_samples_per_prompt" in str(info.value) and "record 1" in str(info.value)
    twins = [{"prompt": "a", "metadata": {"prompt_id": "same"}}, {"prompt": "b", "metadata": {"prompt_id": "same"}}]
    with pytest.raises(ValueError, match="duplicate sample ids"):
        driver.generate(twins, 2, rollout_id=0, policy_version=0)
    with pytest.raises(RuntimeError, match="stale weights"):
        driver.generate(RECORDS[:1], 1, rollout_id=0, policy_version=3)
