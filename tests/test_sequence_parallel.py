"""Sequence parallelism (``fsdp.sequence_parallel``) at two gloo ranks equals one rank.

Each spawned rank builds the same transformer twice: once plain (the one-rank run) and once
split over the two-rank sequence group by ``trainer.parallel`` (diffusers' Ulysses context
parallelism, FSDP2 sharding every parameter over both ranks). Both replay the same SDE
transition: the velocity goes through the reference log-prob of ``flowgrpo_kernels`` and a
clipped-free loss (the mean log-prob times an advantage) is backpropagated. The log-probs and
every parameter's full gradient must agree to fp32 rounding. With two ranks the mesh is data 1 x
sequence 2: FSDP2's data dimension is composed but of size one.

The tiny Wan transformer is diffusers' ``WanTransformer3DModel`` built from a small config (the
Wan adapter is not part of this tree); the tiny Qwen-Image is the test model directory loaded
through the Qwen-Image adapter's own loading code.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dist_fixtures import run_on_gloo_ranks
from flowgrpo_kernels.sde_reference import sde_log_prob_ref
from trainer.actor.model import apply_fsdp, strip_wrapper_names
from trainer.config import FSDPConfig, LoRAConfig
from trainer.parallel.rules import model_problems, world_problems
from trainer.parallel.sequence import (apply_sequence_parallel, build_mesh,
                                       shard_over_data_and_sequence)

SIGMA, SIGMA_NEXT, ETA = 0.7, 0.6, 0.8


def _replay(model, inputs: dict, x: torch.Tensor, x_next: torch.Tensor, advantages,
            scale: float = 1.0):
    """Log-probs of the transition x -> x_next under the model's velocity, and the loss's
    backward into the model's parameters."""
    v = model(**inputs, return_dict=False)[0]
    log_prob = sde_log_prob_ref(x, v, x_next, SIGMA, SIGMA_NEXT, eta=ETA, sde_type="sde")
    (-scale * (advantages * log_prob).mean()).backward()
    return log_prob.detach()


def _full_grads(model) -> dict[str, torch.Tensor]:
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:  # a parameter this forward does not use (same on both sides)
            continue
        grads[strip_wrapper_names(name)] = (g.full_tensor() if isinstance(g, DTensor)
                                            else g).clone()
    return grads


def _split_and_shard(model, sequence_degree: int):
    pm = build_mesh(sequence_degree)
    apply_sequence_parallel(model, pm)
    blocks = getattr(model, "blocks", None) or model.transformer_blocks
    shard_over_data_and_sequence(model, list(blocks), pm)


def _actor_apply_fsdp(model, sequence_degree: int):
    """The actor's own FSDP2 entry with the option on (fp32 compute and reduce, so that the
    comparison stays at fp32 rounding)."""
    fsdp = FSDPConfig(param_dtype="fp32", reduce_dtype="fp32", sequence_parallel=sequence_degree)
    apply_fsdp(model, list(model.blocks), fsdp, LoRAConfig())


def _compare_with_one_rank(build, make_inputs, sequence_degree: int = 2,
                           split=_split_and_shard) -> None:
    """On each rank: the split model's replay of its data group's samples against one plain
    model replaying every data group's samples (the gradient of the mean of the groups'
    losses, which is what FSDP2's mean over data groups computes)."""
    two = build()
    data_degree = dist.get_world_size() // sequence_degree
    data_rank = dist.get_rank() // sequence_degree  # sequence groups are neighbouring ranks

    one = build()
    log_prob_one = None
    for group in range(data_degree):
        inputs, x, x_next, adv = make_inputs(one, seed=group)
        log_prob = _replay(one, inputs, x, x_next, adv, scale=1 / data_degree)
        log_prob_one = log_prob if group == data_rank else log_prob_one
    grads_one = _full_grads(one)

    split(two, sequence_degree)
    log_prob_two = _replay(two, *make_inputs(two, seed=data_rank))
    grads_two = _full_grads(two)

    torch.testing.assert_close(log_prob_two, log_prob_one, rtol=1e-5, atol=1e-6)
    assert grads_two.keys() == grads_one.keys() and grads_one
    for name, g in grads_one.items():
        torch.testing.assert_close(grads_two[name], g, rtol=1e-4, atol=1e-6, msg=name)


