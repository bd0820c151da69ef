"""HPSv2-style human preference score: an open_clip ViT-H-14 fine-tuned on HPD v2.

The checkpoint is the published single file (``HPS_v2_compressed.pt`` /
``HPS_v2.1_compressed.pt``: ``{"state_dict": ...}``); open_clip builds the architecture from its
bundled config and loads the file with its own checkpoint loader, and its bundled BPE
vocabulary is the tokenizer, so nothing is fetched.
"""
from __future__ import annotations

import os
from typing import Any, ClassVar

import torch

from trainer.rewards.base import RewardScorer
from trainer.rewards.hf_clip import resolve_device_dtype
from trainer.rewards.preprocess import transform_from_open_clip

CHECKPOINT_FILENAMES = ("HPS_v2.1_compressed.pt", "HPS_v2_compressed.pt")


class HPSv2Scorer(RewardScorer):
    """``hps = cos(text, image)`` of the fine-tuned open_clip model (the HPSv2 definition).

    Args:
        model_path: the checkpoint file, or a directory holding one of CHECKPOINT_FILENAMES.
        arch: open_clip architecture name (``ViT-H-14`` for HPSv2 / v2.1).
        arch_config: optional JSON file of an open_clip architecture, registered under its file
            stem (so ``arch`` may name it); for architectures open_clip does not bundle.
        device, dtype: as for PickScoreScorer (bf16 on CUDA, fp32 on CPU by default).
        batch_size: images per forward.
    """

    components: ClassVar[tuple[str, ...]] = ("hps",)
    required_tracks: ClassVar[tuple[str, ...]] = ("image",)

    def __init__(self, *, model_path: str, arch: str = "ViT-H-14", arch_config: str | None = None,
                 device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
                 batch_size: int = 64) -> None:
        import open_clip  # optional dependency (the [rewards] extra)

        checkpoint = model_path
        if os.path.isdir(model_path):
            found = [os.path.join(model_path, n) for n in CHECKPOINT_FILENAMES
                     if os.path.isfile(os.path.join(model_path, n))]
            if not found:
                raise FileNotFoundError(f"HPSv2Scorer: none of {', '.join(CHECKPOINT_FILENAMES)} "
                                        f"in {model_path}")
            checkpoint = found[0]
        elif not os.path.isfile(model_path):
            raise FileNotFoundError(f"HPSv2Scorer: checkpoint {model_path} does not exist")
        if arch_config is not None:
            open_clip.add_model_config(arch_config)
        if arch not in open_clip.list_models():
            raise ValueError(f"HPSv2Scorer: open_clip has no architecture {arch!r}"
                             + ("" if arch_config else " (pass arch_config for a custom one)"))
        self.device, self.dtype = resolve_device_dtype(device, dtype)
        self.batch_size = int(batch_size)
        model = open_clip.create_model(arch, pretrained=None, device="cpu")
        open_clip.load_checkpoint(model, checkpoint, strict=True)
        self.model = model.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        self.tokenizer = open_clip.get_tokenizer(arch)
        self.transform = transform_from_open_clip(open_clip.get_model_preprocess_cfg(model))

    @torch.inference_mode()
    def score(self, images: torch.Tensor, prompts: list[str],
              metadata: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        unique = list(dict.fromkeys(prompts))
        text = torch.cat([
            self.model.encode_text(self.tokenizer(unique[i:i + self.batch_size]).to(self.device),
                                   normalize=True).float()
            for i in range(0, len(unique), self.batch_size)])
        index = {p: i for i, p in enumerate(unique)}
        row = torch.tensor([index[p] for p in prompts], device=self.device)
        image = torch.cat([
            self.model.encode_image(self.transform(images[i:i + self.batch_size],
                                                   device=self.device, dtype=self.dtype),
                                    normalize=True).float()
            for i in range(0, images.shape[0], self.batch_size)])
        # encode_* normalise in the model dtype; renormalise in fp32 so bf16 rounding of the
        # norm does not leak into the score.
        image = image / image.norm(dim=-1, keepdim=True)
        text = text[row] / text[row].norm(dim=-1, keepdim=True)
        return {"hps": (image * text).sum(dim=-1)}
