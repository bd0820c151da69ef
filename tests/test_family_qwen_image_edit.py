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


# ---- reference_area: each reference sized as the edit pipelines size it ------------------------
#: A small area for the CPU: a 40x24 picture rounds to 64x32 pixels, a 24x40 one to 32x64 and a
#: square one to 64x64 (the pipelines' 32-pixel rounding): three grids, two token counts.
AREA = 48 * 48


@pytest.fixture(scope="module")
def shaped(tmp_path_factory):
    """References of three aspect ratios (wide 40x24, tall 24x40, square 40x40)."""
    root = tmp_path_factory.mktemp("edit_shapes")
    return {"wide": picture(root, "wide", (210, 40, 30), size=(40, 24)),
            "tall": picture(root, "tall", (30, 40, 210), size=(24, 40)),
            "square": picture(root, "square", (40, 200, 40), size=(40, 40)),
            "grey": picture(root, "grey", (128, 128, 128), size=(40, 24))}


def shaped_references(family, shaped, first):
    return (shaped[first],) if family == "qwen_image_edit" else (shaped[first], shaped["grey"])


@pytest.mark.parametrize("family", EDIT_FAMILIES)
def test_reference_area_conditions_are_the_edit_pipelines_own_at_that_area(family, loaded, shaped):
    """With ``reference_area``, each reference is resized as diffusers' edit pipeline resizes it
    (its ``calculate_dimensions`` at that area, at the picture's aspect ratio), its latents are
    the pipeline's ``prepare_latents`` of that picture, the prompt embeddings its
    ``encode_prompt`` (Edit: with the picture at that size), and the grids are the pipeline's
    ``img_shapes`` entries of the references; rows of other grids are zero-padded."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus

    base, frozen, _ = loaded(family)
    adapter = type(base)(base.model_path, reference_area=AREA)
    assert "reference_grids" in adapter.condition_keys and "reference_grids" not in base.condition_keys
    pipe = frozen["pipeline"]
    rows = [shaped_references(family, shaped, "wide"), shaped_references(family, shaped, "square")]
    cond = adapter.encode_conditions(frozen, ["make it blue", "keep it"], rows, GEOMETRY)
    assert set(cond) == set(adapter.condition_keys)
    sf = pipe.vae_scale_factor
    lengths = []
    for row, (prompt, refs) in enumerate(zip(["make it blue", "keep it"], rows)):
        pictures = [ref.open() for ref in refs]
        if family == "qwen_image_edit":  # QwenImageEditPipeline.__call__'s resizing
            width, height, _ = pipeline_qwenimage_edit.calculate_dimensions(
                AREA, pictures[0].width / pictures[0].height)
            prompt_image = pipe.image_processor.resize(pictures[0], height, width)
            vae_input = pipe.image_processor.preprocess(prompt_image, height, width).unsqueeze(2)
            sizes = [(width, height)]
        else:  # QwenImageEditPlusPipeline.__call__'s, its VAE area patched to AREA
            sizes = [pipeline_qwenimage_edit_plus.calculate_dimensions(AREA, p.width / p.height)
                     for p in pictures]
            prompt_image = adapter.prompt_images(pipe, pictures, None)
            vae_input = [pipe.image_processor.preprocess(p, h, w).unsqueeze(2)
                         for p, (w, h) in zip(pictures, sizes)]
        embeds, _ = pipe.encode_prompt(prompt=[prompt], image=prompt_image, device="cpu")
        assert torch.equal(cond["prompt_embeds"][row, :embeds.shape[1]], embeds[0])
        _, want = pipe.prepare_latents(vae_input, 1, 4, H, W, torch.float32, "cpu", None)
        length = want.shape[1]
        lengths.append(length)
        assert torch.equal(cond["image_latents"][row, :length], want[0])
        assert not cond["image_latents"][row, length:].any()  # zero padding
        grids = [[h // sf // 2, w // sf // 2] for w, h in sizes]  # the pipelines' img_shapes
        assert cond["reference_grids"][row].tolist() == grids
    assert sizes[0] != (W, H)  # not the output geometry
    assert lengths[0] < lengths[1] == cond["image_latents"].shape[1]  # row 0 is padded


@pytest.mark.parametrize("family", EDIT_FAMILIES)
def test_reference_area_velocity_of_a_mixed_batch_is_each_candidates_own(family, loaded, shaped):
    """A batch mixing references of two aspect ratios: each candidate's velocity is the joint
    forward with its own grids (img_shapes) on its own unpadded reference tokens, as if it were
    alone, and the grouping keeps the batch order."""
    base, frozen, transformer = loaded(family)
    adapter = type(base)(base.model_path, reference_area=AREA)
    kinds = ("wide", "tall", "square", "wide")  # wide and tall: one length, transposed grids
    rows = [shaped_references(family, shaped, k) for k in kinds]
    cond = adapter.encode_conditions(frozen, list("abcd"), rows, GEOMETRY)
    assert cond["reference_grids"][0, 0].tolist() == cond["reference_grids"][1, 0].flip(0).tolist()
    x = adapter.initial_latents(["s0", "s1", "s2", "s3"], GEOMETRY, seed=3)
    sigma = torch.full((4,), 0.6)
    with torch.no_grad():
        v = adapter.velocity(transformer, x, sigma, cond, GEOMETRY)
        for row in range(4):
            alone = adapter.encode_conditions(frozen, ["abcd"[row]], [rows[row]], GEOMETRY)
            one = adapter.velocity(transformer, x[row:row + 1], sigma[:1], alone, GEOMETRY)
            torch.testing.assert_close(v[row:row + 1], one, rtol=1e-5, atol=1e-5)
        _, h, w = adapter.init_noise_shape(GEOMETRY)
        grid = cond["reference_grids"][1].tolist()
        tokens = x.shape[1]
        refs = sum(r * c for r, c in grid)
        unpadded = type(adapter)(adapter.model_path, reference_area=AREA, joint_tokens_multiple=1)
        direct = transformer(hidden_states=torch.cat([x[1:2], cond["image_latents"][1:2, :refs]], 1),
                             timestep=torch.tensor([0.6]), encoder_hidden_states=cond["prompt_embeds"][1:2],
                             encoder_hidden_states_mask=cond["prompt_embeds_mask"][1:2],
                             img_shapes=[[(1, h // 2, w // 2), *[(1, r, c) for r, c in grid]]],
                             return_dict=False)[0]
        assert torch.equal(unpadded.velocity(transformer, x[1:2], sigma[:1],
                                             {k: t[1:2] for k, t in cond.items()}, GEOMETRY),
                           direct[:, :tokens])
    assert not torch.allclose(v[0], v[1])


@pytest.mark.parametrize("family", EDIT_FAMILIES)
def test_reference_area_sampling_with_mixed_aspect_ratios_is_replayed_bitwise(family, tiny_model_dir,
                                                                            shaped):
    """The embedded engine with ``reference_area``, candidates of one request mixing two
    reference aspect ratios: the recorded log-probs are what the replay computes, bit for bit,
    and the conditions carry each candidate's grids."""
    options = {"reference_area": AREA}
    engine = launch_embedded_engine(adapter_path=ADAPTERS[family], model_path=str(tiny_model_dir(family)),
                                    adapter_options=options, device="cpu", dtype="fp32", lora=None,
                                    in_process=True)
    try:
        adapter = adapter_class(family)(str(tiny_model_dir(family)), **options)
        ids = ["prompt:a:sample:0", "prompt:a:sample:1", "prompt:b:sample:0"]
        images = [shaped_references(family, shaped, "wide")] * 2 + [shaped_references(family, shaped, "square")]
        request = adapter.build_rollout_request(["make it blue"] * 2 + ["keep it"], ids, SAMPLING,
                                                rollout_id=0, seed=5, images=images)
        batch = adapter.pack_trajectory(engine.generate(request), request)
        grids = batch.conditions["reference_grids"]
        assert torch.equal(grids[0], grids[1]) and not torch.equal(grids[0], grids[2])
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


def test_reference_area_is_validated_and_counted_in_the_image_tokens(tiny_model_dir):
    cls = adapter_class("qwen_image_edit")
    path = str(tiny_model_dir("qwen_image_edit"))
    for bad in (True, 1.5, "1024", 32 * 32 - 1):
        with pytest.raises(ValueError, match="reference_area must be None"):
            cls(path, reference_area=bad)
    default, sized = cls(path), cls(path, reference_area=AREA)
    output = default.latent_shape(GEOMETRY)[0]
    assert default.image_tokens(GEOMETRY) == 2 * output  # unchanged: the output's grid twice
    side = 2 * sized.vae_scale_factor
    assert sized.image_tokens(GEOMETRY) == output + AREA // (side * side)