def _tiny_wan():
    from diffusers import WanTransformer3DModel
    torch.manual_seed(0)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8,
                                 in_channels=4, out_channels=4, text_dim=16, freq_dim=16,
                                 ffn_dim=32, num_layers=2, rope_max_seq_len=32)


def _wan_inputs(model, seed: int = 0, frames: int = 3, side: int = 4):
    g = torch.Generator().manual_seed(1 + seed)
    x = torch.randn(2, 4, frames, side, side, generator=g)
    inputs = dict(hidden_states=x, timestep=torch.tensor([700, 700]),
                  encoder_hidden_states=torch.randn(2, 5, 16, generator=g))
    return inputs, x, x + 0.1 * torch.randn(x.shape, generator=g), torch.tensor([1.0, -0.5])


def _wan_check() -> None:
    _compare_with_one_rank(_tiny_wan, _wan_inputs)


def _wan_actor_check() -> None:
    _compare_with_one_rank(_tiny_wan, _wan_inputs, split=_actor_apply_fsdp)


def _checkpointed_and_split(model, sequence_degree: int):
    """The blocks wrapped for activation checkpointing first, then split and sharded through
    the actor's FSDP2 entry (``build_actor``'s order): the plan's block keys name wrappers."""
    from trainer.actor.model import apply_activation_checkpointing

    blocks = getattr(model, "blocks", None) or model.transformer_blocks
    apply_activation_checkpointing(model, list(blocks))
    blocks = getattr(model, "blocks", None) or model.transformer_blocks
    fsdp = FSDPConfig(param_dtype="fp32", reduce_dtype="fp32", sequence_parallel=sequence_degree)
    apply_fsdp(model, list(blocks), fsdp, LoRAConfig())


def _wan_checkpointed_check() -> None:
    _compare_with_one_rank(_tiny_wan, _wan_inputs, split=_checkpointed_and_split)


def _compiled_checkpointed_and_split(model, sequence_degree: int):
    """``build_actor``'s order on a GPU with the Wan recipes' defaults: checkpoint wrappers,
    then each (wrapped) block compiled, then the split and FSDP2."""
    from trainer.actor.model import apply_activation_checkpointing
    from trainer.models.compile import compile_blocks

    apply_activation_checkpointing(model, list(model.blocks))
    compile_blocks(list(model.blocks))
    fsdp = FSDPConfig(param_dtype="fp32", reduce_dtype="fp32", sequence_parallel=sequence_degree)
    apply_fsdp(model, list(model.blocks), fsdp, LoRAConfig())


def _wan_compiled_check() -> None:
    from trainer.models.compile import compile_events

    before = compile_events()
    _compare_with_one_rank(_tiny_wan, _wan_inputs, split=_compiled_checkpointed_and_split)
    assert compile_events() > before  # the blocks ran compiled


def _wan_odd_tokens_check() -> None:
    from diffusers import ContextParallelConfig
    if torch.accelerator.device_count() == 0:  # the original setup, which the CPU patch is for
        with pytest.raises(ZeroDivisionError):
            _tiny_wan().enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))
    model = _tiny_wan()
    apply_sequence_parallel(model, build_mesh(2))
    inputs, *_ = _wan_inputs(model, frames=3, side=2)  # 3 x 1 x 1 = 3 tokens
    with pytest.raises(ValueError, match="image tokens length 3"):
        model(**inputs, return_dict=False)


def test_a_tiny_wan_split_over_two_gloo_ranks_replays_like_one_rank():
    run_on_gloo_ranks(_wan_check)


def test_two_data_groups_of_two_sequence_ranks_train_like_one_rank_on_both_groups():
    """Four gloo ranks, data 2 x sequence 2: FSDP2's reduce sums over the sequence group and
    averages over the data groups."""
    run_on_gloo_ranks(_wan_check, world=4)


def test_the_actors_fsdp2_entry_splits_the_sequence_when_the_option_is_on():
    run_on_gloo_ranks(_wan_actor_check)


