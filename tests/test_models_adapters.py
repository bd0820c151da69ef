"""The three diffusers adapters on tiny random models saved to disk and loaded back.

Oracle for sampling and decoding: the diffusers pipeline of the family itself (its __call__
with the same x_T and prompt embeddings), which steps FlowMatchEulerDiscreteScheduler.
"""
from __future__ import annotations

import hashlib

import pytest
import torch
from torch import nn

from tiny_models import ADAPTER_PATHS, FAMILIES, TINY_HEIGHT, TINY_WIDTH
from trainer.models import adapter_class
from trainer.models.base import GenerativeModelAdapter
from trainer.models.geometry import Geometry

pytestmark = pytest.mark.usefixtures("torch_single_thread")
H, W = TINY_HEIGHT, TINY_WIDTH
PROMPTS = ["a red cat", "an astronaut riding a horse on the moon at sunset"]


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    """family -> (adapter, frozen parts, transformer), loaded once per module (never mutated)."""
    cache: dict[str, tuple] = {}

    def get(family: str):
        if family not in cache:
            adapter = adapter_class(family)(str(tiny_model_dir(family)))
            frozen = adapter.load_frozen(device="cpu", dtype=torch.float32)
            cache[family] = adapter, frozen, adapter.load_train_model(dtype=torch.float32)
        return cache[family]

    return get


def _pipeline_with(frozen, transformer):
    pipe = frozen["pipeline"]
    return type(pipe)(**{**pipe.components, "transformer": transformer})


def as_the_pipeline_runs(adapter):
    """The adapter computing exactly what diffusers' pipeline computes: Qwen-Image without its
    joint-sequence padding (the pipeline pads a batch only to its longest prompt)."""
    if adapter.family != "qwen_image":
        return adapter
    return type(adapter)(adapter.model_path, **{**adapter.options, "joint_tokens_multiple": 1})


def _pipeline_kwargs(family: str, adapter, cond: dict, x_t: torch.Tensor, steps: int) -> dict:
    kw = dict(prompt_embeds=cond["prompt_embeds"], latents=x_t, num_inference_steps=steps,
              height=H, width=W)
    if family == "qwen_image":
        kw["prompt_embeds_mask"] = cond["prompt_embeds_mask"]
    else:
        kw["pooled_prompt_embeds"] = cond["pooled_prompt_embeds"]
    if family == "sd3":
        kw["guidance_scale"] = 1.0      # the pipeline's CFG off
    if family == "flux":
        kw["guidance_scale"] = adapter.embedded_guidance   # FLUX.1-dev's embedded guidance
    return kw


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_resolves_by_family_and_dotpath(family):
    cls = adapter_class(family)
    assert cls is adapter_class(ADAPTER_PATHS[family])
    assert issubclass(cls, GenerativeModelAdapter) and cls.family == family
    cls.check_task("t2i")
    with pytest.raises(ValueError, match="GENERATION_TASKS"):
        cls.check_task("text_to_audio")
    with pytest.raises(ValueError, match="supports"):  # a task of another family (Wan's video)
        cls.check_task("t2v")


def test_adapter_class_rejects_unknown_paths():
    with pytest.raises(ValueError, match="neither a family"):
        adapter_class("no_such_family")
    with pytest.raises(ValueError, match="cannot import"):
        adapter_class("trainer.models.nothing.Here")
    with pytest.raises(ValueError, match="not a GenerativeModelAdapter"):
        adapter_class("torch.nn.Linear")


def test_unknown_options_are_rejected(tiny_model_dir):
    with pytest.raises(ValueError, match=r"unknown options \['bogus', 'guidance'\]"):
        adapter_class("qwen_image")(str(tiny_model_dir("qwen_image")), bogus=1, guidance=2)


