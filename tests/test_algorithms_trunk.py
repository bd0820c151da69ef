"""The engine's shared trunk (Flow-GRPO-Fast, MixGRPO): a group sharing x_T runs its ODE steps
before the branch once, and its candidates equal what the unshared sampler computes."""
from __future__ import annotations

import pytest
import torch

from engine_fixtures import ADAPTER_PATH, SAMPLING, FixtureAdapter, build_fixture_model_dir
from trainer.engine.embedded.process import launch_embedded_engine
from trainer.engine.embedded.sampler import denoise
from trainer.engine.embedded.trunk import plan_trunk
from trainer.models.geometry import Geometry

pytestmark = pytest.mark.usefixtures("torch_single_thread")

PROMPTS = ["a red panda"] * 3 + ["a teacup"] * 3
IDS = [f"prompt:{g}:sample:{s}" for g in (7, 9) for s in range(3)]
GROUPS = [0, 0, 0, 1, 1, 1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_fixture_model_dir(tmp_path_factory.mktemp("fixture_model_trunk"))


@pytest.fixture(scope="module")
def engine(model_dir):
    client = launch_embedded_engine(adapter_path=ADAPTER_PATH, model_path=str(model_dir),
                                    adapter_options=None, device="cpu", dtype="fp32", lora=None,
                                    in_process=True, share_trunk=True)
    yield client
    client.close()


def _request(adapter, sde):
    sampling = {**SAMPLING, "init_same_noise": True, "sde_indices": sde}
    return adapter.build_rollout_request(PROMPTS, IDS, sampling, rollout_id=3, seed=1234,
                                         sde_indices=sde, group_index=GROUPS)


def test_trunk_plan_shares_rows_with_one_x_t_and_prompt_only():
    plan = plan_trunk(["a", "a", "b", "b"], ["p", "p", "q", "q"], [2, 3])
    assert plan.unique == [0, 2] and plan.expand == [0, 0, 1, 1] and plan.branch_step == 2
    assert plan.forwards_saved() == 4 and plan.forwards_saved(cfg_halves=2) == 8
    assert plan_trunk(["a", "a"], ["p", "q"], [2]) is None      # other prompt: other trunk
    assert plan_trunk(["a", "b"], ["p", "p"], [2]) is None      # no shared x_T
    assert plan_trunk(["a", "a"], ["p", "p"], [0, 1]) is None   # branch at step 0: no trunk
    assert plan_trunk(None, ["p", "p"], [2]) is None


def test_engine_computes_the_trunk_once_and_matches_the_unshared_sampler(engine, model_dir):
    adapter = FixtureAdapter(str(model_dir))
    sde = [2, 3]
    request = _request(adapter, sde)
    extra = request["extra_sampling_params"]
    assert extra["initial_noise_ids"] == [IDS[0]] * 3 + [IDS[3]] * 3
    core = engine._transport.core
    rows_seen = []
    velocity = core.adapter.velocity

    def counting(model, x, *args, **kw):
        rows_seen.append(x.shape[0])
        return velocity(model, x, *args, **kw)
    core.adapter.velocity = counting
    try:
        response = engine.generate(request)
    finally:
        del core.adapter.velocity
    steps = SAMPLING["num_inference_steps"]
    # 2 trunk steps on 2 rows, then 4 steps on 6 rows: (6 - 2) * 2 = 8 forwards saved
    assert rows_seen == [2, 2] + [6] * (steps - 2)
    # the unshared sampler from the same x_T, noise and conditions
    seed = extra["initial_noise_seed"]
    cond = adapter.encode_prompts(core.frozen, PROMPTS)
    x_t = adapter.initial_latents(extra["initial_noise_ids"], Geometry(32, 32), seed=seed)
    shape = adapter.latent_shape(Geometry(32, 32))
    with torch.no_grad():
        ref = denoise(lambda x, s: adapter.velocity(core.transformer, x, s, cond, Geometry(32, 32)), x_t,
                      extra["sigmas"], sde, eta=0.7, sde_type="sde",
                      noise_fn=lambda i: adapter.step_noise(IDS, i, shape, seed=seed))
    torch.testing.assert_close(response["dit_trajectory"]["latents"], ref.trajectory,
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(response["rollout_log_probs"], ref.log_probs, rtol=1e-5, atol=1e-5)
    assert response["sde_indices"] == sde
    # the final latents travel with the trajectory (DiffusionNFT trains on them)
    torch.testing.assert_close(response["dit_trajectory"]["final"], ref.final, rtol=1e-5, atol=1e-6)
    batch = adapter.pack_trajectory(response, request)
    torch.testing.assert_close(batch.final_latents, ref.final, rtol=1e-5, atol=1e-6)
    assert batch.schedule.tolist() == pytest.approx(extra["sigmas"])
    from trainer.models.batch import concat_batches
    joined = concat_batches([batch.select([0, 1]), batch.select([5])])
    assert torch.equal(joined.final_latents, batch.final_latents[[0, 1, 5]])
    lat = response["dit_trajectory"]["latents"]
    # the group shares x at the branch step and differs after it
    assert torch.equal(lat[0, 0, 0], lat[1, 0, 0]) and not torch.equal(lat[0, 0, 1], lat[1, 0, 1])


def test_without_share_trunk_the_engine_runs_every_row_at_every_step(model_dir):
    adapter = FixtureAdapter(str(model_dir))
    client = launch_embedded_engine(adapter_path=ADAPTER_PATH, model_path=str(model_dir),
                                    adapter_options=None, device="cpu", dtype="fp32", lora=None,
                                    in_process=True)
    core = client._transport.core
    rows_seen = []
    velocity = core.adapter.velocity
    core.adapter.velocity = lambda model, x, *a, **k: rows_seen.append(x.shape[0]) or velocity(
        model, x, *a, **k)
    try:
        client.generate(_request(adapter, [2, 3]))
    finally:
        client.close()
    assert rows_seen == [6] * SAMPLING["num_inference_steps"]


def test_trunk_with_cfg_matches_the_unshared_engine(engine, model_dir):
    """CFG: the trunk's rows carry their negative halves too (one 2-row-per-x_T forward)."""
    adapter = FixtureAdapter(str(model_dir))
    sampling = {**SAMPLING, "init_same_noise": True, "sde_indices": [3, 4], "guidance_scale": 3.0}
    request = adapter.build_rollout_request(PROMPTS, IDS, sampling, rollout_id=5, seed=99,
                                            sde_indices=[3, 4], group_index=GROUPS)
    plain = launch_embedded_engine(adapter_path=ADAPTER_PATH, model_path=str(model_dir),
                                   adapter_options=None, device="cpu", dtype="fp32", lora=None,
                                   in_process=True)
    core = engine._transport.core
    rows_seen = []
    velocity = core.adapter.velocity
    core.adapter.velocity = lambda model, x, *a, **k: rows_seen.append(x.shape[0]) or velocity(
        model, x, *a, **k)
    try:
        shared = engine.generate(request)
        unshared = plain.generate(request)
    finally:
        del core.adapter.velocity
        plain.close()
    assert rows_seen == [4] * 3 + [12] * (SAMPLING["num_inference_steps"] - 3)
    torch.testing.assert_close(shared["dit_trajectory"]["latents"],
                               unshared["dit_trajectory"]["latents"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(shared["rollout_log_probs"], unshared["rollout_log_probs"],
                               rtol=1e-5, atol=1e-5)


def test_flash_takes_the_steps_after_the_window_with_the_solver_on_a_compressed_tail(model_dir):
    from flowgrpo_kernels.ode_solvers import engine_flash_tail, solve_tail

    adapter = FixtureAdapter(str(model_dir))
    sde = [1, 2]
    sampling = {**SAMPLING, "sde_indices": sde}
    request = adapter.build_rollout_request(PROMPTS, IDS, sampling, rollout_id=3, seed=1234,
                                            sde_indices=sde, group_index=GROUPS)
    extra = request["extra_sampling_params"]
    seed, sigmas = extra["initial_noise_seed"], extra["sigmas"]
    shape = adapter.latent_shape(Geometry(32, 32))
    client = launch_embedded_engine(adapter_path=ADAPTER_PATH, model_path=str(model_dir),
                                    adapter_options=None, device="cpu", dtype="fp32", lora=None,
                                    in_process=True, flash_ratio=0.5)
    core = client._transport.core
    rows_seen = []
    velocity = core.adapter.velocity
    core.adapter.velocity = lambda model, x, *a, **k: rows_seen.append(x.shape[0]) or velocity(
        model, x, *a, **k)
    try:
        response = client.generate(request)
        cond = adapter.encode_prompts(core.frozen, PROMPTS)

        def v(x, s):
            return adapter.velocity(core.transformer, x, torch.as_tensor(s).float().expand(6),
                                    cond, Geometry(32, 32))
        with torch.no_grad():
            head = denoise(v, adapter.initial_latents(IDS, Geometry(32, 32), seed=seed), sigmas[:4], sde,
                           eta=0.7, sde_type="sde",
                           noise_fn=lambda i: adapter.step_noise(IDS, i, shape, seed=seed))
            final, calls = solve_tail(head.final, v, engine_flash_tail(sigmas, 3, 0.5))
    finally:
        core.adapter.__dict__.pop("velocity", None)
        client.close()
    # steps 0..2 (through the window's last SDE step), then 6 - 3 = 3 steps compressed to
    # max(int(3 * 0.5), 2) = 2 points: one solver step instead of three Euler steps
    assert rows_seen == [6] * 4 and calls == 1
    torch.testing.assert_close(response["dit_trajectory"]["latents"], head.trajectory,
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(response["dit_trajectory"]["final"], final, rtol=1e-5, atol=1e-5)
