"""The per-GPU memory plan of a run, from the config alone (no weights): what ``--dry-run``
prints, per family and geometry, and whether it fits one 141 GB H200, with and without
sequence parallelism.

Terms (bytes per GPU; P the transformer's parameters, counted exactly by building the
diffusers class from its config on the meta device; FSDP shards states over ``world``):
- actor weights: full fine-tuning keeps them as loaded, fp32 (4 P / world); LoRA keeps the
  frozen base in the compute dtype (2 P / world, or 2 P unsharded at world 1) and the
  adapter's fp32 master copy.
- gradients: fp32 (the reduce dtype) of the trainable parameters, sharded.
- optimizer: AdamW's fp32 m and v, 8 bytes per trainable parameter, sharded.
- activations of one trained forward: ``rows`` = micro-batch x trained steps (x2 under CFG),
  each row image + text tokens; per block and token, the tensors autograd saves, as
  elements of ``inner`` (the model below). Activation checkpointing keeps only each block's
  input (1 x inner per token and block) plus one block's full set while it is recomputed.
  Sequence parallelism over N ranks splits the tokens: activations / N.
- engine (colocated, one per GPU): the transformer in bf16 (2 P) and its frozen text
  encoder(s) and VAE in bf16 (published parameter counts, ``FROZEN_PARAMS``).
Not counted: the CUDA context and allocator slack (``RESERVE_GB``), the reward model, the
engine's own no-grad activations, temporary all-gather buffers of two blocks.

Activation model, elements of ``inner`` saved per token per block (tests/test_compute_memory.py
re-measures them on tiny diffusers models with saved_tensors_hooks, flash-style attention that
saves no L x L matrix, as on the GPU):
- dual-stream block (Qwen-Image, SD3 joint, FLUX double), per token of either stream: the
  norm input and modulated input (2), attention q, k, v, output (4) and the output
  projection's input and gate (2), the MLP's norm, modulated input, GELU input (4) and its
  output projection's input (4) and gate (1), plus norms' and dropouts' small tensors: 22;
  q/k RMS norms (``qk_norm`` or always for Qwen-Image and FLUX) add their inputs and
  normalised values: 4.
- FLUX single-stream block, per joint token: 22 (with its q/k norms).
- SD3 dual-attention layer, per image token: a second attention's inputs: 10.
- Wan block (video tokens only; text enters through cross-attention), per video token: the
  self-attention's norm, modulated input, q, k, v (with their RMS norms), output and gate, the
  cross-attention's norm, q and output, the MLP's modulated input: 22, plus the MLP's hidden
  (GELU input and the output projection's input: 2 x ffn_dim / inner); per text token, the
  cross-attention's k and v and k's norm: 4. Wan keeps its norms and modulation in fp32
  (``_keep_in_fp32_modules``, explicit ``.float()``): under a 2-byte compute dtype that adds
  fp32 copies worth 12 (video) and 2 (text) elements of the compute dtype.
- Wan's video tokens: latent frames ((frames - 1) / 4 + 1) x the patches of one latent frame.
  A Wan 2.2 A14B engine also holds its frozen low-noise expert (a second transformer).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

GB = 1e9
H200_GB = 141.0
#: CUDA context, allocator fragmentation and the reward model's share, held back from 141 GB.
RESERVE_GB = 8.0

#: Published transformer configs (diffusers' transformer/config.json of each model card), used
#: when the recipe's model directory is not on this machine.
PUBLISHED: dict[str, dict[str, Any]] = {
    # Qwen/Qwen-Image transformer/config.json = diffusers' QwenImageTransformer2DModel defaults
    "QwenImageTransformer2DModel": dict(
        _source="Qwen/Qwen-Image", patch_size=2, in_channels=64, out_channels=16, num_layers=60,
        attention_head_dim=128, num_attention_heads=24, joint_attention_dim=3584,
        guidance_embeds=False, axes_dims_rope=[16, 56, 56]),
    # stabilityai/stable-diffusion-3.5-medium transformer/config.json (the SD3 recipes' model)
    "SD3Transformer2DModel": dict(
        _source="stabilityai/stable-diffusion-3.5-medium", sample_size=128, patch_size=2,
        in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64,
        num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
        pooled_projection_dim=2048, pos_embed_max_size=384,
        dual_attention_layers=list(range(13)), qk_norm="rms_norm"),
    # black-forest-labs/FLUX.1-dev transformer/config.json
    "FluxTransformer2DModel": dict(
        _source="black-forest-labs/FLUX.1-dev", patch_size=1, in_channels=64, out_channels=None,
        num_layers=19, num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
        joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
        axes_dims_rope=[16, 56, 56]),
}
#: Published configs of the families whose sizes share one transformer class (Wan), by the
#: model directory's name (diffusers' transformer/config.json of each model card); ``_experts``
#: 2 is Wan 2.2 A14B's pair, ``_pixels_per_token_side`` its VAE x patch where not 16.
_WAN_14B = dict(patch_size=[1, 2, 2], num_attention_heads=40, attention_head_dim=128, in_channels=16,
                out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40,
                cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6)
PUBLISHED_BY_MODEL: dict[str, dict[str, Any]] = {
    "Wan2.1-T2V-1.3B-Diffusers": dict(_WAN_14B, _source="Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
                                      num_attention_heads=12, ffn_dim=8960, num_layers=30),
    "Wan2.1-T2V-14B-Diffusers": dict(_WAN_14B, _source="Wan-AI/Wan2.1-T2V-14B-Diffusers"),
    "Wan2.2-T2V-A14B-Diffusers": dict(_WAN_14B, _source="Wan-AI/Wan2.2-T2V-A14B-Diffusers", _experts=2),
    # image-to-video: [latents; mask; first-frame latents] in, Wan 2.1's CLIP image branch
    "Wan2.1-I2V-14B-480P-Diffusers": dict(_WAN_14B, _source="Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
                                          in_channels=36, image_dim=1280, added_kv_proj_dim=5120),
    "Wan2.2-I2V-A14B-Diffusers": dict(_WAN_14B, _source="Wan-AI/Wan2.2-I2V-A14B-Diffusers", in_channels=36,
                                      _experts=2),
    "Wan2.2-TI2V-5B-Diffusers": dict(_WAN_14B, _source="Wan-AI/Wan2.2-TI2V-5B-Diffusers",
                                     num_attention_heads=24, ffn_dim=14336, num_layers=30,
                                     in_channels=48, out_channels=48, _pixels_per_token_side=32),
}
#: Wan's VAE: 4 video frames per latent frame after the first.
WAN_FRAMES_PER_LATENT = 4
WAN_BLOCK, WAN_TEXT, WAN_FP32_VIDEO, WAN_FP32_TEXT = 22, 4, 12, 2

#: The engine's frozen parts by adapter family: (what, parameters), from the model cards
#: (Qwen2.5-VL-7B-Instruct 8.29 B; T5-XXL encoder 4.76 B; CLIP-L text 123 M; OpenCLIP bigG
#: text 695 M; the VAEs' safetensors sizes / 2 bytes).
FROZEN_PARAMS: dict[str, tuple[tuple[str, float], ...]] = {
    "qwen_image": (("Qwen2.5-VL-7B text encoder", 8.29e9), ("VAE", 0.127e9)),
    "sd3": (("CLIP-L + CLIP-G + T5-XXL encoders", 0.123e9 + 0.695e9 + 4.76e9),
                              ("VAE", 0.084e9)),
    "flux": (("CLIP-L + T5-XXL encoders", 0.123e9 + 4.76e9), ("VAE", 0.084e9)),
    "flux_kontext": (("CLIP-L + T5-XXL encoders", 0.123e9 + 4.76e9), ("VAE", 0.084e9)),  # FLUX.1's
    # UMT5-XXL encoder 5.68 B; the Wan 2.1 VAE (Qwen-Image's is the same architecture)
    "wan": (("UMT5-XXL text encoder", 5.68e9), ("VAE", 0.127e9)),
    # + Wan 2.1 I2V's CLIP ViT-H/14 vision tower 631 M (Wan 2.2 I2V has none: counted all the same)
    "wan_i2v": (("UMT5-XXL text encoder", 5.68e9), ("CLIP ViT-H/14 image encoder", 0.631e9), ("VAE", 0.127e9)),
}
#: Text tokens the transformer sees at most besides the adapter's ``max_sequence_length``
#: (SD3 prepends the 77 CLIP tokens to the T5 window).
EXTRA_TEXT_TOKENS = {"SD3Transformer2DModel": 77}
#: Latent pixels per token side for the published configs: VAE x8, then 2x2 patches or packing.
PIXELS_PER_TOKEN_SIDE = 16

DUAL_STREAM, QK_NORM, SINGLE_STREAM, DUAL_ATTENTION = 22, 4, 22, 10


def model_params(transformer_class: str, cfg: Mapping[str, Any],
                 lora_targets: tuple[str, ...] = (), lora_rank: int = 0) -> tuple[int, int]:
    """(transformer parameters, LoRA adapter parameters): the diffusers class built from
    ``cfg`` on the meta device (no memory, no weights), its Linear layers matched by name."""
    import diffusers
    import torch

    cls = getattr(diffusers, transformer_class)
    kwargs = {k: v for k, v in cfg.items() if not k.startswith("_")}
    with torch.device("meta"):
        model = cls.from_config(kwargs)
    total = sum(p.numel() for p in model.parameters())
    lora = 0
    if lora_rank:
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and any(
                    name == t or name.endswith("." + t) for t in lora_targets):
                lora += lora_rank * (module.in_features + module.out_features)
    return total, lora


def wan_activation_elements(cfg: Mapping[str, Any], *, video_tokens: int, text_tokens: int,
                            checkpointing: bool, compute_bytes: int = 2) -> int:
    """Saved activation elements (compute dtype) of one Wan row's forward (module docstring)."""
    inner = int(cfg["num_attention_heads"]) * int(cfg["attention_head_dim"])
    upcast = compute_bytes < 4
    video = WAN_BLOCK + 2 * int(cfg["ffn_dim"]) / inner + (WAN_FP32_VIDEO if upcast else 0)
    text = WAN_TEXT + (WAN_FP32_TEXT if upcast else 0)
    per_block = inner * (video * video_tokens + text * text_tokens)
    layers = int(cfg["num_layers"])
    if not checkpointing:
        return int(layers * per_block)
    return int(inner * video_tokens * layers + per_block)


