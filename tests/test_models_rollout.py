"""The adapter contract end to end on the tiny Qwen-Image model: a request is served by a
minimal in-test sampler (x_T and step noise from the adapter's recipe, kernels.sde_step at the
SDE steps, the Euler step elsewhere), the response is packed, and replaying the packed batch
through adapter.velocity + kernels.sde_log_prob gives back the recorded log-probs exactly."""
from __future__ import annotations

import pytest
import torch

import flowgrpo_kernels as kernels
from trainer.models import adapter_class
from trainer.models.geometry import Geometry

pytestmark = pytest.mark.usefixtures("torch_single_thread")
H = W = 32


def serve(adapter, frozen, transformer, request, *, device="cpu", dtype=torch.float32,
          backend="torch") -> dict:
    """What an engine does with a request, written plainly (the engine's own tests cover it)."""
    extra = request["extra_sampling_params"]
    ids, seed = extra["sample_ids"], extra["initial_noise_seed"]
    sde = set(request["rollout_sde_step_indices"])
    sigmas = torch.tensor(extra["sigmas"], device=device)
    cond = adapter.encode_prompts(frozen, request["prompt"])
    x = adapter.initial_latents(ids, Geometry(H, W), seed=seed, dtype=dtype, device=device)
    pairs, log_probs = [], []
    with torch.no_grad():
        for i in range(request["num_inference_steps"]):
            v = adapter.velocity(transformer, x, sigmas[i].expand(len(ids)), cond, Geometry(H, W))
            if i in sde:
                out = kernels.sde_step(x, v, sigmas[i].expand(len(ids)), sigmas[i + 1].expand(len(ids)),
                                       eta=request["rollout_noise_level"],
                                       sde_type=request["rollout_sde_type"], backend=backend,
                                       noise=adapter.step_noise(ids, i, extra["latent_shape"], seed=seed,
                                                                device=device))
                pairs.append(torch.stack([x, out.prev_sample], dim=1))
                log_probs.append(out.log_prob)
                x = out.prev_sample
            else:  # the Euler step exactly as diffusers' scheduler writes it (dt * v in v's dtype)
                x = (x.float() + (sigmas[i + 1] - sigmas[i]) * v).to(dtype)
    return {
        "rollout_log_probs": torch.stack(log_probs, dim=1),
        "dit_trajectory": {"latents": torch.stack(pairs, dim=1), "sigmas": sigmas,
                           "timesteps": adapter.timesteps_from_sigmas(sigmas)},
        "denoising_env": cond,
        "sde_indices": sorted(sde), "height": H, "width": W, "sample_ids": list(ids),
        "images": adapter.decode(frozen, x, Geometry(H, W)),
    }


@pytest.mark.parametrize("sde_type, indices, dtype", [("sde", [1, 3], torch.float32),
                                                     ("dance", [0, 2], torch.float32),
                                                     ("sde", [1, 2], torch.bfloat16)])
def test_packed_rollout_replays_to_the_recorded_log_probs(tiny_model_dir, sde_type, indices, dtype):
    """bf16 included: replay reads strided views (batch.latents[:, s]) and must still match."""
    adapter = adapter_class("qwen_image")(str(tiny_model_dir("qwen_image")))
    frozen = adapter.load_frozen(device="cpu", dtype=dtype)
    transformer = adapter.load_train_model(dtype=dtype)
    prompts = ["a red cat", "a red cat", "a bowl of fruit on a table", "a bowl of fruit on a table"]
    ids = [f"prompt:{g}:sample:{s}" for g in (0, 1) for s in (0, 1)]
    sampling = {"height": H, "width": W, "num_inference_steps": 4, "eta": 0.7, "sde_type": sde_type}
    request = adapter.build_rollout_request(prompts, ids, sampling, rollout_id=1, seed=9,
                                            sde_indices=indices)
    batch = adapter.pack_trajectory(serve(adapter, frozen, transformer, request, dtype=dtype), request)

    assert batch.group_index.tolist() == [0, 0, 1, 1]
    assert not torch.equal(batch.next_latents[0], batch.next_latents[1])   # candidates differ
    assert batch.images.shape == (4, H, W, 3)
    if indices[0] == 0:   # the first SDE step starts from x_T itself
        assert torch.equal(batch.latents[:, 0], adapter.initial_latents(ids, Geometry(H, W), seed=9, dtype=dtype))
    with torch.no_grad():
        replayed = torch.stack([
            kernels.sde_log_prob(batch.latents[:, s], adapter.replay_velocity(transformer, batch, s),
                                 batch.next_latents[:, s], batch.sigmas[:, s], batch.sigmas_next[:, s],
                                 eta=batch.eta, sde_type=batch.sde_type, backend="torch")
            for s in range(len(batch.sde_indices))], dim=1)
    assert torch.equal(replayed, batch.log_probs)                           # ratio == 1 exactly
