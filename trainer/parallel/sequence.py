"""Sequence parallelism for the actor's transformer, composed with FSDP2.

The ranks form a (data x sequence) mesh. The ranks of one sequence group hold the same samples;
each runs the transformer on a slice of the image/video tokens, and every attention sees the
whole sequence: where the degree divides the heads, an all-to-all around it swaps the token
split for a head split (Ulysses); where it does not, each rank's keys and values go round the
group and the partial results are merged by their log-sum-exp (ring, through an attention
backend that returns one: ``rules.RING_BACKENDS``). The split, the collectives and the gather
of the output are diffusers' context parallelism (``enable_parallelism`` with the family's
``_cp_plan``); of ring, only the CPU backend's op pair is ours (``cpu_flash_attention``). The
output is gathered whole on every rank of the group, so the log-prob and loss are computed as
without the split.

Gradients: the gather's backward hands each rank only its own slice, so a parameter's gradient
on one rank is its share of the whole; the full gradient is the sum over the sequence group.
FSDP2 therefore shards over every rank (data x sequence flattened, as torchtitan shards over its
dp x cp mesh) and divides the reduced gradient by the data degree alone: a sum over the sequence
group and the usual mean over the data groups.

On a host without an accelerator diffusers' setup needs ``patches.diffusers_cpu_context_parallel``
(it divides by the accelerator count); gloo carries the all-to-alls and the ring's all-gathers
on CPU.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from diffusers import ContextParallelConfig
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_WRAPPED_MODULE as _WRAPPED)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from trainer.patches import diffusers_qwen_fast_paths as qwen_fast_paths
from trainer.patches.diffusers_cpu_context_parallel import cpu_device_count
from trainer.parallel import cpu_flash_attention
from trainer.parallel.rules import (FAMILIES, RING_BACKENDS, family_problems, model_problems,
                                    ring_problems, uses_ring, world_problems)

# diffusers reads the context-parallel mesh by the last two names; the sequence degree sits on
# "ulysses" (ring 1), and a ring split gets a mesh of its own with it on "ring" (context_mesh)
_DIMS = ("data", "ring", "ulysses")


@dataclass(frozen=True)
class ParallelMesh:
    """The (data x sequence) mesh of a run. ``mesh`` carries diffusers' dimension names."""
    mesh: DeviceMesh
    data_degree: int
    sequence_degree: int

    def fsdp_mesh(self) -> DeviceMesh:
        """Every rank in one dimension: FSDP2 shards parameters over data and sequence alike."""
        return self.mesh[_DIMS]._flatten("data_sequence")

    def sequence_group(self) -> dist.ProcessGroup:
        """This rank's sequence group: the ranks that replay the same samples."""
        return self.mesh["ulysses"].get_group()

    def context_mesh(self, ring: bool) -> DeviceMesh:
        """The mesh diffusers' context parallelism reads: ``mesh`` for Ulysses; for ring a new
        mesh (a collective call) with the sequence degree on "ring", whose ring groups are the
        same neighbouring ranks as the sequence groups."""
        if not ring:
            return self.mesh
        return init_device_mesh(self.mesh.device_type, (self.data_degree, self.sequence_degree, 1),
                                mesh_dim_names=_DIMS)


def build_mesh(sequence_degree: int, device_type: str | None = None) -> ParallelMesh:
    """The mesh of the current process group with sequence groups of ``sequence_degree``
    (neighbouring ranks, which share a node when the degree divides the ranks per node), on
    ``device_type`` (None: cuda where there is one, else cpu)."""
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    world = dist.get_world_size()
    problems = world_problems(sequence_degree, world)
    if problems:
        raise ValueError("sequence parallelism cannot be set up: " + "; ".join(problems))
    data = world // sequence_degree
    mesh = init_device_mesh(device_type, (data, 1, sequence_degree), mesh_dim_names=_DIMS)
    return ParallelMesh(mesh, data, sequence_degree)


