"""CLIP-style image preprocessing in torch, on whatever device the images already are.

The published processors (transformers' CLIPImageProcessor, open_clip's torchvision
transforms) work image by image on the host. In the colocated runtime the decoded images
already sit on the rollout GPU, so we read the processor's *configuration* (transformers'
preprocessor_config.json, read as plain JSON because the processor classes moved between
transformers 4 and 5; open_clip's model preprocess cfg) and apply the same recipe as one
batched torch op there: resize the shortest edge
(bicubic, antialiased, rounded to uint8 levels as PIL does), centre crop, rescale, normalise.

Agreement with the libraries (tests check it): within one uint8 level per pixel (PIL works in
fixed point), on either resize path.
NOTE: on the CPU torch's uint8 channels-last bicubic resize (its PIL-compatible fast path) was
several times faster than PIL and than float32 (figures:
bench/reports/2026-12-04_cpu-h200_comment-figures.md), so on the CPU the resize runs on uint8
channels-last, on CUDA in float32 (there is no uint8 bicubic kernel there).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

_PIL_RESAMPLE_TO_MODE = {2: "bilinear", 3: "bicubic"}  # PIL.Image.Resampling values


def resize_like_pil(images: torch.Tensor, size: tuple[int, int], mode: str = "bicubic", *,
                    uint8_path: bool | None = None) -> torch.Tensor:
    """uint8 [B, 3, H, W] -> antialiased resize to ``size``, float32 holding uint8 levels.

    ``uint8_path`` None picks by device: uint8 channels-last on CPU, float32 elsewhere.
    """
    if uint8_path is None:
        uint8_path = images.device.type == "cpu"
    if uint8_path:
        out = F.interpolate(images.contiguous(memory_format=torch.channels_last), size=size,
                            mode=mode, antialias=True)
        return out.to(torch.float32)
    # PIL resizes horizontally, rounds and clips to uint8, then resizes vertically; doing the
    # same (the antialiased filters are separable) keeps bicubic overshoot from drifting
    # away from it where pixels saturate: 1 level at most against PIL on pure noise, where a
    # single 2-D float pass is up to 19 levels off.
    out = images.float()
    height, width = out.shape[-2:]
    if size[1] != width:
        out = F.interpolate(out, size=(height, size[1]), mode=mode, antialias=True,
                            align_corners=False).round_().clamp_(0.0, 255.0)
    if size[0] != height:
        out = F.interpolate(out, size=tuple(size), mode=mode, antialias=True,
                            align_corners=False).round_().clamp_(0.0, 255.0)
    return out


@dataclass(frozen=True)
class ClipImageTransform:
    """The eval-time transform of a CLIP image tower.

    Args:
        resize: target of the resize; ``("shortest", n)`` scales the shorter side to n keeping
            the aspect ratio (output long side ``int(n * long / short)``, as both libraries
            compute it), ``("exact", h, w)`` squashes to h x w, ``None`` skips the resize.
        crop: (height, width) of the centre crop, or None.
        crop_rounding: ``"floor"`` puts the crop's top-left at ``(H - h) // 2`` as
            transformers does, ``"round"`` at ``round((H - h) / 2)`` as torchvision does.
        mean, std: per-channel normalisation after rescaling to [0, 1].
        interpolation: ``"bicubic"`` or ``"bilinear"``.
        rescale: factor applied to the 0..255 pixel values (1/255 for both libraries).
    """

    resize: tuple | None
    crop: tuple[int, int] | None
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    interpolation: str = "bicubic"
    crop_rounding: str = "floor"
    rescale: float = 1.0 / 255.0

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        if self.resize is not None:
            height, width = self._resized_size(height, width)
        return self.crop if self.crop is not None else (height, width)

    def _resized_size(self, height: int, width: int) -> tuple[int, int]:
        if self.resize[0] == "exact":
            return int(self.resize[1]), int(self.resize[2])
        target = int(self.resize[1])
        if height <= width:
            return target, int(target * width / height)
        return int(target * height / width), target

    def __call__(self, images: torch.Tensor, *, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """uint8 [B, H, W, 3] -> normalised [B, 3, h, w] in ``dtype`` on ``device``."""
        x = images.to(device=device if device is not None else images.device)
        x = x.permute(0, 3, 1, 2)
        height, width = x.shape[-2:]
        if self.resize is not None:
            size = self._resized_size(height, width)
            if size != (height, width):
                x = resize_like_pil(x, size, self.interpolation)
            height, width = size
        x = x.to(torch.float32)
        if self.crop is not None:
            ch, cw = self.crop
            if ch > height or cw > width:
                raise ValueError(f"centre crop {ch}x{cw} is larger than the resized image "
                                 f"{height}x{width}")
            if self.crop_rounding == "round":
                top, left = int(round((height - ch) / 2.0)), int(round((width - cw) / 2.0))
            else:
                top, left = (height - ch) // 2, (width - cw) // 2
            x = x[:, :, top:top + ch, left:left + cw]
        mean = torch.tensor(self.mean, device=x.device, dtype=torch.float32).view(1, 3, 1, 1)
        std = torch.tensor(self.std, device=x.device, dtype=torch.float32).view(1, 3, 1, 1)
        return ((x * self.rescale - mean) / std).to(dtype).contiguous()


def _hw(value: Any, what: str) -> tuple[int, int]:
    if isinstance(value, int):
        return value, value
    if isinstance(value, dict) and "height" in value and "width" in value:
        return int(value["height"]), int(value["width"])
    raise ValueError(f"unsupported {what} {value!r} in the image processor config")


def transform_from_hf_processor(model_dir: str) -> ClipImageTransform:
    """Read ``preprocessor_config.json`` (transformers' CLIPImageProcessor format)."""
    path = os.path.join(model_dir, "preprocessor_config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no preprocessor_config.json in {model_dir} (a transformers "
                                "CLIP directory saves one with its processor)")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    problems = []
    resize = None
    if cfg.get("do_resize", True):
        size = cfg.get("size", {"shortest_edge": 224})
        if isinstance(size, int):
            resize = ("shortest", size)
        elif isinstance(size, dict) and "shortest_edge" in size:
            resize = ("shortest", int(size["shortest_edge"]))
        elif isinstance(size, dict) and "height" in size and "width" in size:
            resize = ("exact", int(size["height"]), int(size["width"]))
        else:
            problems.append(f"unsupported size {size!r}")
    crop = _hw(cfg.get("crop_size", 224), "crop_size") if cfg.get("do_center_crop", True) else None
    resample = cfg.get("resample", 3)
    if resample not in _PIL_RESAMPLE_TO_MODE:
        problems.append(f"unsupported resample {resample!r} (bicubic=3 or bilinear=2)")
    if not cfg.get("do_rescale", True) or not cfg.get("do_normalize", True):
        problems.append("do_rescale=false / do_normalize=false are not CLIP preprocessing")
    if problems:
        raise ValueError(f"{path}: " + "; ".join(problems))
    return ClipImageTransform(
        resize=resize, crop=crop,
        mean=tuple(float(v) for v in cfg.get("image_mean", (0.48145466, 0.4578275, 0.40821073))),
        std=tuple(float(v) for v in cfg.get("image_std", (0.26862954, 0.26130258, 0.27577711))),
        interpolation=_PIL_RESAMPLE_TO_MODE.get(resample, "bicubic"),
        crop_rounding="floor",
        rescale=float(cfg.get("rescale_factor", 1.0 / 255.0)),
    )


def transform_from_open_clip(preprocess_cfg: dict[str, Any]) -> ClipImageTransform:
    """From ``open_clip.get_model_preprocess_cfg(model)`` (eval transform, RGB)."""
    size = preprocess_cfg.get("size", 224)
    hw = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    mode = preprocess_cfg.get("resize_mode", "shortest")
    interpolation = preprocess_cfg.get("interpolation", "bicubic")
    problems = []
    if interpolation not in ("bicubic", "bilinear"):
        problems.append(f"interpolation {interpolation!r}")
    if mode == "shortest" and hw[0] == hw[1]:
        resize = ("shortest", hw[0])
    elif mode == "squash":
        resize = ("exact", hw[0], hw[1])
    else:
        problems.append(f"resize_mode {mode!r} with size {size!r}")
        resize = None
    if problems:
        raise ValueError("unsupported open_clip preprocessing: " + "; ".join(problems))
    return ClipImageTransform(resize=resize, crop=hw, mean=_triple(preprocess_cfg["mean"]),
                              std=_triple(preprocess_cfg["std"]), interpolation=interpolation,
                              crop_rounding="round")


def _triple(values: Sequence[float] | float) -> tuple[float, float, float]:
    if isinstance(values, (int, float)):
        return (float(values),) * 3
    return tuple(float(v) for v in values)  # type: ignore[return-value]
