"""A transformers CLIP model loaded for scoring: the shared body of PickScore, CLIPScore and
the aesthetic predictor (all three are a CLIP tower plus a few lines of maths on top).

Loaded from a local directory in the published transformers format (``config.json`` +
weights, and the processor files: ``preprocessor_config.json`` + tokenizer). The processor may
live in another directory (PickScore's model repo is usually paired with the processor of the
CLIP-H it was fine-tuned from), hence ``processor_path``.

Embeddings go through ``vision_model`` + ``visual_projection`` (and the text twins) rather than
``get_image_features``, whose return type changed between transformers 4 (a tensor) and 5 (a
model output); the maths is the same.
"""
from __future__ import annotations

import os

import torch

from trainer.rewards.preprocess import transform_from_hf_processor


def resolve_device_dtype(device: str | torch.device | None,
                         dtype: str | torch.dtype | None) -> tuple[torch.device, torch.dtype]:
    """Default device: CPU. Default dtype: bf16 on CUDA (scoring tolerates it, and it halves
    the colocated footprint), fp32 elsewhere (CPU bf16 matmuls are slower than fp32)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    elif isinstance(dtype, str):
        resolved = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
            raise ValueError(f"dtype {dtype!r} is not a torch floating-point dtype")
        dtype = resolved
    return device, dtype


class HFClip:
    """CLIP image/text embeddings on one device, L2-normalised, fp32.

    Args:
        model_path: transformers CLIPModel directory.
        processor_path: directory with the tokenizer and preprocessor_config.json
            (default: ``model_path``).
        device, dtype: see ``resolve_device_dtype``.
        batch_size: images (and distinct prompts) per forward; bounds activation memory.
    """

    def __init__(self, model_path: str, *, processor_path: str | None = None,
                 device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
                 batch_size: int = 64) -> None:
        from transformers import AutoTokenizer, CLIPModel  # local: a multi-second import

        processor_path = processor_path or model_path
        problems = []
        if not os.path.isfile(os.path.join(model_path, "config.json")):
            problems.append(f"{model_path!r} has no config.json (not a transformers model dir)")
        if not os.path.isdir(processor_path):
            problems.append(f"processor directory {processor_path!r} does not exist")
        if batch_size < 1:
            problems.append(f"batch_size={batch_size} must be >= 1")
        if problems:
            raise ValueError("CLIP scorer: " + "; ".join(problems))
        self.device, self.dtype = resolve_device_dtype(device, dtype)
        self.batch_size = int(batch_size)
        self.model = CLIPModel.from_pretrained(model_path).to(device=self.device, dtype=self.dtype)
        self.model.eval().requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(processor_path)
        self.transform = transform_from_hf_processor(processor_path)
        self.max_text_len = int(self.model.config.text_config.max_position_embeddings)

    def to(self, device: str | torch.device) -> "HFClip":
        self.device = torch.device(device)
        self.model.to(self.device)
        return self

    @torch.inference_mode()
    def image_embeds(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 [B, H, W, 3] -> [B, D] fp32 unit vectors on ``self.device``."""
        out = []
        for start in range(0, images.shape[0], self.batch_size):
            pixels = self.transform(images[start:start + self.batch_size], device=self.device,
                                    dtype=self.dtype)
            pooled = self.model.vision_model(pixel_values=pixels).pooler_output
            out.append(self.model.visual_projection(pooled).float())
        embeds = torch.cat(out)
        return embeds / embeds.norm(dim=-1, keepdim=True)

    @torch.inference_mode()
    def text_embeds(self, prompts: list[str]) -> torch.Tensor:
        """[B] prompts -> [B, D] fp32 unit vectors; each distinct prompt is encoded once (a GRPO
        batch holds every prompt n_samples_per_prompt times)."""
        unique = list(dict.fromkeys(prompts))
        out = []
        for start in range(0, len(unique), self.batch_size):
            tokens = self.tokenizer(unique[start:start + self.batch_size], padding=True,
                                    truncation=True, max_length=self.max_text_len,
                                    return_tensors="pt").to(self.device)
            pooled = self.model.text_model(input_ids=tokens["input_ids"],
                                           attention_mask=tokens["attention_mask"]).pooler_output
            out.append(self.model.text_projection(pooled).float())
        embeds = torch.cat(out)
        embeds = embeds / embeds.norm(dim=-1, keepdim=True)
        row = {p: i for i, p in enumerate(unique)}
        return embeds[torch.tensor([row[p] for p in prompts], device=embeds.device)]

    @property
    def logit_scale(self) -> torch.Tensor:
        return self.model.logit_scale.detach().float().exp()
