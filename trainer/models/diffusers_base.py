"""What the diffusers-based adapters share: configs, loading, freezing, LoRA names, name maps.

A family adapter subclasses ``DiffusersAdapter``, names its diffusers classes and implements
the prompt encoding, the velocity forward, decoding and its schedule, calling the diffusers
pipeline's own helpers wherever one exists. Configs are read from the model directory's JSON
files without loading weights, so the actor side (latent shapes, schedules, request building)
never pays for the VAE or the text encoders. For the same reason diffusers and transformers
are imported inside the methods that read a config or build a model (here and in the family
modules): importing an adapter class, as the config checks do, imports neither.
"""
from __future__ import annotations

import re
from functools import cached_property
from typing import Any, ClassVar, Iterable

import torch
from torch import nn

from trainer.models.base import GenerativeModelAdapter
from trainer.models.geometry import Geometry

# Wrapper segments that torch.compile, activation checkpointing and FSDP insert in names.
_WRAPPER_SEGMENTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")
_PEFT_PREFIX = "base_model.model."
# peft names its LoRA tensors "<module>.lora_A.<adapter>.weight"; engines take "<module>.lora_A.weight".
_PEFT_ADAPTER_TENSOR = re.compile(
    r"\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)\.[^.]+((?:\.weight|\.bias)?)$")
# Minimum number of tokens a real tokenizer has: offline from_pretrained of a missing or broken
# tokenizer can silently return one that only knows its special tokens.
_MIN_VOCAB = 16


def engine_param_name(name: str) -> str:
    """A trainer parameter name as the engine's diffusers transformer names it."""
    for segment in _WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    if name.startswith(_PEFT_PREFIX):
        name = name[len(_PEFT_PREFIX):]
    name = name.replace(".base_layer.", ".")
    return _PEFT_ADAPTER_TENSOR.sub(r".\1\2", name)


def base_module(model: nn.Module) -> nn.Module:
    """The diffusers model inside peft / torch.compile wrappers."""
    model = getattr(model, "_orig_mod", model)
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return getattr(model, "_orig_mod", model)


def module_dtype(model: nn.Module) -> torch.dtype:
    """Dtype of the first floating parameter (what inputs are cast to before the forward)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def freeze(module: nn.Module | None) -> nn.Module | None:
    if module is not None:
        module.eval()
        module.requires_grad_(False)
    return module


def tokenizer_problems(tokenizer: Any, text_encoder: nn.Module | None, where: str) -> list[str]:
    """Why a loaded tokenizer cannot be the text encoder's ([] when it looks real)."""
    problems = []
    size = len(tokenizer)
    if size < _MIN_VOCAB:
        problems.append(f"{where}: tokenizer has only {size} tokens (missing or broken tokenizer files?)")
    if text_encoder is not None:
        rows = text_encoder.get_input_embeddings().weight.shape[0]
        if size > rows:
            problems.append(f"{where}: tokenizer has {size} tokens but the text encoder embeds only {rows}")
    return problems