@pytest.mark.parametrize("family", FAMILIES)
def test_encode_prompts_shapes(family, loaded):
    adapter, frozen, _ = loaded(family)
    cond = adapter.encode_prompts(frozen, PROMPTS)
    assert set(adapter.condition_keys) == set(cond)
    cfg = adapter.transformer_config
    embeds = cond["prompt_embeds"]
    assert embeds.shape[0] == 2 and embeds.shape[-1] == cfg["joint_attention_dim"]
    assert not torch.equal(embeds[0], embeds[1])
    if family == "qwen_image":
        mask = cond["prompt_embeds_mask"]
        assert mask.shape == embeds.shape[:2]
        lengths = mask.sum(1)
        assert lengths[0] < lengths[1] == embeds.shape[1]          # padded to the longer prompt
        assert embeds[0, lengths[0]:].abs().sum() == 0               # padding rows are zeros
    else:
        assert cond["pooled_prompt_embeds"].shape == (2, cfg["pooled_projection_dim"])
        t5_tokens = adapter.max_sequence_length
        assert embeds.shape[1] == (77 + t5_tokens if family == "sd3" else t5_tokens)


@pytest.mark.parametrize("family", FAMILIES)
def test_max_sequence_length_option_limits_text_tokens(family, loaded, tiny_model_dir):
    _, frozen, _ = loaded(family)
    short = adapter_class(family)(str(tiny_model_dir(family)), max_sequence_length=8)
    embeds = short.encode_prompts(frozen, PROMPTS)["prompt_embeds"]
    assert embeds.shape[1] == (77 + 8 if family == "sd3" else 8)


@pytest.mark.parametrize("family", FAMILIES)
def test_velocity_shape_and_determinism(family, loaded):
    adapter, frozen, transformer = loaded(family)
    cond = adapter.encode_prompts(frozen, PROMPTS)
    x = adapter.initial_latents(["s0", "s1"], Geometry(H, W), seed=3)
    assert x.shape == (2, *adapter.latent_shape(Geometry(H, W)))
    with torch.no_grad():
        v1 = adapter.velocity(transformer, x, torch.tensor([0.7, 0.7]), cond, Geometry(H, W))
        v2 = adapter.velocity(transformer, x, torch.tensor([0.7, 0.7]), cond, Geometry(H, W))
        v_scalar = adapter.velocity(transformer, x, torch.tensor(0.7), cond, Geometry(H, W))
        v_sigma = adapter.velocity(transformer, x, torch.tensor([0.7, 0.3]), cond, Geometry(H, W))
    assert v1.shape == x.shape and torch.isfinite(v1).all()
    assert torch.equal(v1, v2) and torch.equal(v1, v_scalar)
    assert torch.equal(v_sigma[0], v1[0]) and not torch.equal(v_sigma[1], v1[1])  # per-sample sigma


@pytest.mark.parametrize("family", FAMILIES)
def test_ode_sampling_and_decode_equal_the_diffusers_pipeline(family, loaded):
    """Adapter velocity + Euler step on adapter.scheduler_sigmas == pipeline(...) bit for bit."""
    adapter, frozen, transformer = loaded(family)
    adapter = as_the_pipeline_runs(adapter)
    steps = 3
    cond = adapter.encode_prompts(frozen, PROMPTS)
    x_t = adapter.initial_latents(["a", "b"], Geometry(H, W), seed=11)
    sigmas = adapter.scheduler_sigmas(steps, Geometry(H, W))
    x = x_t.clone()
    with torch.no_grad():
        for i in range(steps):
            v = adapter.velocity(transformer, x, sigmas[i].expand(2), cond, Geometry(H, W))
            x = x + (sigmas[i + 1] - sigmas[i]) * v            # ODE: mean = x + v * dt

    pipe = _pipeline_with(frozen, transformer)
    kw = _pipeline_kwargs(family, adapter, cond, x_t, steps)
    expected = pipe(**kw, output_type="latent").images
    assert torch.equal(pipe.scheduler.sigmas, sigmas)
    assert torch.equal(x, expected)

    images = adapter.decode(frozen, x, Geometry(H, W))
    assert images.shape == (2, H, W, 3) and images.dtype == torch.uint8
    reference = pipe(**kw, output_type="np").images                 # float in [0, 1]
    assert torch.equal(images, torch.from_numpy((reference * 255).round().astype("uint8")))