def family_class(transformer: nn.Module) -> str:
    """The diffusers class of ``transformer`` (FSDP2 renames the class it wraps), or its own
    name when it is none of the supported ones."""
    for cls in type(transformer).__mro__:
        if cls.__name__ in FAMILIES:
            return cls.__name__
    return type(transformer).__name__


def attention_heads(transformer: nn.Module) -> int:
    return int(transformer.config.num_attention_heads)


def split_lengths(transformer: nn.Module, args: tuple, kwargs: dict) -> dict[str, int]:
    """The token counts the family's context-parallel plan splits, for one forward's inputs
    (diffusers' transformers take ``hidden_states`` first, ``encoder_hidden_states`` second)."""
    name = family_class(transformer)
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    if name == "WanTransformer3DModel":
        p_t, p_h, p_w = transformer.config.patch_size
        _, _, t, h, w = hidden.shape
        return {"image tokens": (t // p_t) * (h // p_h) * (w // p_w)}
    if name == "QwenImageTransformer2DModel":
        return {"image tokens": hidden.shape[1],
                "text tokens": (kwargs["encoder_hidden_states"] if "encoder_hidden_states" in kwargs
                                else args[1]).shape[1]}
    raise ValueError(f"sequence parallelism does not know which sequences {name} splits; "
                     f"supported: Wan (WanTransformer3DModel) and Qwen-Image")


_TEXT = ("encoder_hidden_states", "encoder_hidden_states_mask")


def pad_text_to_degree(kwargs: dict, degree: int) -> dict:
    """Qwen-Image's keyword inputs with masked text tokens (embedding 0, mask 0) appended until
    the degree divides the text length, which the plan splits and prompts vary: the same
    padding as the adapter's own alignment (``QwenImageAdapter.pad_text``): a masked key adds
    nothing to attention and the real tokens' rotary positions do not move. Unchanged where
    the text is not passed by keyword with its mask, or already divides."""
    if not all(isinstance(kwargs.get(k), torch.Tensor) for k in _TEXT):
        return kwargs
    embeds, mask = (kwargs[k] for k in _TEXT)
    pad = -embeds.shape[1] % degree
    if pad == 0:
        return kwargs
    return {**kwargs,
            _TEXT[0]: torch.cat([embeds, embeds.new_zeros(embeds.shape[0], pad, *embeds.shape[2:])], 1),
            _TEXT[1]: torch.cat([mask, mask.new_zeros(mask.shape[0], pad)], 1)}


def _prepare_forward(degree: int):
    """The pre-hook of a split transformer: Qwen-Image's text padded to the degree, then every
    split length checked (one error naming each that the degree does not divide)."""
    def prepare(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if family_class(module) == "QwenImageTransformer2DModel":
            kwargs = pad_text_to_degree(kwargs, degree)
        problems = model_problems(degree, model=family_class(module),
                                  sequences=split_lengths(module, args, kwargs))
        if problems:
            raise ValueError("this forward cannot be split over the sequence group: "
                             + "; ".join(problems))
        return args, kwargs
    return prepare


def _plan_modules(module: nn.Module, name: str) -> list[nn.Module]:
    """The modules a context-parallel plan key names ('' the root, ``*`` every item of a
    ModuleList), as diffusers resolves them."""
    if not name:
        return [module]
    first, _, rest = name.partition(".")
    children = list(module) if first == "*" else [getattr(module, first)]
    return [m for child in children for m in _plan_modules(child, rest)]


def through_checkpoint_wrappers(transformer: nn.Module, plan: dict) -> dict:
    """``plan`` with each key that names activation-checkpoint wrappers pointed at the modules
    they wrap. diffusers finds the inputs it splits by the module's forward signature, which a
    wrapper hides behind ``*args, **kwargs``; on the wrapped module the split runs inside the
    checkpointed region, and its recompute in the backward slices the same saved input."""
    out = {}
    for key, entry in plan.items():
        modules = _plan_modules(transformer, key)
        wrapped = bool(modules) and all(hasattr(m, _WRAPPED) for m in modules)
        out[f"{key}.{_WRAPPED}" if key and wrapped else key] = entry
    return out


def use_attention_backend(transformer: nn.Module, backend: str) -> None:
    """Every attention processor of ``transformer`` on diffusers' backend ``backend``. Not
    diffusers' ``set_attention_backend``, which also makes it the process-wide default, and
    so the backend of every other model of the process (the one-rank model a test compares
    with, an in-process engine)."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    name = AttentionBackendName(backend)
    for module in transformer.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_attention_backend"):
            processor._attention_backend = name


def _context_parallel_config(transformer: nn.Module, pm: ParallelMesh) -> ContextParallelConfig:
    """Ulysses where the degree divides the heads; otherwise ring, with the transformer's
    attention on the device's ring backend (registering ours on the CPU)."""
    degree = pm.sequence_degree
    if not uses_ring(degree, attention_heads(transformer)):
        return ContextParallelConfig(ulysses_degree=degree, mesh=pm.context_mesh(False))
    if pm.mesh.device_type == "cpu":
        cpu_flash_attention.register()
    use_attention_backend(transformer, RING_BACKENDS[pm.mesh.device_type])
    return ContextParallelConfig(ring_degree=degree, mesh=pm.context_mesh(True))


def apply_sequence_parallel(transformer: nn.Module, pm: ParallelMesh) -> nn.Module:
    """Split ``transformer``'s sequence over ``pm``'s sequence groups: diffusers' Ulysses
    where the degree divides the heads, its ring attention otherwise (``rules.uses_ring``).
    Refuses, naming every problem, a family outside ``rules.FAMILIES`` and a ring the device
    cannot run (``rules.ring_problems``); each forward pads Qwen-Image's text to the degree
    (``pad_text_to_degree``) and checks its sequence lengths the same way before anything is
    split. Degree 1 changes nothing."""
    degree = pm.sequence_degree
    if degree == 1:  # off: the transformer stays exactly as it was
        return transformer
    name = family_class(transformer)
    problems = family_problems(degree, name)
    if uses_ring(degree, attention_heads(transformer)):
        problems += ring_problems(degree, model=name, transformer_class=name,
                                  device_type=pm.mesh.device_type)
    if getattr(transformer, "_cp_plan", None) is None:
        problems.append(f"{type(transformer).__name__} has no context-parallel plan in diffusers")
    if problems:
        raise ValueError("sequence parallelism cannot be applied: " + "; ".join(problems))
    plan = through_checkpoint_wrappers(transformer, transformer._cp_plan)
    if family_class(transformer) == "QwenImageTransformer2DModel":
        plan = qwen_fast_paths.context_parallel_plan(plan)
    config = _context_parallel_config(transformer, pm)
    with cpu_device_count():
        transformer.enable_parallelism(config=config, cp_plan=plan)
    transformer.register_forward_pre_hook(_prepare_forward(degree), with_kwargs=True,
                                          prepend=True)
    return transformer


def shard_over_data_and_sequence(model: nn.Module, blocks: Iterable[nn.Module], pm: ParallelMesh,
                                 **fsdp_kwargs) -> nn.Module:
    """FSDP2 over every rank of ``pm``: a unit per block, then the root, each reducing the
    gradient as a sum over the sequence group and a mean over the data groups."""
    mesh = pm.fsdp_mesh()
    # gloo has no PREMUL_SUM, which FSDP2 uses for a custom divide factor: there it sums and
    # divides in separate kernels instead (same values)
    sum_then_divide = dist.get_backend(mesh.get_group()) == "gloo"
    for block in blocks:
        fully_shard(block, mesh=mesh, **fsdp_kwargs)
    fully_shard(model, mesh=mesh, **fsdp_kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(float(pm.data_degree))
            module.set_force_sum_reduction_for_comms(sum_then_divide)
    return model
