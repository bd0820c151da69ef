"""Qwen-Image-Edit and Qwen-Image-Edit-Plus on tiny random models built from their configs
(tests/tiny_models.py: diffusers' own pipeline classes save them, the adapter loads them back
through from_pretrained): the conditions are what diffusers' edit pipelines compute, the
embedded engine's sampling is reproducible and its recorded log-probs are what the replay
computes bit for bit, the references steer the sample, and LoRA wraps the named targets."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import flowgrpo_kernels as kernels
from tiny_models import EDIT_FAMILIES, TINY_HEIGHT, TINY_WIDTH
from trainer.engine import launch_embedded_engine
from trainer.media import ImageRef
from trainer.models import ADAPTERS, adapter_class
from trainer.models.geometry import Geometry

pytestmark = pytest.mark.usefixtures("torch_single_thread")
H, W = TINY_HEIGHT, TINY_WIDTH
GEOMETRY = Geometry(H, W)
SAMPLING = {"height": H, "width": W, "num_inference_steps": 4, "guidance_scale": 1.0,
            "eta": 0.7, "sde_type": "sde", "sde_indices": [1, 2]}


def picture(root, name, colour, size=(40, 24)) -> ImageRef:
    """A flat-colour PNG with a square of another colour (so resizing has edges to keep)."""
    pixels = np.full((size[1], size[0], 3), colour, dtype=np.uint8)
    pixels[4:12, 4:12] = (255 - np.array(colour)).astype(np.uint8)
    Image.fromarray(pixels).save(root / f"{name}.png")
    return ImageRef(str(root / f"{name}.png"))


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    root = tmp_path_factory.mktemp("edit_sources")
    return {name: picture(root, name, colour) for name, colour in
            (("red", (210, 40, 30)), ("blue", (30, 40, 210)), ("grey", (128, 128, 128)))}


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    cache = {}

    def get(family):
        if family not in cache:
            adapter = adapter_class(family)(str(tiny_model_dir(family)))
            cache[family] = (adapter, adapter.load_frozen(device="cpu", dtype=torch.float32),
                             adapter.load_train_model())
        return cache[family]
    return get


def references_for(family, refs, first="red"):
    return (refs[first],) if family == "qwen_image_edit" else (refs[first], refs["grey"])


def test_the_edit_families_are_registered_for_the_edit_task():
    from trainer.tasks import CONDITIONED_TASKS

    for family in EDIT_FAMILIES:
        cls = adapter_class(family)
        assert ADAPTERS[family].endswith(cls.__name__) and cls.supported_tasks == ("edit",)
        assert "edit" in CONDITIONED_TASKS and cls.max_condition_images >= 1
        cls.check_task("edit")
        with pytest.raises(ValueError):
            cls.check_task("t2i")


@pytest.mark.parametrize("family", EDIT_FAMILIES)
def test_the_conditions_are_the_edit_pipelines_own(family, loaded, refs):
    """Prompt embeddings from the pipeline's encode_prompt with the picture(s) in the template,
    reference latents from its prepare_latents at the output geometry, in order."""
    adapter, frozen, _ = loaded(family)
    pipe = frozen["pipeline"]
    images = [references_for(family, refs), references_for(family, refs, "blue")]
    cond = adapter.encode_conditions(frozen, ["make it blue", "keep it"], images, GEOMETRY)
    assert set(cond) == set(adapter.condition_keys)
    for row, (prompt, row_refs) in enumerate(zip(["make it blue", "keep it"], images)):
        pictures = [ref.open() for ref in row_refs]
        resized = [pipe.image_processor.resize(p, H, W) for p in pictures]
        embeds, _ = pipe.encode_prompt(prompt=[prompt], image=adapter.prompt_images(pipe, pictures, resized),
                                       device="cpu")
        length = embeds.shape[1]
        assert torch.equal(cond["prompt_embeds"][row, :length], embeds[0])
        assert cond["prompt_embeds_mask"][row].sum() == length
        vae_images = [pipe.image_processor.preprocess(p, H, W).unsqueeze(2) for p in resized]
        _, want = pipe.prepare_latents(vae_images if family == "qwen_image_edit_plus" else vae_images[0],
                                       1, 4, H, W, torch.float32, "cpu", None)
        assert torch.equal(cond["image_latents"][row], want[0])
    tokens = adapter.latent_shape(GEOMETRY)[0]
    assert cond["image_latents"].shape[1] == tokens * len(images[0])


@pytest.mark.parametrize("family", EDIT_FAMILIES)
def test_velocity_is_the_output_tokens_of_the_joint_forward(family, loaded, refs):
    """The transformer sees [x_t; references] with every grid in img_shapes and the velocity
    is its first tokens: the same values the pipeline's call computes for its latents."""
    adapter, frozen, transformer = loaded(family)
    cond = adapter.encode_conditions(frozen, ["make it blue"], [references_for(family, refs)], GEOMETRY)
    x = adapter.initial_latents(["s"], GEOMETRY, seed=3)
    tokens = x.shape[1]
    _, h, w = adapter.init_noise_shape(GEOMETRY)
    count = cond["image_latents"].shape[1] // tokens
    with torch.no_grad():
        v = adapter.velocity(transformer, x, torch.tensor([0.6]), cond, GEOMETRY)
        unpadded = type(adapter)(adapter.model_path, joint_tokens_multiple=1)
        direct = transformer(hidden_states=torch.cat([x, cond["image_latents"]], 1),
                             timestep=torch.tensor([0.6]), encoder_hidden_states=cond["prompt_embeds"],
                             encoder_hidden_states_mask=cond["prompt_embeds_mask"],
                             img_shapes=[[(1, h // 2, w // 2)] * (1 + count)], return_dict=False)[0]
        assert torch.equal(unpadded.velocity(transformer, x, torch.tensor([0.6]), cond, GEOMETRY),
                           direct[:, :tokens])
    assert v.shape == x.shape
    torch.testing.assert_close(v, direct[:, :tokens], rtol=1e-5, atol=1e-5)  # masked padding only


@pytest.mark.parametrize("family", EDIT_FAMILIES)
def test_engine_sampling_is_reproducible_steered_by_the_references_and_replayed_bitwise(
        family, tiny_model_dir, refs):
    engine = launch_embedded_engine(adapter_path=ADAPTERS[family], model_path=str(tiny_model_dir(family)),
                                    adapter_options=None, device="cpu", dtype="fp32", lora=None,
                                    in_process=True)
    try:
        adapter = adapter_class(family)(str(tiny_model_dir(family)))
        ids = ["prompt:a:sample:0", "prompt:a:sample:1", "prompt:b:sample:0"]

        def request(first):
            images = [references_for(family, refs, first)] * 2 + [references_for(family, refs, "blue")]
            return adapter.build_rollout_request(["make it blue"] * 2 + ["keep it"], ids, SAMPLING,
                                                 rollout_id=0, seed=5, images=images)

        red = request("red")
        first, again = engine.generate(red), engine.generate(red)
        lat = first["dit_trajectory"]["latents"]
        assert torch.equal(lat, again["dit_trajectory"]["latents"])
        assert torch.equal(first["images"], again["images"])
        other = engine.generate(request("grey"))["dit_trajectory"]["latents"]
        assert not torch.equal(lat[:2], other[:2]) and torch.equal(lat[2], other[2])

        batch = adapter.pack_trajectory(first, red)
        assert batch.sources[2] == references_for(family, refs, "blue")
        assert batch.images.shape == (3, H, W, 3)
        model = adapter.load_train_model()
        for k in range(len(batch.sde_indices)):
            with torch.no_grad():
                v = adapter.replay_velocity(model, batch, k)
            replayed = kernels.sde_log_prob(batch.latents[:, k], v, batch.next_latents[:, k],
                                            batch.sigmas[:, k], batch.sigmas_next[:, k],
                                            eta=batch.eta, sde_type=batch.sde_type)
            assert torch.equal(replayed, batch.log_probs[:, k]), k
    finally:
        engine.close()


@pytest.mark.parametrize("family", EDIT_FAMILIES)
def test_lora_targets_exist_and_peft_wraps_them(family, loaded, refs):
    from peft import LoraConfig, get_peft_model

    adapter, frozen, reference = loaded(family)
    targets = adapter.lora_target_modules()
    names = [n for n, _ in reference.named_modules()]
    assert all(any(n.endswith("." + t) for n in names) for t in targets)
    model = get_peft_model(adapter.load_train_model(), LoraConfig(r=2, lora_alpha=4, target_modules=targets))
    wrapped = {n.removeprefix("base_model.model.") for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == {n for n, m in reference.named_modules()
                       if isinstance(m, torch.nn.Linear) and any(n.endswith("." + t) for t in targets)}
    cond = adapter.encode_conditions(frozen, ["a"], [references_for(family, refs)], GEOMETRY)
    x = adapter.initial_latents(["a"], GEOMETRY, seed=1)
    with torch.no_grad():  # B = 0 at initialisation: the wrapped model is the base model
        assert torch.equal(adapter.velocity(model, x, torch.tensor([0.5]), cond, GEOMETRY),
                           adapter.velocity(reference, x, torch.tensor([0.5]), cond, GEOMETRY))


def test_plus_refuses_mixed_reference_counts_and_edit_more_than_one(loaded, refs, tiny_model_dir):
    plus = adapter_class("qwen_image_edit_plus")(str(tiny_model_dir("qwen_image_edit_plus")))
    with pytest.raises(ValueError, match="same number of reference images"):
        plus.build_rollout_request(["a", "b"], ["s0", "s1"], SAMPLING, rollout_id=0, seed=1,
                                   images=[(refs["red"],), (refs["red"], refs["blue"])])
    edit = adapter_class("qwen_image_edit")(str(tiny_model_dir("qwen_image_edit")))
    with pytest.raises(ValueError, match="takes at most 1"):
        edit.build_rollout_request(["a"], ["s0"], SAMPLING, rollout_id=0, seed=1,
                                   images=[(refs["red"], refs["blue"])])
    with pytest.raises(ValueError, match="needs at least one"):
        edit.build_rollout_request(["a"], ["s0"], SAMPLING, rollout_id=0, seed=1)
