"""FLUX.1 Kontext on a tiny random model built from its configs (tests/tiny_models.py:
diffusers' FluxKontextPipeline saves it, the adapter loads it back through from_pretrained):
diffusers' own Kontext pipeline runs on it, the conditions and the joint forward are the
pipeline's, the embedded engine's sampling is reproducible and steered by the reference and
its recorded log-probs are what the replay computes bit for bit, LoRA wraps the named
targets, and preflight refuses the SGLang engine (SGLang 0.5.23 has no Kontext pipeline)."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from PIL import Image

import flowgrpo_kernels as kernels
from tiny_models import TINY_HEIGHT, TINY_WIDTH
from trainer.engine import launch_embedded_engine
from trainer.media import ImageRef
from trainer.models import ADAPTERS, adapter_class
from trainer.models.geometry import Geometry

pytestmark = pytest.mark.usefixtures("torch_single_thread")
FAMILY = "flux_kontext"
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
    root = tmp_path_factory.mktemp("kontext_sources")
    return {name: picture(root, name, colour) for name, colour in
            (("red", (210, 40, 30)), ("blue", (30, 40, 210)), ("grey", (128, 128, 128)))}


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    adapter = adapter_class(FAMILY)(str(tiny_model_dir(FAMILY)))
    return adapter, adapter.load_frozen(device="cpu", dtype=torch.float32), adapter.load_train_model()


def test_kontext_is_registered_for_the_edit_task_only():
    cls = adapter_class(FAMILY)
    assert ADAPTERS[FAMILY] == "trainer.models.flux_kontext.FluxKontextAdapter"
    assert cls.supported_tasks == ("edit",) and cls.max_condition_images == 1
    cls.check_task("edit")
    with pytest.raises(ValueError):
        cls.check_task("t2i")


def test_diffusers_kontext_pipeline_runs_on_the_tiny_model(tiny_model_dir, refs):
    from diffusers import FluxKontextPipeline

    pipe = FluxKontextPipeline.from_pretrained(str(tiny_model_dir(FAMILY)))
    out = pipe(image=refs["red"].open(), prompt="make it blue", height=H, width=W, num_inference_steps=2,
               max_area=H * W, _auto_resize=False, output_type="np", generator=torch.Generator().manual_seed(0)).images
    assert out.shape == (1, H, W, 3) and np.isfinite(out).all()


def test_the_conditions_and_the_joint_forward_are_the_pipelines(loaded, refs):
    """Prompt embeddings from encode_prompt, reference latents and ids from the pipeline's
    prepare_latents at the output geometry; the velocity is the first tokens of the forward on
    [x_t; reference] with [output ids; reference ids], as the pipeline's loop calls it."""
    adapter, frozen, transformer = loaded
    pipe = frozen["pipeline"]
    prompts, images = ["make it blue", "keep it"], [(refs["red"],), (refs["blue"],)]
    cond = adapter.encode_conditions(frozen, prompts, images, GEOMETRY)
    assert set(cond) == set(adapter.condition_keys)
    embeds, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=None, device="cpu",
                                           max_sequence_length=adapter.max_sequence_length)
    assert torch.equal(cond["prompt_embeds"], embeds) and torch.equal(cond["pooled_prompt_embeds"], pooled)
    x = adapter.initial_latents(["s0", "s1"], GEOMETRY, seed=3)
    for row, (ref,) in enumerate(images):
        pixels = pipe.image_processor.preprocess(pipe.image_processor.resize(ref.open(), H, W), H, W)
        _, want, latent_ids, image_ids = pipe.prepare_latents(pixels, 1, 4, H, W, torch.float32, "cpu", None)
        assert torch.equal(cond["image_latents"][row:row + 1], want)
    assert cond["image_latents"].shape == x.shape
    with torch.no_grad():
        v = adapter.velocity(transformer, x, torch.tensor([0.6]), cond, GEOMETRY)
        guidance = torch.full([2], adapter.embedded_guidance)
        direct = transformer(hidden_states=torch.cat([x, cond["image_latents"]], 1),
                             timestep=torch.tensor([0.6, 0.6]), guidance=guidance,
                             pooled_projections=pooled, encoder_hidden_states=embeds,
                             txt_ids=torch.zeros(embeds.shape[1], 3),
                             img_ids=torch.cat([latent_ids, image_ids]), return_dict=False)[0]
    assert torch.equal(v, direct[:, :x.shape[1]])
    assert adapter.image_tokens(GEOMETRY) == 2 * x.shape[1]


