"""The toy model: directory round trip, adapter contract, seeded noise, pretrain determinism,
and the shipped weights loading through ToyAdapter and sampling better than noise."""
from __future__ import annotations

import json
import multiprocessing
import os
from trainer.models.geometry import Geometry

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

pytest.importorskip("diffusers")     # the GPU box may lack it; there only the reward tests run
pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from trainer.models import noise
from trainer.models.base import GenerativeModelAdapter
from trainer.toy import modeling, weights_dir, world
from trainer.toy.adapter import ToyAdapter
from trainer.toy.evaluate import sample_images
from trainer.toy.pretrain import main as pretrain_main, pretrain, training_batches
from trainer.toy.reward import ToyCompositionScorer

# one intra-op thread: tiny models gain nothing from more (see tests/conftest.py)
pytestmark = pytest.mark.usefixtures("torch_single_thread")

TINY_TRANSFORMER = dict(patch_size=4, attention_head_dim=8, num_attention_heads=2, num_layers=2,
                        pos_embed_max_size=8)
TINY_TEXT = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    tr, te, tok = modeling.build_untrained(0, transformer=TINY_TRANSFORMER, text_encoder=TINY_TEXT)
    return modeling.save_model_dir(tmp_path_factory.mktemp("toy") / "model", transformer=tr,
                                   text_encoder=te, tokenizer=tok, resolution=32)