def images_to_uint8(image_processor: Any, images: torch.Tensor) -> torch.Tensor:
    """VAE output [B, 3, H, W] in [-1, 1] -> [B, H, W, 3] uint8, rounded as diffusers' to-PIL."""
    images = image_processor.postprocess(images.float(), output_type="pt")
    return (images * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()


def check_attention_backend(name: Any, owner: str) -> None:
    """Raise one error if diffusers has no attention backend ``name`` or it cannot run here
    (its package missing), before any model is loaded."""
    from diffusers.models import attention_dispatch

    known = [b.value for b in attention_dispatch.AttentionBackendName]
    if name not in known:
        raise ValueError(f"{owner}: attention_backend {name!r} is not one of diffusers' "
                         f"attention backends {known}")
    # diffusers' own requirement check (private: where a release lacks it, the same check
    # runs inside set_attention_backend when the model loads)
    requirements = getattr(attention_dispatch, "_check_attention_backend_requirements", None)
    try:
        if requirements is not None:
            requirements(attention_dispatch.AttentionBackendName(name))
    except RuntimeError as err:
        raise ValueError(f"{owner}: attention_backend {name!r} cannot run here: {err}") from err


def set_attention_backend(model: nn.Module, name: str, owner: str) -> None:
    """diffusers' ``set_attention_backend``, then a check that every attention processor took
    it: diffusers skips, without a word, processors that call torch's attention directly."""
    model.set_attention_backend(name)
    ignoring = sorted({type(module.processor).__name__ for module in model.modules()
                       if hasattr(module, "processor") and hasattr(module, "set_processor")
                       and getattr(module.processor, "_attention_backend", None) != name})
    if ignoring:
        raise ValueError(f"{owner}: attention_backend {name!r} is ignored by this diffusers "
                         f"release's attention processors {ignoring}; leave it unset")


class DiffusersAdapter(GenerativeModelAdapter):
    """Shared base of the diffusers adapters.

    Options (constructor keywords, all optional):
        revision: str | None = None          passed to every from_pretrained
        max_sequence_length: int | None      text tokens kept (family default when None)
        attention_backend: str | None = None diffusers' attention backend for the transformer
                                             (``set_attention_backend``: "native",
                                             "_native_efficient", "flash", ...); None keeps
                                             diffusers' default. The actor and the embedded
                                             engine both load through ``load_train_model``, so
                                             both run the same kernels.
    Subclasses add their own in ``extra_options`` and set ``transformer_class`` (the diffusers
    class name), ``block_attrs`` (ModuleList attributes holding the repeated blocks) and
    ``lora_targets``.
    """

    transformer_class: ClassVar[str] = ""
    block_attrs: ClassVar[tuple[str, ...]] = ("transformer_blocks",)
    lora_targets: ClassVar[tuple[str, ...]] = ()
    default_max_sequence_length: ClassVar[int] = 512
    extra_options: ClassVar[dict[str, Any]] = {}

    def __init__(self, model_path: str, **options: Any) -> None:
        known = {"revision": None, "max_sequence_length": self.default_max_sequence_length,
                 "attention_backend": None, **self.extra_options}
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(f"{type(self).__name__}: unknown options {unknown} (known: {sorted(known)})")
        super().__init__(str(model_path), **{**known, **options})
        self.revision = self.options["revision"]
        self.max_sequence_length = int(self.options["max_sequence_length"])
        self.attention_backend = self.options["attention_backend"]
        if self.attention_backend is not None:
            check_attention_backend(self.attention_backend, type(self).__name__)

    # ---- configs (JSON only, no weights) ---------------------------------------------------
    def _config(self, subfolder: str) -> dict[str, Any]:
        from diffusers.configuration_utils import ConfigMixin

        class _ModelConfig(ConfigMixin):  # load_config only needs the file name
            config_name = "config.json"

        return dict(_ModelConfig.load_config(self.model_path, subfolder=subfolder, revision=self.revision))

    @cached_property
    def transformer_config(self) -> dict[str, Any]:
        return self._config("transformer")

    @cached_property
    def vae_config(self) -> dict[str, Any]:
        return self._config("vae")

    @cached_property
    def scheduler(self):
        """The model's own FlowMatchEulerDiscreteScheduler (schedules only, never stepped)."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler.from_pretrained(
            self.model_path, subfolder="scheduler", revision=self.revision)

    def _scheduler_sigmas(self, num_inference_steps: int, sigmas: Any = None,
                          mu: float | None = None) -> torch.Tensor:
        """Call set_timesteps exactly as the family's pipeline does; its N+1 sigmas, fp32 CPU."""
        kwargs = {} if mu is None else {"mu": mu}
        if sigmas is None:
            self.scheduler.set_timesteps(num_inference_steps, device="cpu", **kwargs)
        else:
            self.scheduler.set_timesteps(sigmas=sigmas, device="cpu", **kwargs)
        return self.scheduler.sigmas.to(torch.float32).clone()

    def timesteps_from_sigmas(self, sigmas: torch.Tensor) -> torch.Tensor:
        return sigmas[:-1].to(torch.float32) * float(self.scheduler.config.num_train_timesteps)

    # ---- actor side -----------------------------------------------------------------------
    def load_train_model(self, *, dtype: torch.dtype = torch.float32,
                         device: str | torch.device = "cpu") -> nn.Module:
        import diffusers

        model = getattr(diffusers, self.transformer_class).from_pretrained(
            self.model_path, subfolder="transformer", torch_dtype=dtype, revision=self.revision)
        if self.attention_backend is not None:
            set_attention_backend(model, self.attention_backend, type(self).__name__)
        return model.to(device)

    def transformer_blocks(self, model: nn.Module) -> list[nn.Module]:
        inner = base_module(model)
        return [block for attr in self.block_attrs for block in getattr(inner, attr)]

    def lora_target_modules(self) -> list[str]:
        return list(self.lora_targets)

    def weight_name_map(self, train_names: Iterable[str]) -> dict[str, str]:
        """Trainer name -> the engine's diffusers name: wrapper segments (torch.compile,
        checkpoint, FSDP), peft's ``base_model.model.`` prefix and ``.base_layer`` dropped,
        LoRA tensors as ``<module>.lora_A.weight``. Raises if two names collide."""
        mapping: dict[str, str] = {}
        owners: dict[str, str] = {}
        clashes = []
        for name in train_names:
            target = engine_param_name(name)
            if target in owners:
                clashes.append(f"{owners[target]!r} and {name!r} -> {target!r}")
            owners[target] = name
            mapping[name] = target
        if clashes:
            raise ValueError("parameter names collide after mapping to engine names: " + "; ".join(clashes))
        return mapping

    # ---- compute accounting (trainer.compute; docs/compute-accounting.md) -------------------
    def image_tokens(self, geometry: Geometry) -> int:
        """Image tokens of the transformer's sequence: the packed sequence of a 2-D latent
        ([tokens, channels]) or the patches of a [C, h, w] latent."""
        shape = self.latent_shape(geometry)
        if len(shape) == 2:
            return int(shape[0])
        patch = int(self.transformer_config["patch_size"])
        return (int(shape[-2]) // patch) * (int(shape[-1]) // patch)

    def forward_flops(self, geometry: Geometry, *, batch: int, text_tokens: int):
        from trainer.compute.flops import transformer_forward

        return transformer_forward(self.transformer_class, self.transformer_config,
                                   image_tokens=self.image_tokens(geometry),
                                   text_tokens=text_tokens, batch=batch)

    # ---- engine side helpers ----------------------------------------------------------------
    def _from_pretrained(self, cls: type, subfolder: str, dtype: torch.dtype | None,
                         device: str | torch.device) -> Any:
        kwargs: dict[str, Any] = {"subfolder": subfolder, "revision": self.revision}
        if dtype is not None:
            kwargs["torch_dtype"] = dtype
        return freeze(cls.from_pretrained(self.model_path, **kwargs).to(device))

    def _load_tokenizer(self, subfolder: str) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_path, subfolder=subfolder, revision=self.revision)

    def _check_tokenizers(self, pairs: dict[str, tuple[Any, nn.Module | None]]) -> None:
        problems = [p for where, (tok, enc) in pairs.items() for p in tokenizer_problems(tok, enc, where)]
        if problems:
            raise ValueError(f"{type(self).__name__} at {self.model_path}: " + "; ".join(problems))

    def _cast_inputs(self, transformer: nn.Module, latents: torch.Tensor,
                     conditions: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.dtype]:
        """Inputs in the transformer's dtype and contiguous. NOTE: layout changes the bits: a
        bf16 CPU forward of a strided view (``batch.latents[:, s]``) differed in the last bit
        from the same values contiguous, which broke replay == recorded; a copy of an already
        contiguous tensor is free."""
        dtype = module_dtype(transformer)
        cast = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in conditions.items()}
        return latents.to(dtype).contiguous(), cast, dtype


