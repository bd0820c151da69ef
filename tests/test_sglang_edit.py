"""The conditioned families (image editing, image-to-video) on ``rollout.engine = "sglang"``:
preflight refuses each one SGLang 0.5.23 cannot roll out (FLUX.1 Kontext always; the edit
families and Wan image-to-video on stock SGLang, the edit families also at a reference area
other than SGLang's: the extension rolls them out, tests/test_sglang_edit_native.py and
tests/test_sglang_wan_i2v.py) with the true reason, and the facts those reasons state are
checked against SGLang's own code, so a SGLang release that changes them fails here instead of
leaving a stale refusal.

What SGLang 0.5.23 does (read from its source, checked below where it can be without a GPU):
its native ``QwenImageEditPipeline``, ``QwenImageEditPlusPipeline`` and
``WanImageToVideoPipeline`` take the conditioning images as ``RolloutRequest.image_path``; their
image VAE stage writes the references' (or the first frame's) latents to ``batch.image_latent``,
which the denoising stage concatenates to the noisy latents, but the rollout answer's
``denoising_env`` (``RolloutDenoisingEnv``) holds only ``image_kwargs``, ``pos_cond_kwargs``,
``neg_cond_kwargs`` and ``guidance``: the latents the replay must feed the transformer never
come back (the trainer's extension adds them). The Edit pipelines also size each reference at
about a megapixel at its aspect ratio: our edit adapters do the same only with
``reference_area`` at that area, which preflight requires. FLUX.1 Kontext has no native
pipeline at all.
"""
from __future__ import annotations

import dataclasses

import pytest

from sglang_fixtures import _process_state_kept, require_sglang

CONDITIONED = [("flux-kontext-lora", "flux_kontext")]
EDIT = [("qwen-image-edit-lora", "qwen_image_edit"),
        ("qwen-image-edit-plus-lora", "qwen_image_edit_plus")]
IMAGE_TO_VIDEO = [("wan2.1-i2v", "wan_i2v"), ("wan2.2-i2v", "wan_i2v")]


def _family_refusals(recipe: str, extension: bool, extra: tuple = ()) -> list[str]:
    from trainer.config import load_config
    from trainer.engine.sglang.sync import sglang_config_problems

    cfg = load_config(recipe, ["rollout.engine=sglang", "rollout.sampling.driver_xt=false",
                               "rollout.sampling.driver_sigmas=false",
                               'rollout.sglang_urls=["http://127.0.0.1:30000"]',
                               f"rollout.sglang_extension={str(extension).lower()}", *extra])
    with _process_state_kept():  # preflight reads the edit families' sizing from SGLang
        problems = sglang_config_problems(cfg.model, cfg.rollout, cfg.lora)
    return [p for p in problems if p.startswith("model family")]


@pytest.mark.parametrize("extension", [False, True], ids=["stock", "extension"])
@pytest.mark.parametrize("recipe, family", CONDITIONED)
def test_preflight_refuses_each_conditioned_family_on_sglang_with_its_own_reason(recipe, family,
                                                                                extension):
    from trainer.models import adapter_class

    reason = adapter_class(family).sglang_refusal
    refusals = _family_refusals(recipe, extension)
    assert len(refusals) == 1, refusals
    assert f"model family {family!r} cannot roll out on rollout.engine='sglang'" in refusals[0]
    assert reason in refusals[0]
    assert "the SGLang client maps the denoising env" not in refusals[0]  # not the generic one