@pytest.mark.parametrize("family", FAMILIES)
def test_scheduler_sigmas_schedule(family, loaded):
    adapter = loaded(family)[0]
    sig = adapter.scheduler_sigmas(12, Geometry(H, W))
    assert sig.dtype == torch.float32 and sig.shape == (13,)
    assert sig[0] == 1.0 and sig[-1] == 0.0 and (sig[1:] < sig[:-1]).all()
    assert torch.allclose(adapter.timesteps_from_sigmas(sig), sig[:-1] * 1000)
    larger = adapter.scheduler_sigmas(12, Geometry(4 * H, 4 * W))
    if family == "sd3":  # static shift = 3 of the scheduler config, whatever the resolution
        assert torch.equal(sig, larger)
        # SD3's schedule written out: t spans the training sigmas' range [1, shift(1/1000)],
        # then shift=3 is applied: sigma = 3 t / (1 + 2 t).
        shift = lambda s: 3 * s / (1 + 2 * s)  # noqa: E731
        t = torch.linspace(1.0, shift(1 / 1000), 12, dtype=torch.float64)
        assert torch.allclose(sig[:-1].double(), shift(t), rtol=0, atol=1e-6)
    else:                # resolution-dependent mu: more latent tokens -> more shift toward 1
        assert (larger[1:-2] > sig[1:-2]).all()   # (Qwen-Image stretches both to end at 0.02)


