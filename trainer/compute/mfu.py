"""Model FLOP utilisation per stage: ``perf/mfu/rollout``, ``perf/mfu/train``, ``perf/mfu/step``.

MFU = model FLOPs of the stage / (stage seconds x the device's peak dense bf16 FLOP/s), per
rank (each rank's own samples and stage times; the loop then averages over ranks).

Model FLOPs, from the adapter's config-only count of one forward (``forward_flops``):
- rollout: every sample's ``num_inference_steps`` forwards, doubled under CFG (the
  conditional and the empty-prompt halves are both computed).
- train: every trained transition's forward + backward, counted as 3 forwards (the backward
  computes the activation gradient and the weight gradient, each as large as the forward).
  For LoRA the same 3x is counted: the activation gradients still flow back through every
  frozen matmul to reach the adapters of earlier blocks, so only the frozen weights' own
  gradients (1 of the 3) are skipped; counting 2x would understate the work a LoRA step
  does less than counting 3x overstates it, and keeps LoRA and full runs on one scale.
  Plus the no-grad forwards the stage also runs: the KL reference forward (``kl_coef`` > 0)
  and the pi_old anchor forwards of updates after the first (``anchor = "replay"``).
  Recomputation under activation checkpointing is not counted (model FLOPs, not hardware
  FLOPs, as MFU is usually defined), so checkpointing shows up as a lower MFU.
- step: rollout + train FLOPs over the whole step time.

Peak: the table below by device name (dense bf16 tensor-core FLOP/s from NVIDIA's data
sheets, the sparsity figures halved), overridden by ``logging.peak_tflops``. No peak known
(a CPU, an unlisted GPU without the override): the metrics are left out, not guessed.
"""
from __future__ import annotations

from typing import Any

#: Substring of torch.cuda.get_device_name() -> peak dense bf16 TFLOP/s. More specific names
#: first (an H100 PCIe must not match the SXM row).
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("H20", 148.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
)


def peak_flops(device_name: str | None, override_tflops: float | None = None) -> float | None:
    """Peak dense bf16 FLOP/s of the device, the override when given; None when unknown."""
    if override_tflops is not None:
        return float(override_tflops) * 1e12
    if not device_name:
        return None
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in device_name:
            return tflops * 1e12
    return None


def stage_flops(adapter: Any, batch: Any, *, num_inference_steps: int, trained_rows_factor: float,
                kl_reference: bool) -> dict[str, float] | None:
    """{"rollout", "train"} model FLOPs of one step's ``batch`` (a RolloutBatch on this
    rank), or None where the adapter states no count. ``trained_rows_factor``: extra no-grad
    forwards per trained transition (the pi_old anchors, see ``anchor_forwards``)."""
    samples = len(batch.sample_ids)
    text = _text_tokens(batch.conditions)
    one = adapter.forward_flops(batch.geometry, batch=1, text_tokens=text)
    if one is None:
        return None
    cfg_factor = 2 if float(batch.guidance_scale) != 1.0 else 1
    forward = float(one.total) * cfg_factor
    transitions = samples * len(batch.sde_indices)
    per_transition = 3.0 + (1.0 if kl_reference else 0.0) + trained_rows_factor
    return {"rollout": forward * samples * num_inference_steps,
            "train": forward * transitions * per_transition}


def anchor_forwards(anchor: str, updates: int) -> float:
    """No-grad pi_old forwards per trained transition: under ``replay`` every update but the
    first is anchored by a forward before the first optimizer step (trainer.actor.update)."""
    updates = max(1, int(updates))
    return (updates - 1) / updates if anchor == "replay" else 0.0


def mfu_metrics(flops: dict[str, float] | None, stage_times: dict[str, float], step_time: float,
                peak: float | None) -> dict[str, float]:
    """``perf/mfu/{rollout,train,step}`` and ``perf/model_tflops/step``; {} without a peak or
    a count (documented: docs/compute-accounting.md)."""
    if flops is None or not peak:
        return {}
    # the same keys on every rank whatever its times (the loop all-reduces them as one vector)
    out = {f"perf/mfu/{stage}": _rate(flops[stage], stage_times.get(stage, 0.0)) / peak
           for stage in ("rollout", "train")}
    total = flops["rollout"] + flops["train"]
    out["perf/mfu/step"] = _rate(total, step_time) / peak
    out["perf/model_tflops/step"] = _rate(total, step_time) / 1e12
    return out


def _rate(flops: float, seconds: float) -> float:
    return flops / seconds if seconds > 0 else 0.0


def _text_tokens(conditions: dict) -> int:
    """Text length of the forward: the prompt embeddings' (CFG's negative half, one forward
    with the positive, is padded to the same length)."""
    lengths = [int(v.shape[1]) for k, v in conditions.items()
               if k.split(":")[-1] == "prompt_embeds" and getattr(v, "dim", lambda: 0)() >= 3]
    return max(lengths) if lengths else 0


def step_mfu(adapter: Any, device: Any, sampling: Any, train: Any, peak_tflops: Any,
             batch: Any, stage_times: dict[str, float], step_time: float) -> dict[str, float]:
    """The loop's one call: this step's MFU metrics from the adapter's FLOP count, the
    ``rollout.sampling`` and ``[train]`` sections, and the device's peak."""
    import torch

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak = peak_flops(name, peak_tflops)
    if peak is None:
        return {}
    flops = stage_flops(adapter, batch, num_inference_steps=int(sampling.num_inference_steps),
                        trained_rows_factor=anchor_forwards(train.anchor,
                                                            train.num_updates_per_batch),
                        kl_reference=float(train.kl_coef) > 0)
    return mfu_metrics(flops, stage_times, step_time, peak)