def test_engine_sampling_is_reproducible_steered_by_the_reference_and_replayed_bitwise(
        tiny_model_dir, refs):
    engine = launch_embedded_engine(adapter_path=ADAPTERS[FAMILY], model_path=str(tiny_model_dir(FAMILY)),
                                    adapter_options=None, device="cpu", dtype="fp32", lora=None,
                                    in_process=True)
    try:
        adapter = adapter_class(FAMILY)(str(tiny_model_dir(FAMILY)))
        ids = ["prompt:a:sample:0", "prompt:a:sample:1", "prompt:b:sample:0"]

        def request(first):
            images = [(refs[first],)] * 2 + [(refs["blue"],)]
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
        assert batch.sources[2] == (refs["blue"],)
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


def test_lora_targets_exist_and_peft_wraps_them(loaded, refs):
    from peft import LoraConfig, get_peft_model

    adapter, frozen, reference = loaded
    targets = adapter.lora_target_modules()
    names = [n for n, _ in reference.named_modules()]
    assert all(any(n.endswith("." + t) for n in names) for t in targets)
    model = get_peft_model(adapter.load_train_model(), LoraConfig(r=2, lora_alpha=4, target_modules=targets))
    wrapped = {n.removeprefix("base_model.model.") for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == {n for n, m in reference.named_modules()
                       if isinstance(m, torch.nn.Linear) and any(n.endswith("." + t) for t in targets)}
    cond = adapter.encode_conditions(frozen, ["a"], [(refs["red"],)], GEOMETRY)
    x = adapter.initial_latents(["a"], GEOMETRY, seed=1)
    with torch.no_grad():  # B = 0 at initialisation: the wrapped model is the base model
        assert torch.equal(adapter.velocity(model, x, torch.tensor([0.5]), cond, GEOMETRY),
                           adapter.velocity(reference, x, torch.tensor([0.5]), cond, GEOMETRY))


def test_one_reference_is_required_and_at_most_one_taken(tiny_model_dir, refs):
    adapter = adapter_class(FAMILY)(str(tiny_model_dir(FAMILY)))
    with pytest.raises(ValueError, match="takes at most 1"):
        adapter.build_rollout_request(["a"], ["s0"], SAMPLING, rollout_id=0, seed=1,
                                      images=[(refs["red"], refs["blue"])])
    with pytest.raises(ValueError, match="needs at least one"):
        adapter.build_rollout_request(["a"], ["s0"], SAMPLING, rollout_id=0, seed=1)


def test_preflight_refuses_the_sglang_engine_for_kontext():
    """SGLang 0.5.23 has no native Kontext pipeline: the recipe on engine 'sglang' is refused
    with the family named, while the shipped recipe (embedded engine) has no SGLang problem."""
    from trainer.config import load_config
    from trainer.engine.sglang.sync import sglang_config_problems

    cfg = load_config("flux-kontext-lora", ["rollout.engine=sglang", "rollout.sampling.driver_xt=false",
                                            "rollout.sampling.driver_sigmas=false"])
    problems = sglang_config_problems(cfg.model, cfg.rollout, cfg.lora)
    assert problems and all("flux_kontext" in p for p in problems), problems


def test_the_adapter_export_loads_in_the_kontext_pipeline_as_the_merged_one(tiny_model_dir, refs, tmp_path):
    """Two real optimizer steps of a LoRA on the Kontext forward, exported as a diffusers LoRA
    and as a merged pipeline: FluxKontextPipeline.load_lora_weights on the base edits the
    reference as the merged export does, and differently from the base."""
    import test_checkpoint_harness as h
    from diffusers import FluxKontextPipeline

    from trainer.checkpoint import save_checkpoint
    from trainer.cli import main as cli_main

    base = tiny_model_dir(FAMILY)
    tr = h.make_trainer(base, tmp_path / "ckpt", lora=True, adapter_cls=adapter_class(FAMILY),
                        extra=["train.lr_warmup_iters=0", "train.lr=0.02"])
    frozen = tr.adapter.load_frozen(device="cpu", dtype=torch.float32)
    cond = tr.adapter.encode_conditions(frozen, ["make it blue"], [(refs["red"],)], GEOMETRY)
    g = torch.Generator().manual_seed(0)
    for step in range(2):
        latents, target = (torch.randn(1, *tr.adapter.latent_shape(GEOMETRY), generator=g) for _ in range(2))
        v = tr.adapter.velocity(tr.model, latents, torch.tensor([0.3 + 0.4 * step]), cond, GEOMETRY)
        (v - target).square().mean().backward()
        tr.optimizer.step()
        tr.optimizer.zero_grad()
    tr.next_rollout = tr.policy_version = 2
    assert save_checkpoint(tr.checkpointer, 2) is not None
    lora_dir, merged_dir = tmp_path / "lora", tmp_path / "merged"
    assert cli_main(["export", "--save-dir", str(tmp_path / "ckpt"), "--output-dir", str(lora_dir),
                     "--form", "adapter", "--verify"]) == 0
    assert cli_main(["export", "--save-dir", str(tmp_path / "ckpt"), "--output-dir", str(merged_dir),
                     "--form", "merged"]) == 0

    def edit(pipe):
        pipe.set_progress_bar_config(disable=True)
        with torch.no_grad():
            return pipe(image=refs["red"].open(), prompt="make it blue", height=H, width=W,
                        max_area=H * W, _auto_resize=False, num_inference_steps=2, output_type="latent",
                        generator=torch.Generator().manual_seed(1)).images

    pipe = FluxKontextPipeline.from_pretrained(str(base))
    base_out = edit(pipe)
    pipe.load_lora_weights(str(lora_dir))
    lora_out = edit(pipe)
    merged_out = edit(FluxKontextPipeline.from_pretrained(str(merged_dir)))
    torch.testing.assert_close(lora_out, merged_out, rtol=1e-4, atol=1e-5)
    gap = (lora_out - base_out).abs().max().item()
    assert gap > 100 * (lora_out - merged_out).abs().max().item() and gap > 1e-4


def test_the_memory_plan_counts_the_reference_tokens_and_the_frozen_parts(tiny_model_dir):
    """--dry-run's plan of the recipe on a Kontext model: the joint sequence is the output's
    tokens and the reference's, and FLUX.1's encoders and VAE are counted in the engine."""
    from trainer.compute.memory import plan_for_config
    from trainer.config import load_config

    cfg = load_config("flux-kontext-lora", [f"model.model_path={tiny_model_dir(FAMILY)}"])
    t2i = load_config("flux-t2i-lora", [f"model.model_path={tiny_model_dir('flux')}"])
    kontext_plan, t2i_plan = plan_for_config(cfg, 8), plan_for_config(t2i, 8)
    tokens = [int(re.search(r"(\d+) image \+ at most 512 text tokens", p.title).group(1))
              for p in (kontext_plan, t2i_plan)]
    assert tokens[0] == 2 * tokens[1] > 0  # the tiny FLUX and Kontext models share their VAE
    assert kontext_plan.activations[True] > t2i_plan.activations[True]
    assert any("T5-XXL" in name for name in kontext_plan.terms)
    assert not any("not counted" in note for note in kontext_plan.notes)


def test_the_stated_flops_are_those_of_the_joint_velocity_forward(loaded):
    """The adapter's count (output + reference tokens) equals FlopCounterMode over ``velocity``
    on [x_t; reference]: the MFU of a Kontext run counts what the engine and replay run."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    adapter, _, model = loaded
    batch, text = 2, 5
    config = adapter.transformer_config
    x = adapter.initial_latents(["s0", "s1"], GEOMETRY, seed=0)
    cond = {"prompt_embeds": torch.randn(batch, text, int(config["joint_attention_dim"])),
            "pooled_prompt_embeds": torch.randn(batch, int(config["pooled_projection_dim"])),
            "image_latents": torch.randn_like(x)}
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        adapter.velocity(model, x, torch.full((batch,), 0.5), cond, GEOMETRY)
    stated = adapter.forward_flops(GEOMETRY, batch=batch, text_tokens=text)
    assert stated.total == counter.get_total_flops()
