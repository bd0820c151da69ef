"""Wan 2.1 / 2.2 text-to-video: WanTransformer3DModel, AutoencoderKLWan, UMT5 text encoder.

Delegates to diffusers' WanPipeline (built from the loaded parts without a transformer): the
prompt encoding (``encode_prompt``: prompt cleaning, UMT5, the padded tail zeroed), the latent
geometry (``vae_scale_factor_temporal`` / ``_spatial``) and the video post-processing.

Design choices:
- Latents stay in the transformer's [C, F', h, w] layout (F' = (frames - 1) / 4 + 1; the model
  patchifies inside), so x_T needs no packing and the kernels see [B, C, F', h, w]: their
  log-prob is the mean over every element, frames included.
- The schedule: the published checkpoints ship a UniPC multistep scheduler on flow sigmas;
  a Flow-GRPO step is a first-order SDE step, so the sigmas are those of diffusers'
  FlowMatchEulerDiscreteScheduler with the checkpoint's own ``flow_shift`` (its ``shift`` when
  the checkpoint ships a flow-match scheduler): 1.0 ... 0.0, static shift. The timestep is
  sigma * num_train_timesteps, as the pipeline passes it.
- The text window is the pipeline's default, 512 UMT5 tokens (``max_sequence_length``).
- The CFG negative is the empty prompt, as every family here (the Wan pipeline's long default
  negative prompt is a sampling preference, not part of the model).
- Wan 2.2 A14B (a ``transformer_2`` and a ``boundary_ratio`` in model_index.json): two experts,
  ``transformer`` for timesteps >= boundary_ratio * num_train_timesteps (high noise), and
  ``transformer_2`` below it. The trained model is the high-noise expert; the low-noise expert
  is a frozen part of the engine (``load_frozen``), which ``velocity`` calls for the steps
  below the boundary. A request that trains a step below the boundary is refused
  (``build_rollout_request``): the actor holds only the trained expert, and training the
  low-noise expert (or both) needs an export of ``transformer_2`` that does not exist yet.
- Wan 2.2 TI2V-5B (``expand_timesteps``: a per-token timestep and its own VAE) is refused at
  construction until it has its own tests.
"""
from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from trainer.models.diffusers_base import DiffusersAdapter, base_module, freeze
from trainer.models.geometry import Geometry

# diffusers and transformers are imported inside the methods that need them, so importing
# the adapter class (as the config checks do) imports neither: trainer/models/diffusers_base.py.

#: The low-noise expert's subfolder in a Wan 2.2 A14B pipeline directory.
LOW_NOISE_EXPERT = "transformer_2"