@pytest.mark.parametrize("recipe, family", EDIT)
def test_edit_families_roll_out_with_the_extension_at_sglangs_reference_area_only(recipe, family):
    """Stock SGLang is refused with the stock reason (no reference latents in its answer); with
    the extension, references at the output geometry (no ``reference_area``) or at another area
    are refused naming SGLang's area and ours, and the recipe's, the pipelines' area
    (1024 * 1024, what SGLang 0.5.23's config code sizes at), passes."""
    from trainer.models import adapter_class

    area = 'model.adapter_options={"reference_area": 1048576}'
    stock = _family_refusals(recipe, extension=False, extra=(area,))
    assert len(stock) == 1 and adapter_class(family).sglang_stock_refusal in stock[0], stock
    assert "rollout.sglang_extension=true" in stock[0]
    unset = _family_refusals(recipe, extension=True, extra=("model.adapter_options={}",))
    assert len(unset) == 1, unset
    assert "SGLang sizes each reference at about 1048576 pixels" in unset[0]
    assert "reference_area is unset" in unset[0]
    other = _family_refusals(recipe, extension=True,
                             extra=('model.adapter_options={"reference_area": 262144}',))
    assert len(other) == 1 and "reference_area is 262144 pixels" in other[0], other
    assert _family_refusals(recipe, extension=True, extra=(area,)) == []
    assert _family_refusals(recipe, extension=True) == []  # the recipe's own area


@pytest.mark.parametrize("recipe, family", IMAGE_TO_VIDEO)
def test_image_to_video_is_refused_on_stock_sglang_only(recipe, family):
    """Wan image-to-video rolls out through the extension (tests/test_sglang_wan_i2v.py); stock
    SGLang is refused with the reason (its answer lacks the first frame's latents)."""
    from trainer.models import adapter_class

    reason = adapter_class(family).sglang_stock_refusal
    refusals = _family_refusals(recipe, extension=False)
    assert len(refusals) == 1 and reason in refusals[0], refusals
    assert "rollout.sglang_extension=true" in refusals[0]
    assert _family_refusals(recipe, extension=True) == []


def test_each_refusal_names_what_sglang_lacks_for_that_family():
    from trainer.models import adapter_class

    reasons = {f: adapter_class(f).sglang_refusal for _, f in CONDITIONED}
    for family in ("qwen_image_edit", "qwen_image_edit_plus", "wan_i2v"):
        reasons[family] = adapter_class(family).sglang_stock_refusal
    assert "no native FLUX.1 Kontext pipeline" in reasons["flux_kontext"]
    assert "QwenImageEditPipeline" in reasons["qwen_image_edit"]
    assert "QwenImageEditPlusPipeline" in reasons["qwen_image_edit_plus"]
    assert "WanImageToVideoPipeline" in reasons["wan_i2v"]
    for family in ("qwen_image_edit", "qwen_image_edit_plus", "wan_i2v"):
        assert "batch.image_latent" in reasons[family], family
    assert "first frame" in reasons["wan_i2v"]


def test_a_family_sglang_serves_has_no_refusal_and_no_family_problem():
    from trainer.models import adapter_class

    for family in ("qwen_image", "sd3", "flux", "wan", "qwen_image_edit", "qwen_image_edit_plus"):
        assert getattr(adapter_class(family), "sglang_refusal", None) is None, family
    assert _family_refusals("qwen-image-t2i-lora", False) == []


# ---- the reasons, against SGLang's own code ----------------------------------------------------
def test_sglang_takes_conditioning_images_by_path_and_returns_no_image_latents():
    """The facts the edit and image-to-video refusals state: the rollout request carries
    ``image_path`` into SGLang's sampling parameters, the native pipelines exist, and the
    returned denoising env has no place for the latents the DiT is given beside the noise."""
    require_sglang()
    with _process_state_kept():
        from sglang.multimodal_gen.runtime.entrypoints.post_training import (io_struct,
                                                                              rollout_api)
        from sglang.multimodal_gen.runtime.pipelines import qwen_image, wan_i2v_pipeline
        from sglang.multimodal_gen.runtime.post_training.rl_dataclasses import (
            RolloutDenoisingEnv)

    request = io_struct.RolloutRequest(prompt="make it blue", image_path=["/tmp/ref.png"])
    assert rollout_api._build_sampling_kwargs(request)["image_path"] == ["/tmp/ref.png"]
    assert {f.name for f in dataclasses.fields(RolloutDenoisingEnv)} == {
        "image_kwargs", "pos_cond_kwargs", "neg_cond_kwargs", "guidance"}
    assert qwen_image.QwenImageEditPipeline.pipeline_name == "QwenImageEditPipeline"
    assert qwen_image.QwenImageEditPlusPipeline.pipeline_name == "QwenImageEditPlusPipeline"
    assert wan_i2v_pipeline.WanImageToVideoPipeline.__name__ == "WanImageToVideoPipeline"