def test_the_split_composes_with_activation_checkpointing():
    """diffusers finds a block's split inputs by its forward's signature, which torch's
    checkpoint wrapper hides: the plan is pointed at the wrapped blocks."""
    run_on_gloo_ranks(_wan_checkpointed_check)


@pytest.mark.slow
def test_the_split_composes_with_per_block_compile_and_activation_checkpointing():
    """The order and options a GPU run of the Wan recipes uses (inductor on the CPU here)."""
    run_on_gloo_ranks(_wan_compiled_check)


def test_a_forward_whose_tokens_the_degree_does_not_divide_is_refused_by_name():
    """Also: without the CPU patch diffusers' own setup fails on a host without an
    accelerator, which is why the patch exists."""
    run_on_gloo_ranks(_wan_odd_tokens_check)


def _qwen_check(model_dir: str, text: int = 6, checkpointed: bool = False) -> None:
    from trainer.models.qwen_image import QwenImageAdapter

    def build():
        model = QwenImageAdapter(model_dir).load_train_model().float()
        model.requires_grad_(True)
        return model

    def make_inputs(model, seed: int = 0):
        g = torch.Generator().manual_seed(1 + seed)
        batch, side = 2, 4
        mask = torch.ones(batch, text, dtype=torch.long)
        mask[1, 4:] = 0  # a shorter prompt, padded: the mask is split with the text
        x = torch.randn(batch, side * side, model.config.in_channels, generator=g)
        inputs = dict(hidden_states=x, timestep=torch.tensor([0.7, 0.7]),
                      encoder_hidden_states=torch.randn(batch, text,
                                                        model.config.joint_attention_dim,
                                                        generator=g),
                      encoder_hidden_states_mask=mask, img_shapes=[[(1, side, side)]] * batch)
        v_shape = (batch, side * side, model.config.out_channels * 4)
        x = torch.randn(v_shape, generator=g)
        return inputs, x, x + 0.1 * torch.randn(v_shape, generator=g), torch.tensor([0.5, -1.0])

    _compare_with_one_rank(build, make_inputs,
                           split=_checkpointed_and_split if checkpointed else _split_and_shard)


def test_a_tiny_qwen_image_split_over_two_gloo_ranks_replays_like_one_rank(tiny_model_dir):
    run_on_gloo_ranks(functools.partial(_qwen_check, str(tiny_model_dir("qwen_image"))))


def test_a_qwen_image_prompt_length_the_degree_does_not_divide_is_padded_not_refused(
        tiny_model_dir):
    """Five text tokens over two ranks: the split pads the text with masked tokens (the
    adapter's own alignment padding), and the velocity is the unpadded one's."""
    run_on_gloo_ranks(functools.partial(_qwen_check, str(tiny_model_dir("qwen_image")), 5))


def test_a_checkpointed_qwen_image_split_over_two_gloo_ranks_replays_like_one_rank(
        tiny_model_dir):
    run_on_gloo_ranks(functools.partial(_qwen_check, str(tiny_model_dir("qwen_image")), 6, True))


def test_text_padding_appends_masked_tokens_only_where_the_degree_does_not_divide():
    from trainer.parallel.sequence import pad_text_to_degree

    embeds, mask = torch.randn(2, 5, 3), torch.ones(2, 5, dtype=torch.long)
    padded = pad_text_to_degree({"encoder_hidden_states": embeds,
                                 "encoder_hidden_states_mask": mask, "timestep": 1}, 4)
    assert padded["encoder_hidden_states"].shape == (2, 8, 3)
    assert torch.equal(padded["encoder_hidden_states"][:, :5], embeds)
    assert not padded["encoder_hidden_states"][:, 5:].any()
    assert padded["encoder_hidden_states_mask"].tolist() == [[1] * 5 + [0] * 3] * 2
    assert padded["timestep"] == 1
    whole = {"encoder_hidden_states": embeds, "encoder_hidden_states_mask": mask}
    assert pad_text_to_degree(whole, 5) is whole
    assert pad_text_to_degree({"encoder_hidden_states": embeds}, 4)["encoder_hidden_states"] is embeds