def _recipe_draw(seed: int, sample_id: str, stream: str, shape) -> torch.Tensor:
    """The documented x_T recipe, written out independently of trainer.models.noise."""
    key = f"{seed}\x1f{sample_id}\x1f{stream}".encode()
    gen_seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & ((1 << 63) - 1)
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(gen_seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_initial_latents_and_step_noise_are_pure_functions_of_the_sample_id(family, loaded):
    adapter = loaded(family)[0]
    x_ab = adapter.initial_latents(["a", "b"], Geometry(H, W), seed=7)
    x_cb = adapter.initial_latents(["c", "b", "a"], Geometry(H, W), seed=7)
    assert torch.equal(x_ab[1], x_cb[1]) and torch.equal(x_ab[0], x_cb[2])   # batch-independent
    assert not torch.equal(x_ab[0], x_ab[1])                                  # candidates differ
    assert not torch.equal(adapter.initial_latents(["a"], Geometry(H, W), seed=8)[0], x_ab[0])
    # Unpacked with the pipeline's own helper, x_T is the recipe's draw in [C, h, w].
    raw = _recipe_draw(7, "b", "x_T", adapter.init_noise_shape(Geometry(H, W)))
    if family == "sd3":
        assert torch.equal(x_ab[1], raw)
    else:
        pipe_cls = type(loaded(family)[1]["pipeline"])
        unpacked = pipe_cls._unpack_latents(x_ab[1:2], H, W, loaded(family)[1]["pipeline"].vae_scale_factor)
        assert torch.equal(unpacked.reshape(raw.shape), raw)
    shape = adapter.latent_shape(Geometry(H, W))
    n2 = adapter.step_noise(["a", "b"], 2, shape, seed=7)
    assert n2.shape == (2, *shape)
    assert torch.equal(n2[1], _recipe_draw(7, "b", "step:2", shape))
    assert torch.equal(n2, adapter.step_noise(["a", "b"], 2, shape, seed=7))
    assert not torch.equal(n2, adapter.step_noise(["a", "b"], 3, shape, seed=7))
    bf16 = adapter.step_noise(["a", "b"], 2, shape, seed=7, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, n2.to(torch.bfloat16))


@pytest.mark.parametrize("family", FAMILIES)
def test_transformer_blocks(family, loaded):
    adapter, _, transformer = loaded(family)
    blocks = adapter.transformer_blocks(transformer)
    cfg = adapter.transformer_config
    assert len(blocks) == cfg["num_layers"] + cfg.get("num_single_layers", 0)
    assert all(isinstance(b, nn.Module) for b in blocks)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_targets_exist_and_peft_wraps_them(family, loaded):
    from peft import LoraConfig, get_peft_model

    adapter, frozen, reference = loaded(family)
    targets = adapter.lora_target_modules()
    names = [n for n, _ in reference.named_modules()]
    for target in targets:
        assert any(n.endswith("." + target) for n in names), f"{target} matches no module"
    wanted = {n for n, m in reference.named_modules()
              if isinstance(m, nn.Linear) and any(n.endswith("." + t) for t in targets)}

    model = get_peft_model(adapter.load_train_model(), LoraConfig(r=2, lora_alpha=4, target_modules=targets))
    wrapped = {n.removeprefix("base_model.model.") for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == wanted
    assert len(adapter.transformer_blocks(model)) == len(adapter.transformer_blocks(reference))

    cond = adapter.encode_prompts(frozen, PROMPTS[:1])
    x = adapter.initial_latents(["a"], Geometry(H, W), seed=1)
    with torch.no_grad():  # peft initialises B = 0: the wrapped model is the base model
        assert torch.equal(adapter.velocity(model, x, torch.tensor([0.5]), cond, Geometry(H, W)),
                           adapter.velocity(reference, x, torch.tensor([0.5]), cond, Geometry(H, W)))


@pytest.mark.parametrize("family", FAMILIES)
def test_weight_name_map_round_trip_through_a_merged_lora(family, loaded):
    """Trainer names (peft-wrapped) -> engine names load strictly into a fresh engine model,
    which then computes exactly what the merged trainer model computes."""
    from peft import LoraConfig, get_peft_model

    adapter, frozen, _ = loaded(family)
    model = get_peft_model(adapter.load_train_model(),
                           LoraConfig(r=2, lora_alpha=4, target_modules=adapter.lora_target_modules()))
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    model.merge_adapter()
    state = model.state_dict()                 # parameters and persistent buffers, peft names
    mapping = adapter.weight_name_map(state)
    assert len(set(mapping.values())) == len(mapping)
    engine = adapter.load_train_model()
    engine_modules = dict(engine.named_modules())
    lora = {k: v for k, v in mapping.items() if ".lora_" in k}
    assert lora and all(v.rsplit(".", 2)[0] in engine_modules and v.split(".")[-2] in ("lora_A", "lora_B")
                        for v in lora.values())

    merged_state = {mapping[n]: t for n, t in state.items() if n not in lora}
    engine.load_state_dict(merged_state, strict=True)      # every engine tensor named exactly once
    cond = adapter.encode_prompts(frozen, PROMPTS[:1])
    x = adapter.initial_latents(["a"], Geometry(H, W), seed=2)
    with torch.no_grad():
        v_train = adapter.velocity(model, x, torch.tensor([0.6]), cond, Geometry(H, W))
        v_engine = adapter.velocity(engine, x, torch.tensor([0.6]), cond, Geometry(H, W))
        v_base = adapter.velocity(adapter.load_train_model(), x, torch.tensor([0.6]), cond, Geometry(H, W))
    assert torch.equal(v_train, v_engine)
    assert not torch.equal(v_engine, v_base)                # the update really moved the weights


def test_flux_guidance_embedding_follows_the_transformer_config(loaded):
    """guidance_embeds=True: the fixed embedded_guidance is an input (changing it changes v);
    a transformer without the embedding gets no guidance and ignores the option."""
    from diffusers import FluxTransformer2DModel

    adapter, frozen, transformer = loaded("flux")
    assert transformer.config.guidance_embeds
    cond = adapter.encode_prompts(frozen, PROMPTS[:1])
    x = adapter.initial_latents(["a"], Geometry(H, W), seed=4)
    other = adapter_class("flux")(adapter.model_path, embedded_guidance=1.0)
    cfg = {k: v for k, v in transformer.config.items() if not k.startswith("_")}
    schnell = FluxTransformer2DModel(**{**cfg, "guidance_embeds": False})
    with torch.no_grad():
        assert not torch.equal(adapter.velocity(transformer, x, torch.tensor([0.5]), cond, Geometry(H, W)),
                               other.velocity(transformer, x, torch.tensor([0.5]), cond, Geometry(H, W)))
        assert torch.equal(adapter.velocity(schnell, x, torch.tensor([0.5]), cond, Geometry(H, W)),
                           other.velocity(schnell, x, torch.tensor([0.5]), cond, Geometry(H, W)))


def test_broken_tokenizer_is_rejected_at_load(tiny_model_dir, tmp_path):
    """A tokenizer that only knows its special tokens (what a failed offline lookup can yield)."""
    import json
    import shutil

    src = tiny_model_dir("qwen_image")
    dst = tmp_path / "broken"
    shutil.copytree(src, dst)
    tok = dst / "tokenizer"
    for f in tok.iterdir():
        f.unlink()
    (tok / "vocab.json").write_text(json.dumps({"<|endoftext|>": 0, "a": 1}))
    (tok / "merges.txt").write_text("#version: 0.2\n")
    (tok / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "Qwen2Tokenizer"}))
    with pytest.raises(ValueError, match=r"tokenizer has only \d+ tokens"):
        adapter_class("qwen_image")(str(dst)).load_frozen(device="cpu", dtype=torch.float32)