def test_sglang_encodes_edit_references_at_about_a_megapixel_whatever_the_output():
    """The edit refusal's fact: SGLang's Edit and Edit-Plus pipeline configs size a reference
    for the VAE at about 1024x1024 pixels at its aspect ratio, not at the output's geometry
    (where our adapters encode it)."""
    require_sglang()
    with _process_state_kept():
        from sglang.multimodal_gen.configs.pipeline_configs.qwen_image import (
            QwenImageEditPipelineConfig, QwenImageEditPlusPipelineConfig)

    edit = QwenImageEditPipelineConfig().calculate_condition_image_size(None, 40, 48)
    plus = QwenImageEditPlusPipelineConfig().calculate_vae_image_size(None, 40, 48)
    for width, height in (edit, plus):
        assert abs(width * height - 1024 * 1024) < 0.05 * 1024 * 1024, (width, height)
        assert width < height  # the 40x48 picture's aspect ratio, kept


def test_sglang_has_no_native_kontext_pipeline():
    """The Kontext refusal's fact: no module of SGLang's native pipelines defines a Kontext
    class (its only Kontext code is the ComfyUI executor's). The modules are parsed, not
    imported: some import optional packages (a 3D mesh library) that no family here needs."""
    require_sglang()
    import ast
    from pathlib import Path

    with _process_state_kept():
        import sglang.multimodal_gen.runtime.pipelines as native

    names = [node.name for path in Path(native.__file__).parent.glob("*.py")
             for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)]
    assert {"FluxPipeline", "QwenImageEditPipeline"} <= set(names)  # the scan sees them
    assert not [n for n in names if "kontext" in n.lower()], names


# ---- conditioning images on SGLang's wire (no server needed) -----------------------------------
def test_condition_images_are_written_as_files_in_candidate_order(tmp_path):
    """Paths and data URIs alike become files under the call's folder, byte for byte, one list
    per candidate in order (what SGLang's ``image_path`` takes); a request without images
    writes nothing."""
    from trainer.engine.sglang.rollout import write_condition_images
    from trainer.media import inline_entry

    png = tmp_path / "frame.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n first frame")
    inline = b"\x89PNG\r\n\x1a\n inline frame"
    request = {"extra_sampling_params": {"condition_images": [[str(png)],
                                                              [inline_entry(inline)]]}}
    media = tmp_path / "media"
    media.mkdir()
    paths = write_condition_images(request, media)
    assert [len(p) for p in paths] == [1, 1]
    assert open(paths[0][0], "rb").read() == png.read_bytes()
    assert open(paths[1][0], "rb").read() == inline
    assert all(p[0].startswith(str(media)) for p in paths)
    assert write_condition_images({"extra_sampling_params": {}}, media) is None


def test_an_unreadable_first_frame_fails_the_call_naming_it_and_leaves_no_files(tmp_path):
    """A missing image fails ``generate`` before any request, with the image named, and the
    call's folder is removed."""
    from trainer.engine.sglang.client import SGLangEngineClient
    from trainer.media import MediaError

    media = tmp_path / "media"
    media.mkdir()
    client = SGLangEngineClient("http://127.0.0.1:9", embedded=False, extension=True,
                                media_root=str(media))
    missing = str(tmp_path / "nowhere.png")
    request = {"extra_sampling_params": {"condition_images": [[missing]]}}
    with pytest.raises(MediaError, match="nowhere.png"):
        client.generate(request)
    assert list(media.iterdir()) == []