def test_directory_is_diffusers_style_and_loads_through_from_pretrained(tiny_dir):
    index = json.loads((tiny_dir / "model_index.json").read_text())
    assert index["transformer"] == ["diffusers", "SD3Transformer2DModel"]
    assert index["text_encoder"] == ["transformers", "CLIPTextModel"]
    for sub in ("transformer", "text_encoder", "tokenizer", "scheduler"):
        assert (tiny_dir / sub).is_dir()
    tok_cfg = json.loads((tiny_dir / "tokenizer" / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast"   # loadable by transformers 4
    adapter = ToyAdapter(tiny_dir)
    assert isinstance(adapter, GenerativeModelAdapter)
    model = adapter.load_train_model()
    assert len(adapter.transformer_blocks(model)) == 2
    frozen = adapter.load_frozen(device="cpu", dtype=torch.float32)
    assert not any(p.requires_grad for p in frozen["text_encoder"].parameters())


def test_tokenizer_is_word_level_over_the_world_and_pools_at_eos(tiny_dir):
    adapter = ToyAdapter(tiny_dir)
    frozen = adapter.load_frozen()
    tok = frozen["tokenizer"]
    prompts = [world.spec_to_prompt(s) for s in world.all_specs()]
    ids = adapter.tokenize(tok, prompts)
    assert ids.shape == (len(prompts), modeling.MAX_PROMPT_TOKENS)
    assert not (ids == tok.unk_token_id).any()
    n_words = torch.tensor([len(p.split()) for p in prompts])
    assert torch.all((ids == tok.eos_token_id).int().argmax(1) == n_words + 1)
    assert tok.eos_token_id != 2   # CLIPTextModel's legacy argmax pooling
    # pooled output is the EOS position's hidden state, so padding cannot move it
    cond = adapter.encode_prompts(frozen, ["a red circle", "two blue squares above a red circle"])
    assert cond["prompt_embeds"].shape == (2, modeling.MAX_PROMPT_TOKENS, 16)
    assert torch.allclose(cond["pooled_prompt_embeds"][0], cond["prompt_embeds"][0, 4])
    with pytest.raises(ValueError, match="0: .* 1: "):
        adapter.tokenize(tok, ["a " * 20, "red " * 11])


def test_velocity_survives_the_save_load_round_trip(tiny_dir, tmp_path):
    adapter = ToyAdapter(tiny_dir)
    model, frozen = adapter.load_train_model(), adapter.load_frozen()
    cond = adapter.encode_prompts(frozen, ["a red circle", "three green squares"])
    x = adapter.initial_latents(["a", "b"], Geometry(32, 32), seed=0)
    v = adapter.velocity(model, x, torch.tensor([0.9, 0.3]), cond, Geometry(32, 32))
    assert v.shape == x.shape == (2, *adapter.latent_shape(Geometry(32, 32))) == (2, 3, 32, 32)
    # same forward, called the way the diffusers pipeline does
    ref = model(hidden_states=x, encoder_hidden_states=cond["prompt_embeds"],
                pooled_projections=cond["pooled_prompt_embeds"],
                timestep=torch.tensor([900.0, 300.0])).sample
    assert torch.equal(v, ref)
    # scalar sigma broadcasts
    v_scalar = adapter.velocity(model, x, torch.tensor(0.5), cond, Geometry(32, 32))
    assert torch.equal(v_scalar, adapter.velocity(model, x, torch.full((2,), 0.5), cond, Geometry(32, 32)))
    with pytest.raises(ValueError, match="height=30.*width=64"):
        adapter.latent_shape(Geometry(30, 64))


def test_noise_is_a_pure_function_of_seed_id_and_step(tiny_dir):
    adapter = ToyAdapter(tiny_dir)
    a = adapter.initial_latents(["p:0:sample:0", "p:0:sample:1"], Geometry(32, 32), seed=5)
    b = adapter.initial_latents(["p:0:sample:1", "x", "p:0:sample:0"], Geometry(32, 32), seed=5)
    assert a.shape == (2, 3, 32, 32)
    assert torch.equal(a[0], b[2]) and torch.equal(a[1], b[0])
    assert not torch.equal(a[0], a[1])
    assert not torch.equal(a, adapter.initial_latents(["p:0:sample:0", "p:0:sample:1"], Geometry(32, 32),
                                                      seed=6))
    assert a.std().item() == pytest.approx(1.0, abs=0.05)
    # the project's shared x_T recipe, so engines and drivers agree on toy candidates
    assert torch.equal(a, noise.gaussian(["p:0:sample:0", "p:0:sample:1"],
                                         noise.initial_stream(), (3, 32, 32), seed=5))
    n3 = adapter.step_noise(["u", "v"], 3, (3, 32, 32), seed=5)
    assert n3.shape == (2, 3, 32, 32)
    assert torch.equal(n3[1], adapter.step_noise(["v"], 3, (3, 32, 32), seed=5)[0])
    assert not torch.equal(n3, adapter.step_noise(["u", "v"], 4, (3, 32, 32), seed=5))
    assert not torch.equal(n3[0], adapter.initial_latents(["u"], Geometry(32, 32), seed=5)[0])
    half = adapter.step_noise(["u"], 3, (3, 32, 32), seed=5, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16 and torch.equal(half[0], n3[0].bfloat16())


def test_schedule_and_option_checks(tiny_dir):
    adapter = ToyAdapter(tiny_dir)
    sigmas = adapter.scheduler_sigmas(8, Geometry(32, 32))
    assert sigmas.shape == (9,) and sigmas[0] == 1.0 and sigmas[-1] == 0.0
    assert torch.all(sigmas[1:] < sigmas[:-1])
    assert torch.equal(adapter.timesteps_from_sigmas(sigmas), sigmas[:-1] * 1000)
    assert adapter.resolution_problems(Geometry(32, 32)) == []
    assert len(adapter.resolution_problems(Geometry(30, 64))) == 2
    with pytest.raises(ValueError, match="max_sequence_length=40"):
        ToyAdapter(tiny_dir, max_sequence_length=40)
    with pytest.raises(ValueError, match="unknown options"):
        ToyAdapter(tiny_dir, colour="red")
    with pytest.raises(FileNotFoundError, match="missing"):
        ToyAdapter(tiny_dir / "transformer")


def test_lora_targets_match_the_transformer(tiny_dir):
    from peft import LoraConfig, get_peft_model
    adapter = ToyAdapter(tiny_dir)
    model = get_peft_model(adapter.load_train_model(),
                           LoraConfig(r=2, target_modules=adapter.lora_target_modules()))
    names = [n for n, _ in model.named_modules() if n.endswith("lora_A")]
    for target in adapter.lora_target_modules():
        assert any(n.endswith(f"{target}.lora_A") for n in names), target


def test_pretrain_is_deterministic_for_a_seed(tmp_path):
    kw = dict(steps=3, minutes=5, batch=4, warmup=1, threads=1, log_every=1000,
              transformer_config=TINY_TRANSFORMER, text_encoder_config=TINY_TEXT)
    infos = [pretrain(tmp_path / name, seed=seed, **kw)
             for name, seed in (("a", 1), ("b", 1), ("c", 2))]
    assert all(i["steps"] == 3 and not i["stopped_early"] for i in infos)
    w = {n: load_file(tmp_path / n / "transformer" / "diffusion_pytorch_model.safetensors")
         for n in "abc"}
    init, _, _ = modeling.build_untrained(1, transformer=TINY_TRANSFORMER, text_encoder=TINY_TEXT)
    key = "transformer_blocks.0.attn.to_q.weight"
    assert all(torch.equal(w["a"][k], w["b"][k]) for k in w["a"])
    assert not torch.equal(w["a"][key], w["c"][key])
    assert not torch.equal(w["a"][key], init.state_dict()[key])   # it trained
    info = json.loads((tmp_path / "a" / "toy_config.json").read_text())["info"]
    assert info["seed"] == 1 and info["steps"] == 3
    ToyAdapter(tmp_path / "a")   # loadable


def test_pretrain_options_ship_with_the_weights(tmp_path):
    """--sigma-sampling uniform trains differently; --pos-embed-scale survives save/load."""
    kw = dict(steps=2, minutes=5, batch=4, warmup=1, threads=1, log_every=1000,
              transformer_config=TINY_TRANSFORMER, text_encoder_config=TINY_TEXT)
    pretrain(tmp_path / "base", seed=1, **kw)
    pretrain(tmp_path / "opt", seed=1, sigma_sampling="uniform", pos_embed_scale=4.0, **kw)
    w = {n: load_file(tmp_path / n / "transformer" / "diffusion_pytorch_model.safetensors")
         for n in ("base", "opt")}
    init, _, _ = modeling.build_untrained(1, transformer=TINY_TRANSFORMER, text_encoder=TINY_TEXT)
    table = init.state_dict()["pos_embed.pos_embed"]
    assert torch.equal(w["base"]["pos_embed.pos_embed"], table)
    assert torch.equal(w["opt"]["pos_embed.pos_embed"], 4.0 * table)
    loaded = ToyAdapter(tmp_path / "opt").load_train_model()
    assert torch.equal(loaded.pos_embed.pos_embed, 4.0 * table)
    info = json.loads((tmp_path / "opt" / "toy_config.json").read_text())["info"]
    assert info["sigma_sampling"] == "uniform" and info["pos_embed_scale"] == 4.0
    with pytest.raises(ValueError, match="sigma_sampling"):
        pretrain(tmp_path / "bad", seed=1, sigma_sampling="cosine", **kw)


def test_pretrain_continues_from_a_model_directory_with_caption_noise(tmp_path):
    """--init starts from the given weights (not a fresh init); --caption-noise is recorded and
    changes what is trained on."""
    kw = dict(steps=2, minutes=5, batch=4, warmup=1, threads=1, log_every=1000,
              transformer_config=TINY_TRANSFORMER, text_encoder_config=TINY_TEXT)
    pretrain(tmp_path / "base", seed=1, **kw)
    base = load_file(tmp_path / "base" / "transformer" / "diffusion_pytorch_model.safetensors")
    out = {}
    fresh_only = ("transformer_config", "text_encoder_config")
    cont = {k: v for k, v in kw.items() if k not in fresh_only}
    for name, rate in (("clean", 0.0), ("noisy", 0.5)):
        pretrain(tmp_path / name, seed=3, init=tmp_path / "base", caption_noise=rate,
                 **{**cont, "steps": 1})
        out[name] = load_file(tmp_path / name / "transformer" /
                              "diffusion_pytorch_model.safetensors")
    key = "transformer_blocks.0.attn.to_q.weight"
    fresh, _, _ = modeling.build_untrained(3, transformer=TINY_TRANSFORMER, text_encoder=TINY_TEXT)
    # one step from the base: close to it, far from a fresh init of the same seed
    step = (out["clean"][key] - base[key]).abs().max()
    assert 0 < step < (out["clean"][key] - fresh.state_dict()[key]).abs().max()
    assert not torch.equal(out["clean"][key], out["noisy"][key])  # other images, other step
    info = json.loads((tmp_path / "noisy" / "toy_config.json").read_text())["info"]
    assert info["caption_noise"] == 0.5 and info["init"] == str(tmp_path / "base")
    # options that shape a fresh model are refused with init, all named in one error
    with pytest.raises(ValueError, match="transformer_config.*pos_embed_scale.*caption_noise|"
                                         "caption_noise.*transformer_config.*pos_embed_scale"):
        pretrain(tmp_path / "bad", init=tmp_path / "base", pos_embed_scale=2.0,
                 caption_noise=1.5, **kw)


def test_pretrain_cli_rejects_bad_arguments_at_once(capsys):
    with pytest.raises(SystemExit):
        pretrain_main(["--out", "x", "--minutes", "0", "--steps", "-1", "--caption-noise", "1"])
    err = capsys.readouterr().err
    assert "--minutes=0.0" in err and "--steps=-1" in err and "--caption-noise=1.0" in err


def test_shipped_weights_sample_better_than_noise():
    path = weights_dir()
    sizes = [p.stat().st_size for p in path.rglob("*.safetensors")]
    assert len(sizes) == 2 and sum(sizes) < 8 * 2 ** 20
    adapter = ToyAdapter()   # default = shipped weights
    assert adapter.root == path
    records = world.make_prompt_records(48, seed=0, split="eval")
    prompts = [r["prompt"] for r in records]
    ids = [r["metadata"]["sample_id"] for r in records]
    model = adapter.load_train_model().eval()
    frozen = adapter.load_frozen()
    images = sample_images(adapter, model, frozen, prompts, ids, num_steps=8, seed=0)
    assert images.shape == (48, adapter.resolution, adapter.resolution, 3)
    assert images.dtype == torch.uint8
    # The same call is bit-for-bit repeatable. A sub-batch draws the same per-id noise but its
    # CPU matmuls block differently with the batch size, so a float sum can round a pixel to the
    # neighbouring uint8 level (seen with one thread: 1 pixel of 12,288); a noise mix-up between
    # ids would move whole images, far beyond one level.
    assert torch.equal(images, sample_images(adapter, model, frozen, prompts, ids, num_steps=8,
                                             seed=0))
    part = sample_images(adapter, model, frozen, prompts[:4], ids[:4], num_steps=8, seed=0)
    level_steps = (part.int() - images[:4].int()).abs()
    assert level_steps.max() <= 1 and (level_steps > 0).float().mean() < 1e-3, level_steps.sum()
    scorer = ToyCompositionScorer()
    metadata = [r["metadata"] for r in records]
    noise = adapter.decode(frozen, adapter.initial_latents(ids, Geometry(32, 32), seed=0), Geometry(32, 32))
    model_reward = torch.stack(list(scorer.score(images, prompts, metadata).values())).mean()
    noise_reward = torch.stack(list(scorer.score(noise, prompts, metadata).values())).mean()
    assert model_reward > noise_reward + 0.2, (model_reward, noise_reward)


def test_evaluate_runs_ode_and_sde_and_writes_a_grid(tiny_dir, tmp_path):
    from trainer.toy.evaluate import evaluate, image_grid, main as evaluate_main
    adapter = ToyAdapter(tiny_dir)
    ode = evaluate(adapter, n=6, num_steps=3, seed=1)
    assert set(ode["reward"]) == {"color", "count", "position", "mean"}
    assert ode["images"].shape == (6, 32, 32, 3)
    sde = evaluate(adapter, n=6, num_steps=3, seed=1, eta=0.7)
    assert not torch.equal(ode["images"], sde["images"])       # noise was injected
    assert torch.equal(sde["images"], evaluate(adapter, n=6, num_steps=3, seed=1,
                                               eta=0.7)["images"])
    grid = image_grid(ode["images"], cols=4, scale=2)
    assert grid.shape == (2 * (2 * 33 + 1), 2 * (4 * 33 + 1), 3)
    assert evaluate_main(["--model", str(tiny_dir), "--n", "2", "--steps", "2",
                          "--grid", str(tmp_path / "g.png")]) == 0
    assert (tmp_path / "g.png").stat().st_size > 0


def test_sde_steps_as_a_count_or_a_list_of_steps(tiny_dir):
    """``sde_steps=N`` is the list of the first N steps; an empty list is the ODE; noise at
    step 1 alone gives images unlike both."""
    adapter = ToyAdapter(tiny_dir)
    model, frozen = adapter.load_train_model().eval(), adapter.load_frozen()
    prompts, ids = ["two red circles", "a blue square"], ["a", "b"]

    def sample(**kw):
        return sample_images(adapter, model, frozen, prompts, ids, num_steps=4, seed=3,
                             sigma_one="clamp_to_next", **kw)

    first_two = sample(eta=0.7, sde_steps=2)
    assert torch.equal(first_two, sample(eta=0.7, sde_steps=[0, 1]))
    assert torch.equal(sample(), sample(eta=0.7, sde_steps=[]))
    only_one = sample(eta=0.7, sde_steps=[1])
    assert not torch.equal(only_one, first_two) and not torch.equal(only_one, sample())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_shipped_model_samples_the_same_on_cuda():
    adapter = ToyAdapter()
    records = world.make_prompt_records(64, seed=0, split="eval")
    prompts = [r["prompt"] for r in records]
    ids = [r["metadata"]["sample_id"] for r in records]
    out = {}
    for device in ("cpu", "cuda"):
        model = adapter.load_train_model(device=device).eval()
        frozen = adapter.load_frozen(device=device)
        out[device] = sample_images(adapter, model, frozen, prompts, ids, num_steps=10, seed=0)
    # same x_T (CPU-drawn recipe) and weights: only float rounding differs between devices
    diff = (out["cpu"].int() - out["cuda"].int()).abs()
    assert diff.float().mean() < 1.0 and (diff > 16).float().mean() < 0.01
    scorer = ToyCompositionScorer()
    metadata = [r["metadata"] for r in records]
    means = {d: torch.stack(list(scorer.score(img, prompts, metadata).values())).mean()
             for d, img in out.items()}
    assert abs(means["cpu"] - means["cuda"]) < 0.05


def test_render_workers_give_the_same_batches_for_any_worker_count():
    """Batches rendered in worker processes depend on the seed only, not on how many workers
    render them; a different seed gives different batches; x0 stays in [-1, 1]."""
    def first_batches(seed, workers, n=2):
        gen = training_batches(seed, 6, 16, caption_noise=0.3, render_workers=workers)
        try:
            return [next(gen) for _ in range(n)]
        finally:
            gen.close()

    one, two, other = first_batches(5, 1), first_batches(5, 2), first_batches(6, 2)
    assert not multiprocessing.active_children()                  # closing stopped the workers
    for (p1, x1), (p2, x2) in zip(one, two):
        assert p1 == p2 and torch.equal(x1, x2)
    assert x1.shape == (6, 3, 16, 16) and x1.min() >= -1 and x1.max() <= 1
    assert x1.abs().sum() > 0                                     # objects were drawn
    assert not torch.equal(one[0][1], other[0][1])


def test_a_stuck_render_worker_stops_the_batches_with_an_error(monkeypatch):
    """A worker that returns nothing within RENDER_TIMEOUT_S raises (here: the timeout is
    shorter than a spawned worker's start) and closing the batches stops the workers."""
    import trainer.toy.pretrain as pretrain_mod
    monkeypatch.setattr(pretrain_mod, "RENDER_TIMEOUT_S", 0.001)
    gen = training_batches(5, 4, 16, render_workers=1, prefetch=1)
    with pytest.raises(RuntimeError, match="render worker returned no images"):
        next(gen)
    gen.close()
    assert not multiprocessing.active_children()


def test_pretrain_with_render_workers_is_deterministic(tmp_path):
    kw = dict(steps=2, minutes=5, batch=4, warmup=1, threads=1, log_every=1000,
              transformer_config=TINY_TRANSFORMER, text_encoder_config=TINY_TEXT)
    for name, workers in (("w1", 1), ("w2", 2)):
        info = pretrain(tmp_path / name, seed=1, render_workers=workers, **kw)
        assert info["render_workers"] == workers and info["device"] == "cpu"
    w = {n: load_file(tmp_path / n / "transformer" / "diffusion_pytorch_model.safetensors")
         for n in ("w1", "w2")}
    assert all(torch.equal(w["w1"][k], w["w2"][k]) for k in w["w1"])