def test_qwen_channels_last_decoder_decodes_the_same_images(tiny_model_dir):
    """compile_frozen's layout change (channels-last convolution weights), on its own, leaves
    the images unchanged."""
    from trainer.models.qwen_image import _channels_last

    adapter = adapter_class("qwen_image")(str(tiny_model_dir("qwen_image")))
    frozen = adapter.load_frozen(device="cpu", dtype=torch.float32)
    x = torch.randn((2, *adapter.latent_shape(Geometry(H, W))), generator=torch.Generator().manual_seed(3))
    before = adapter.decode(frozen, x, Geometry(H, W))
    _channels_last(frozen["vae"].decoder)
    convs = [m for m in frozen["vae"].decoder.modules() if isinstance(m, torch.nn.Conv3d)
             and m.weight.shape[2:].numel() > 1]
    assert convs and all(m.weight.is_contiguous(memory_format=torch.channels_last_3d)
                         and not m.weight.is_contiguous() for m in convs)
    assert torch.equal(adapter.decode(frozen, x, Geometry(H, W)), before)



@pytest.fixture
def attention_registry():
    """diffusers' attention-backend registry, its active backend and functions put back after
    the test (set_attention_backend also sets the process-wide active backend)."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry as registry

    active, functions = registry._active_backend, dict(registry._backends)
    yield registry
    registry._active_backend = active
    registry._backends.clear()
    registry._backends.update(functions)


@pytest.mark.parametrize("family", ["qwen_image", "flux"])
def test_the_attention_backend_option_runs_the_chosen_kernel(family, loaded, tiny_model_dir,
                                                             attention_registry):
    """model.adapter_options.attention_backend: every attention call of the loaded
    transformer goes to that backend, and the velocity stays diffusers' default one's."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    default_adapter, frozen, default_model = loaded(family)
    cond = default_adapter.encode_prompts(frozen, PROMPTS)
    x = default_adapter.initial_latents(["s0", "s1"], Geometry(H, W), seed=3)
    sigma = torch.tensor([0.7, 0.3])
    with torch.no_grad():
        want = default_adapter.velocity(default_model, x, sigma, cond, Geometry(H, W))
    math = AttentionBackendName._NATIVE_MATH
    calls = []
    kernel = attention_registry._backends[math]
    attention_registry._backends[math] = lambda **kw: calls.append(1) or kernel(**kw)
    adapter = adapter_class(family)(str(tiny_model_dir(family)), attention_backend=math.value)
    model = adapter.load_train_model(dtype=torch.float32)
    with torch.no_grad():
        got = adapter.velocity(model, x, sigma, cond, Geometry(H, W))
    blocks = len(adapter.transformer_blocks(model))
    assert len(calls) >= blocks  # at least one attention per block, each through the choice
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_an_attention_backend_that_cannot_run_is_refused(tiny_model_dir, attention_registry):
    qwen, sd3 = (str(tiny_model_dir(f)) for f in ("qwen_image", "sd3"))
    with pytest.raises(ValueError, match="'nope' is not one of diffusers' attention backends"):
        adapter_class("qwen_image")(qwen, attention_backend="nope")
    try:
        import flash_attn  # noqa: F401
    except ImportError:  # diffusers' own requirement check, before any weight is loaded
        with pytest.raises(ValueError, match="'flash' cannot run here"):
            adapter_class("qwen_image")(qwen, attention_backend="flash")
    # processors that call torch's attention directly would ignore it without a word
    with pytest.raises(ValueError, match="ignored by this diffusers release's attention "
                                         r"processors \['JointAttnProcessor2_0'\]"):
        adapter_class("sd3")(sd3, attention_backend="_native_math").load_train_model()