def activation_elements(transformer_class: str, cfg: Mapping[str, Any], *, image_tokens: int,
                        text_tokens: int, checkpointing: bool, compute_bytes: int = 2) -> int:
    """Saved activation elements of one row's forward (the model in the module docstring);
    ``compute_bytes`` matters to Wan only (its fp32 copies)."""
    if transformer_class == "WanTransformer3DModel":
        return wan_activation_elements(cfg, video_tokens=image_tokens, text_tokens=text_tokens,
                                       checkpointing=checkpointing, compute_bytes=compute_bytes)
    inner = int(cfg["num_attention_heads"]) * int(cfg["attention_head_dim"])
    tokens = image_tokens + text_tokens
    qk = QK_NORM if (cfg.get("qk_norm") or transformer_class != "SD3Transformer2DModel") else 0
    per_block = [(DUAL_STREAM + qk) * tokens] * int(cfg["num_layers"])
    per_block += [SINGLE_STREAM * tokens] * int(cfg.get("num_single_layers") or 0)
    for i in cfg.get("dual_attention_layers") or ():
        per_block[int(i)] += DUAL_ATTENTION * image_tokens
    if not checkpointing:
        return inner * sum(per_block)
    return inner * (tokens * len(per_block) + max(per_block))


@dataclass
class MemoryPlan:
    """One run's per-GPU plan; ``lines()`` is what --dry-run prints."""

    title: str
    terms: dict[str, float]                    # name -> bytes per GPU (activations excluded)
    activations: dict[bool, float]             # checkpointing -> bytes of one row
    rows: int | None                           # rows per trained forward (None: auto)
    checkpointing: bool
    notes: list[str] = field(default_factory=list)
    #: bytes one bf16 base shared by the actor and the engine saves (LoRA, colocated): the
    #: engine maps the actor's unsharded frozen base (CUDA IPC) instead of loading its own.
    shared_base_saving: float = 0.0

    def total(self, *, sp: int = 1, checkpointing: bool | None = None,
              rows: int | None = None) -> float:
        """Bytes per GPU with ``rows`` rows per trained forward (the plan's, or 1 if auto)."""
        ac = self.checkpointing if checkpointing is None else checkpointing
        return sum(self.terms.values()) + (rows or self.rows or 1) * self.activations[ac] / sp

    def max_rows(self, *, sp: int = 1, checkpointing: bool | None = None) -> int:
        """Rows per trained forward that fit one H200 beside the other terms."""
        ac = self.checkpointing if checkpointing is None else checkpointing
        free = (H200_GB - RESERVE_GB) * GB - sum(self.terms.values())
        return max(0, int(free // (self.activations[ac] / sp)))

    def lines(self) -> list[str]:
        budget = (H200_GB - RESERVE_GB) * GB
        out = [f"# memory plan per GPU (trainer.compute.memory): {self.title}"]
        out += [f"#   {name:<48} {b / GB:8.2f} GB" for name, b in self.terms.items()]
        for ac in (False, True):
            name = f"activations per trained row, checkpointing {'on' if ac else 'off'}"
            out.append(f"#   {name:<48} {self.activations[ac] / GB:8.2f} GB")
        auto = "" if self.rows else " (micro-batch auto: at least 1)"
        out.append(f"#   one {H200_GB:.0f} GB H200, {RESERVE_GB:.0f} GB held back; "
                   f"{self.rows or 1} rows per forward{auto}, checkpointing "
                   f"{'on' if self.checkpointing else 'off'}:")
        for sp in (1, 2, 4, 8):
            total = self.total(sp=sp)
            out.append(f"#     sequence parallel x{sp}: {total / GB:7.1f} GB, "
                       f"{'fits' if total <= budget else 'does NOT fit'}; rows that fit: "
                       f"{self.max_rows(sp=sp, checkpointing=False)} (checkpointing off), "
                       f"{self.max_rows(sp=sp, checkpointing=True)} (on)")
        if self.shared_base_saving > 0:
            total = self.total() - self.shared_base_saving
            out.append(f"#   with one bf16 base shared by actor and engine (CUDA IPC; the actor's "
                       f"base then unsharded): {total / GB:7.1f} GB, "
                       f"{'fits' if total <= budget else 'does NOT fit'}")
        out += [f"#   note: {n}" for n in self.notes]
        return out


def plan(*, transformer_class: str, cfg: Mapping[str, Any], image_tokens: int, text_tokens: int,
         lora_targets: tuple[str, ...], lora_rank: int, world: int, micro_batch: int | None,
         trained_steps: int, cfg_factor: int, checkpointing: bool, colocated: bool,
         source: str, family: str = "", compute_bytes: int = 2, experts: int = 1) -> MemoryPlan:
    """The plan of one run (see the module docstring for every term); ``experts`` 2: the engine
    also holds a frozen second transformer of the same size (Wan 2.2 A14B)."""
    total, adapter = model_params(transformer_class, cfg, lora_targets, lora_rank)
    lora = lora_rank > 0
    shard = max(1, world)
    terms = {}
    if lora:
        terms["actor base weights (compute dtype, sharded)"] = compute_bytes * total / shard
        name = f"LoRA r{lora_rank} adapter fp32 master ({adapter / 1e6:.1f} M)"
        terms[name] = 4 * adapter / shard
        trainable = adapter
    else:
        terms["actor weights fp32 (sharded)"] = 4 * total / shard
        trainable = total
    terms["gradients fp32 (sharded)"] = 4 * trainable / shard
    terms["AdamW m, v fp32 (sharded)"] = 8 * trainable / shard
    if colocated:
        terms["engine transformer bf16"] = 2 * total
        if experts > 1:
            terms["engine frozen low-noise expert bf16"] = 2 * total * (experts - 1)
        for what, n in FROZEN_PARAMS.get(family, ()):
            terms[f"engine {what} bf16"] = 2 * n
    per_row = {ac: compute_bytes * activation_elements(
        transformer_class, cfg, image_tokens=image_tokens, text_tokens=text_tokens,
        checkpointing=ac, compute_bytes=compute_bytes) for ac in (False, True)}
    rows = micro_batch * trained_steps * cfg_factor if micro_batch else None
    title = (f"{transformer_class} {total / 1e9:.2f} B params ({source}), {image_tokens} image + "
             f"at most {text_tokens} text tokens (the window) per row, {trained_steps} trained "
             f"steps x {cfg_factor} (CFG) rows per sample, FSDP over {shard}")
    notes = [] if micro_batch else [
        "micro_batch_size 'auto': the trainer picks the largest divisor of the update that fits"]
    if colocated and family not in FROZEN_PARAMS:
        notes.append(f"the engine's text encoder and VAE of family {family!r} are not counted")
    # shared: the engine's copy goes, the actor keeps the whole base instead of its shard
    shared = compute_bytes * total * (1 - 1 / shard) if lora and colocated else 0.0
    saving = terms.get("engine transformer bf16", 0.0) - shared if lora and colocated else 0.0
    return MemoryPlan(title, terms, per_row, rows, checkpointing, notes, saving)


def _transformer_config(model_path: str, transformer_class: str) -> tuple[dict, str]:
    path = Path(model_path) / "transformer" / "config.json"
    if path.is_file():
        return json.loads(path.read_text()), str(path)
    by_model = PUBLISHED_BY_MODEL.get(Path(model_path).name)
    if by_model is not None:
        return by_model, f"published config of {by_model['_source']}; {path} absent"
    if transformer_class not in PUBLISHED:
        raise ValueError(f"no config at {path} and no published config for {transformer_class}")
    cfg = PUBLISHED[transformer_class]
    return cfg, f"published config of {cfg['_source']}; {path} absent"


def plan_for_config(cfg: Any, world: int) -> MemoryPlan | None:
    """The plan of a resolved run config, or None for an adapter that is not a diffusers one
    (no transformer class to count)."""
    from trainer.config.sampling import SamplingConfig
    from trainer.models.wire.request import sampling_geometry
    from trainer.utils.values import import_dotpath

    adapter_cls = import_dotpath(cfg.model.adapter_path)
    transformer_class = getattr(adapter_cls, "transformer_class", "")
    if not transformer_class:
        return None
    model_path = str(cfg.model.model_path)
    if model_path == "toy":
        from trainer.toy import weights_dir
        model_path = str(weights_dir())
    tcfg, source = _transformer_config(model_path, transformer_class)
    sampling = SamplingConfig.from_dict(cfg.rollout.sampling)
    options = dict(cfg.model.adapter_options or {})
    text = int(options.get("max_sequence_length") or adapter_cls.default_max_sequence_length)
    text += EXTRA_TEXT_TOKENS.get(transformer_class, 0)
    try:
        adapter = adapter_cls(model_path, **options)
        image = adapter.image_tokens(sampling_geometry(sampling))
        experts = 2 if getattr(adapter, "boundary_ratio", None) is not None else 1
    except (OSError, ValueError):  # no model directory here: the published VAE x8 + 2x2 patches
        side = int(tcfg.get("_pixels_per_token_side", PIXELS_PER_TOKEN_SIDE))
        image = (sampling.height // side) * (sampling.width // side)
        if transformer_class == "WanTransformer3DModel":
            image *= (sampling.num_frames - 1) // WAN_FRAMES_PER_LATENT + 1
        experts = int(tcfg.get("_experts", 1))
    micro = cfg.train.micro_batch_size
    lora_rank = int(cfg.lora.rank) if cfg.fsdp.trainable_mode == "lora" else 0
    return plan(transformer_class=transformer_class, cfg=tcfg, image_tokens=image, text_tokens=text,
                lora_targets=tuple(getattr(adapter_cls, "lora_targets", ())), lora_rank=lora_rank,
                world=world, micro_batch=None if micro == "auto" else int(micro),
                trained_steps=len(sampling.trained_steps(sampling.noise_steps(0))),
                cfg_factor=2 if sampling.guidance_scale != 1.0 else 1,
                checkpointing=bool(cfg.fsdp.activation_checkpointing),
                colocated=cfg.rollout.engine == "embedded", source=source,
                family=getattr(adapter_cls, "family", ""),
                compute_bytes=2 if cfg.fsdp.param_dtype in ("bf16", "fp16") else 4, experts=experts)


def print_memory_plan(cfg: Any, world: int) -> None:
    """--dry-run's plan, as TOML comments after the resolved config; a plan that cannot be
    made says why in one line (the config itself was valid: the dry run still succeeds)."""
    try:
        made = plan_for_config(cfg, world)
    except (ImportError, ValueError, OSError, KeyError, TypeError) as exc:
        print(f"# memory plan not available: {type(exc).__name__}: {exc}")
        return
    if made is None:
        print("# memory plan not available: the adapter names no diffusers transformer class")
        return
    print("\n".join(made.lines()))
    print(f"#   (per rank at world size {world}: pass --nproc N / --nnodes M for another)")