class PackedLatentsAdapter(DiffusersAdapter):
    """Families whose transformer takes 2x2-packed latents (Qwen-Image, FLUX): one geometry.

    Subclasses set ``display_name`` and ``pipeline_class()`` (the diffusers pipeline whose
    ``_pack_latents`` defines the packing) and ``vae_scale_factor``.
    """

    display_name = "this family"

    @staticmethod
    def pipeline_class():
        raise NotImplementedError

    @property
    def vae_scale_factor(self) -> int:
        raise NotImplementedError

    def resolution_problems(self, geometry: Geometry) -> list[str]:
        problems = super().resolution_problems(geometry)
        multiple = self.vae_scale_factor * 2
        if geometry.height % multiple or geometry.width % multiple:
            problems.append(f"height and width must be multiples of {multiple} for "
                            f"{self.display_name} (VAE x{self.vae_scale_factor}, 2x2 packing), "
                            f"got {geometry.height}x{geometry.width}")
        return problems

    def init_noise_shape(self, geometry: Geometry) -> tuple[int, int, int]:
        step = self.vae_scale_factor * 2
        return (self.transformer_config["in_channels"] // 4, 2 * (int(geometry.height) // step),
                2 * (int(geometry.width) // step))

    def latent_shape(self, geometry: Geometry) -> tuple[int, int]:
        channels, h, w = self.init_noise_shape(geometry)
        return (h // 2) * (w // 2), channels * 4

    def noise_to_latents(self, noise: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        channels, h, w = self.init_noise_shape(geometry)
        return self.pipeline_class()._pack_latents(noise, noise.shape[0], channels, h, w)