class WanAdapter(DiffusersAdapter):
    """Adapter of the Wan text-to-video family (dotpath ``trainer.models.wan.WanAdapter``):
    Wan 2.1 T2V (1.3B, 14B) and Wan 2.2 T2V-A14B (two experts, the module docstring says how).

    Options: ``revision`` (None), ``max_sequence_length`` (512, UMT5 tokens).
    """

    family = "wan"
    transformer_class = "WanTransformer3DModel"
    supported_tasks = ("t2v",)
    condition_keys = ("prompt_embeds",)
    block_attrs = ("blocks",)
    # Self- and cross-attention projections and the MLP of every block (diffusers' Wan LoRA
    # names: to_q/to_k/to_v/to_out.0 match attn1 and attn2 alike).
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")
    default_max_sequence_length = 512
    # SGLang's native serving of this family (its WanPipeline), read by trainer/engine/sglang/:
    # its DiT, whose name mapping renames most of ours (``attn1.to_q`` -> ``to_q``, ...) and
    # packs nothing, and where its denoising env keeps the text condition (the UMT5 embeddings,
    # padded to 512 tokens with zeros as the diffusers pipeline pads them; the masks it also
    # records are not an input of our transformer)
    sglang_dit = "sglang.multimodal_gen.runtime.models.dits.wanvideo.WanTransformer3DModel"
    sglang_conditions = {"prompt_embeds": ("pos_cond_kwargs", "encoder_hidden_states")}

    def __init__(self, model_path: str, **options: Any) -> None:
        super().__init__(model_path, **options)
        self._low_noise_expert: nn.Module | None = None
        if self.pipeline_config.get("expand_timesteps"):
            raise ValueError(f"{model_path}: Wan 2.2 TI2V (expand_timesteps: per-token timesteps) "
                             "is not supported by WanAdapter; Wan 2.1 and Wan 2.2 T2V-A14B are")

    # ---- configs --------------------------------------------------------------------------
    @cached_property
    def pipeline_config(self) -> dict[str, Any]:
        """model_index.json ({} for a directory without one)."""
        path = Path(self.model_path) / "model_index.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    @property
    def boundary_ratio(self) -> float | None:
        """Wan 2.2's expert boundary as a fraction of num_train_timesteps (None: one model)."""
        ratio = self.pipeline_config.get("boundary_ratio")
        experts = self.pipeline_config.get(LOW_NOISE_EXPERT, [None, None])
        return float(ratio) if ratio is not None and experts[0] is not None else None

    @cached_property
    def scheduler(self):
        """FlowMatchEulerDiscreteScheduler with the checkpoint's shift (module docstring)."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        cfg = FlowMatchEulerDiscreteScheduler.load_config(self.model_path, subfolder="scheduler",
                                                          revision=self.revision)
        shift = cfg.get("flow_shift", cfg.get("shift", 1.0))
        return FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=int(cfg.get("num_train_timesteps", 1000)), shift=float(shift))

    @property
    def vae_scale_factors(self) -> tuple[int, int]:
        """(temporal, spatial) compression of the VAE, as WanPipeline reads them."""
        cfg = self.vae_config
        return int(cfg.get("scale_factor_temporal") or 4), int(cfg.get("scale_factor_spatial") or 8)

    # ---- geometry -------------------------------------------------------------------------
    def resolution_problems(self, geometry: Geometry) -> list[str]:
        temporal, spatial = self.vae_scale_factors
        _, ph, pw = self.transformer_config["patch_size"]
        problems = []
        if (geometry.frames - 1) % temporal:
            problems.append(f"frames - 1 must be a multiple of {temporal} for Wan (VAE x{temporal} "
                            f"in time, the first frame alone), got {geometry.frames} frames")
        if geometry.height % (spatial * ph) or geometry.width % (spatial * pw):
            problems.append(f"height and width must be multiples of {spatial * ph} for Wan (VAE "
                            f"x{spatial}, patch {ph}x{pw}), got {geometry.height}x{geometry.width}")
        return problems

    def latent_shape(self, geometry: Geometry) -> tuple[int, int, int, int]:
        temporal, spatial = self.vae_scale_factors
        return (int(self.transformer_config["in_channels"]), (geometry.frames - 1) // temporal + 1,
                geometry.height // spatial, geometry.width // spatial)

    def latent_grid(self, geometry: Geometry) -> tuple[int, int]:
        shape = self.latent_shape(geometry)
        return int(shape[-2]), int(shape[-1])

    def image_tokens(self, geometry: Geometry) -> int:
        """Video tokens: latent frames x patches of each latent frame."""
        _, frames, h, w = self.latent_shape(geometry)
        pt, ph, pw = self.transformer_config["patch_size"]
        return (frames // pt) * (h // ph) * (w // pw)

    def scheduler_sigmas(self, num_inference_steps: int, geometry: Geometry) -> torch.Tensor:
        return self._scheduler_sigmas(num_inference_steps)

    # ---- the two experts of Wan 2.2 -------------------------------------------------------
    def high_noise_rows(self, sigma: torch.Tensor) -> torch.Tensor:
        """[B] bool: the rows the first (trained) transformer predicts; all of them for Wan 2.1."""
        if self.boundary_ratio is None:
            return torch.ones_like(sigma, dtype=torch.bool)
        # the pipeline compares the timestep t >= boundary_ratio * num_train_timesteps
        train_steps = float(self.scheduler.config.num_train_timesteps)
        return sigma.to(torch.float32) * train_steps >= self.boundary_ratio * train_steps

    def build_rollout_request(self, prompts: Sequence[str], sample_ids: Sequence[str],
                              sampling: Mapping[str, Any], **kwargs: Any) -> dict[str, Any]:
        """The shared request, refused when a trained step is below Wan 2.2's expert boundary."""
        request = super().build_rollout_request(prompts, sample_ids, sampling, **kwargs)
        if self.boundary_ratio is not None:
            extra = request["extra_sampling_params"]
            sigmas = torch.as_tensor(extra.get("sigmas") or self.scheduler_sigmas(
                request["num_inference_steps"], Geometry.from_request(request)).tolist())
            trained = extra.get("train_step_indices", request["rollout_sde_step_indices"])
            low = [i for i in trained if not bool(self.high_noise_rows(sigmas[i:i + 1])[0])]
            if low:
                raise ValueError(
                    f"Wan 2.2 trains its high-noise expert only: trained steps {low} have sigma "
                    f"below the boundary {self.boundary_ratio} (sigmas "
                    f"{[round(float(sigmas[i]), 4) for i in low]}); pick SDE steps with sigma >= "
                    f"{self.boundary_ratio}")
        return request

    # ---- engine side ----------------------------------------------------------------------
    def load_frozen(self, *, device: str | torch.device, dtype: torch.dtype) -> dict[str, Any]:
        import diffusers
        from diffusers import AutoencoderKLWan, WanPipeline
        from transformers import UMT5EncoderModel

        vae = self._from_pretrained(AutoencoderKLWan, "vae", None, device)  # fp32, as the pipeline
        text_encoder = self._from_pretrained(UMT5EncoderModel, "text_encoder", dtype, device)
        tokenizer = self._load_tokenizer("tokenizer")
        self._check_tokenizers({"tokenizer": (tokenizer, text_encoder)})
        pipeline = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
                               scheduler=self.scheduler, transformer=None)
        frozen = {"pipeline": pipeline, "vae": vae, "text_encoder": text_encoder,
                  "tokenizer": tokenizer, "device": torch.device(device), "dtype": dtype}
        if self.boundary_ratio is not None:
            expert = getattr(diffusers, self.transformer_class).from_pretrained(
                self.model_path, subfolder=LOW_NOISE_EXPERT, torch_dtype=dtype, revision=self.revision)
            frozen[LOW_NOISE_EXPERT] = self._low_noise_expert = freeze(expert.to(device))
        return frozen

    @torch.no_grad()
    def encode_prompts(self, frozen: dict[str, Any], prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, _ = frozen["pipeline"].encode_prompt(
            prompt=list(prompts), do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length, device=frozen["device"])
        return {"prompt_embeds": embeds}

    def velocity(self, transformer: nn.Module, latents: torch.Tensor, sigma: torch.Tensor,
                 conditions: dict[str, torch.Tensor], geometry: Geometry) -> torch.Tensor:
        latents, cond = self._cast(transformer, latents, conditions)
        batch = latents.shape[0]
        sigma = torch.as_tensor(sigma, device=latents.device).reshape(-1).expand(batch)
        high = self.high_noise_rows(sigma)
        if bool(high.all()):
            return self._forward(transformer, latents, sigma, cond)
        low_model = self._low_noise_expert
        if low_model is None:
            raise ValueError("Wan 2.2: a step below the expert boundary reached a side without "
                             "the low-noise expert (the actor trains the high-noise expert only)")
        if not bool(high.any()):
            return self._forward(low_model, latents, sigma, cond)
        # rows on both sides of the boundary (per-sample sigmas): each expert on its rows
        out = torch.empty_like(latents)
        for rows, model in ((high, transformer), (~high, low_model)):
            idx = rows.nonzero().flatten()
            out[idx] = self._forward(model, latents[idx], sigma[idx],
                                     {k: v[idx] for k, v in cond.items()})
        return out

    @staticmethod
    def _cast(transformer: nn.Module, latents: torch.Tensor,
              conditions: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Inputs in the compute dtype, contiguous (``DiffusersAdapter._cast_inputs`` says why).
        The compute dtype is the patch embedding's: Wan keeps its first parameter, the
        modulation table, in fp32 whatever the load dtype (``_keep_in_fp32_modules``)."""
        dtype = base_module(transformer).patch_embedding.weight.dtype
        cast = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in conditions.items()}
        return latents.to(dtype).contiguous(), cast

    def _forward(self, transformer: nn.Module, latents: torch.Tensor, sigma: torch.Tensor,
                 cond: dict[str, torch.Tensor]) -> torch.Tensor:
        timestep = sigma.to(torch.float32) * float(self.scheduler.config.num_train_timesteps)
        return transformer(hidden_states=latents, timestep=timestep,
                           encoder_hidden_states=cond["prompt_embeds"], return_dict=False)[0]

    @torch.no_grad()
    def decode(self, frozen: dict[str, Any], latents: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        """Final latents -> video [B, F, H, W, 3] uint8 (the pipeline's de-normalisation and
        post-processing, rounded as diffusers' to-PIL)."""
        pipeline, vae = frozen["pipeline"], frozen["vae"]
        z = latents.to(vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(z.device, z.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(z.device, z.dtype)
        video = vae.decode(z / inv_std + mean, return_dict=False)[0]      # [B, 3, F, H, W]
        video = pipeline.video_processor.postprocess_video(video.float(), output_type="pt")
        frames = (video * 255).round().clamp(0, 255).to(torch.uint8)      # [B, F, 3, H, W]
        return frames.permute(0, 1, 3, 4, 2).contiguous()