def test_the_rules_name_every_problem_at_once():
    assert world_problems(1, 3) == []
    assert world_problems(2, 4) == []
    assert "divide the world size 3" in world_problems(2, 3)[0]
    assert ">= 1" in world_problems(0, 4)[0]
    problems = model_problems(4, model="Wan", sequences={"image tokens": 30, "text tokens": 9})
    assert len(problems) == 2
    assert "image tokens length 30" in problems[0] and "text tokens length 9" in problems[1]


def test_preflight_names_a_degree_the_world_does_not_divide_and_a_family_it_cannot_split():
    """The tiny recipe trains the shipped toy model, an SD3 transformer of 3 heads: no sequence
    split is tested for its family, so preflight refuses it by its class (its heads would go
    to ring attention, which runs on the CPU: no problem of their own)."""
    from trainer.config import ConfigError, load_config
    from trainer.preflight import preflight

    cfg = load_config("tiny", ["fsdp.sequence_parallel=2"])
    with pytest.raises(ConfigError) as odd:
        preflight(cfg, world_size=3)
    assert "divide the world size 3" in str(odd.value)
    assert "--fsdp-sequence-parallel" in str(odd.value)
    with pytest.raises(ConfigError) as even:
        preflight(cfg, world_size=2)
    [family] = [p for p in even.value.problems if "sequence" in p]
    assert family == ("fsdp.sequence_parallel (--fsdp-sequence-parallel)=2: SD3Transformer2DModel "
                      "cannot be split over a sequence group; supported: Wan "
                      "(WanTransformer3DModel), Qwen-Image (QwenImageTransformer2DModel)")
    assert preflight(load_config("tiny", ["fsdp.sequence_parallel=1"]), world_size=2) == []


def test_preflight_accepts_a_sequence_split_of_a_supported_family_in_a_run(tiny_model_dir):
    """The blanket refusal is gone: the loop gives a sequence group the same samples."""
    from trainer.config import load_config
    from trainer.preflight import preflight

    model = tiny_model_dir("qwen_image")  # two attention heads
    cfg = load_config("tiny", ["fsdp.sequence_parallel=2", f"model.model_path={model}",
                               "model.adapter_path=trainer.models.qwen_image.QwenImageAdapter"])
    assert preflight(cfg, world_size=2) == []


def test_preflight_divides_the_updates_of_the_batch_a_sequence_group_trains_on(tiny_model_dir):
    """One group of 4 per rank at world 4; a sequence group of 2 trains on 8: three updates
    divide neither, and the error names the joined count; two updates of 4 divide it."""
    from trainer.config import ConfigError, load_config
    from trainer.preflight import preflight

    model = tiny_model_dir("qwen_image")
    sets = ["fsdp.sequence_parallel=2", f"model.model_path={model}",
            "model.adapter_path=trainer.models.qwen_image.QwenImageAdapter",
            "rollout.rollout_batch_size=4", "rollout.global_batch_size=16"]
    with pytest.raises(ConfigError) as info:
        preflight(load_config("tiny", sets + ["train.num_updates_per_batch=3"]), world_size=4)
    assert any("the 8 samples each rank trains on (its sequence group's slices)" in p
               for p in info.value.problems)
    assert preflight(load_config("tiny", sets + ["train.num_updates_per_batch=2",
                                                 "train.micro_batch_size=4"]), world_size=4) == []


def test_the_cpu_patch_changes_the_count_only_inside_its_block():
    from trainer.patches.diffusers_cpu_context_parallel import cpu_device_count

    before = torch.accelerator.device_count()
    with cpu_device_count():
        assert torch.accelerator.device_count() == max(before, 1)
    assert torch.accelerator.device_count() == before


def test_degree_one_leaves_the_transformer_untouched(tmp_path):
    from dist_fixtures import one_rank_group

    with one_rank_group(tmp_path):
        model = _tiny_wan()
        hooks = dict(model._forward_pre_hooks)
        assert apply_sequence_parallel(model, build_mesh(1)) is model
        assert model._parallel_config is None and dict(model._forward_pre_hooks) == hooks