@pytest.mark.parametrize("length", [3, 8, 11])
def test_qwen_pads_the_joint_sequence_to_a_multiple_with_masked_tokens(loaded, length):
    """Image + text tokens reach the transformer as a multiple of 8; the padding is masked, so
    the velocity is the unpadded one up to rounding. 1 turns the padding off."""
    adapter, _, transformer = loaded("qwen_image")
    torch.manual_seed(length)
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, length - 2:] = 0  # the shorter prompt of a batch, already padded by the pipeline
    cond = {"prompt_embeds": torch.randn(2, length, adapter.transformer_config["joint_attention_dim"]),
            "prompt_embeds_mask": mask}
    x = adapter.initial_latents(["s0", "s1"], Geometry(H, W), seed=3)
    seen = []
    hook = transformer.register_forward_pre_hook(
        lambda _, args, kwargs: seen.append((kwargs["encoder_hidden_states"].clone(),
                                             kwargs["encoder_hidden_states_mask"].clone())),
        with_kwargs=True)
    try:
        with torch.no_grad():
            padded = adapter.velocity(transformer, x, torch.tensor(0.6), cond, Geometry(H, W))
            plain = as_the_pipeline_runs(adapter).velocity(transformer, x, torch.tensor(0.6),
                                                           cond, Geometry(H, W))
    finally:
        hook.remove()
    (embeds, sent_mask), (plain_embeds, _) = seen
    assert plain_embeds.shape[1] == length
    assert (x.shape[1] + embeds.shape[1]) % 8 == 0 and 0 <= embeds.shape[1] - length < 8
    assert torch.equal(embeds[:, :length], cond["prompt_embeds"])
    assert torch.equal(sent_mask[:, :length], mask) and not sent_mask[:, length:].any()
    assert torch.allclose(padded, plain, rtol=0, atol=1e-5)


@pytest.mark.parametrize("value", [0, -8, 2.5, True, "8"])
def test_qwen_joint_tokens_multiple_must_be_a_positive_integer(tiny_model_dir, value):
    with pytest.raises(ValueError, match="joint_tokens_multiple must be an integer >= 1"):
        adapter_class("qwen_image")(str(tiny_model_dir("qwen_image")), joint_tokens_multiple=value)