def test_preflight_reads_the_heads_of_the_transformer_it_will_split(tiny_model_dir):
    """Degree 4 over Qwen-Image's two heads is ring attention: accepted on the CPU; on CUDA
    diffusers' cuDNN backend needs half precision and cannot mask Qwen-Image's padded text
    per chunk, both named in one error."""
    from trainer.config import ConfigError, load_config
    from trainer.preflight import preflight

    model = tiny_model_dir("qwen_image")  # two attention heads
    sets = ["fsdp.sequence_parallel=4", f"model.model_path={model}",
            "model.adapter_path=trainer.models.qwen_image.QwenImageAdapter"]
    def sequence_problems(cfg, device: str) -> list[str]:
        try:
            preflight(cfg, world_size=4, device=device)
        except ConfigError as error:  # the tiny recipe at world 4 may break other rules
            return [p for p in error.problems if "sequence" in p]
        return []

    assert sequence_problems(load_config("tiny", sets), "cpu") == []
    ring = sequence_problems(load_config("tiny", sets + ["fsdp.param_dtype=fp32"]), "cuda")
    assert len(ring) == 2 and all("ring attention" in p for p in ring)
    assert "_native_cudnn" in ring[0] and "text mask" in ring[1]


def _slice(rank: int, text: int, final: bool = True):
    """A rank's rollout slice: 2 candidates of one prompt group, ``text`` padded text tokens."""
    from trainer.models.base import RolloutBatch

    g = torch.Generator().manual_seed(rank)
    mask = torch.ones(2, text, dtype=torch.bool)
    mask[1, text - 1] = False
    return RolloutBatch(
        prompts=[f"p{rank}"] * 2, sample_ids=[f"prompt:{rank}:sample:{s}" for s in range(2)],
        group_index=torch.zeros(2, dtype=torch.long), sde_indices=[1, 2],
        latents=torch.randn(2, 2, 3, generator=g), next_latents=torch.randn(2, 2, 3, generator=g),
        sigmas=torch.rand(2, 2, generator=g), sigmas_next=torch.rand(2, 2, generator=g),
        log_probs=torch.randn(2, 2, generator=g),
        conditions={"embeds": torch.randn(2, text, 4, generator=g), "mask": mask},
        height=16, width=16, eta=0.7, sde_type="sde",
        images=torch.zeros(2, 16, 16, 3, dtype=torch.uint8), metadata=[{"rank": rank}] * 2,
        final_latents=torch.randn(2, 3, generator=g) if final else None,
        schedule=torch.linspace(1, 0, 4), sources=[("src",)] * 2)


def _gather_check() -> None:
    from trainer.models.batch import concat_batches
    from trainer.parallel.group_batch import gather_sequence_group

    rank = dist.get_rank()
    group = build_mesh(2).sequence_group()
    slices = [_slice(0, text=3), _slice(1, text=5)]  # rank 1's prompts encode longer
    advantages = [torch.tensor([1.0, -1.0]), torch.tensor([0.5, -0.5])]
    joined, adv = gather_sequence_group(slices[rank], advantages[rank], group, torch.device("cpu"))
    want = concat_batches(slices)
    assert joined.sample_ids == want.sample_ids and joined.prompts == want.prompts
    assert joined.metadata == want.metadata
    assert joined.group_index.tolist() == [0, 0, 1, 1]  # one id per prompt group
    for name in ("latents", "next_latents", "sigmas", "sigmas_next", "log_probs",
                 "final_latents"):
        assert torch.equal(getattr(joined, name), getattr(want, name)), name
    for key, value in want.conditions.items():  # padded to the longer text, dtype kept
        assert joined.conditions[key].dtype == value.dtype
        assert torch.equal(joined.conditions[key], value), key
    assert joined.conditions["embeds"].shape == (4, 5, 4)
    assert joined.images is None and joined.sources is None  # not replayed: not moved
    assert torch.equal(adv, torch.cat(advantages))
    # a field one rank holds and the other does not: one error, on every rank
    with pytest.raises(ValueError, match="final_latents: present on one rank"):
        gather_sequence_group(_slice(rank, 3, final=rank == 0), advantages[rank], group,
                              torch.device("cpu"))


def test_a_sequence_group_joins_its_ranks_slices_in_rank_order_on_every_rank():
    run_on_gloo_ranks(_gather_check)
