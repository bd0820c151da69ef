"""What sequence parallelism needs of a world, a transformer and a geometry (torch-free).

Preflight calls these before any process starts (the world); the actor calls them again with
the transformer's head count and the sequence lengths of its geometry. Each returns every
problem it finds, so the caller raises one error naming them all.

Which attention splits the sequence is chosen, not configured: Ulysses (an all-to-all that
trades the sequence split for a head split around attention) where the degree divides the
attention heads, since it moves each token's query, key, value and output once; ring attention
(each rank's keys and values passed round the group, partial results merged by their
log-sum-exp) where it does not. Both are diffusers' code. Ring needs an attention backend that
returns the log-sum-exp (``RING_BACKENDS``): on the CPU this project's
(``trainer.parallel.cpu_flash_attention``, tested at two gloo ranks against one), on CUDA
diffusers' ``_native_cudnn`` (untested here). Ring and Ulysses are not combined.
"""
from __future__ import annotations

from collections.abc import Mapping

KEY = "fsdp.sequence_parallel"

#: diffusers transformer class -> family, for the families whose context-parallel plan is split
#: here and tested against one rank (tests/test_sequence_parallel.py): each splits other
#: sequences (``trainer.parallel.sequence.split_lengths`` knows which), so a family outside this
#: table is refused rather than split by a plan nobody checked.
FAMILIES = {"WanTransformer3DModel": "Wan", "QwenImageTransformer2DModel": "Qwen-Image"}

#: device type -> the attention backend ring attention runs with (diffusers' dispatcher name).
#: cuDNN's is torch's own (no extra package), returns the log-sum-exp and computes in bf16/fp16.
RING_BACKENDS = {"cpu": "flowgrpo_cpu_flash", "cuda": "_native_cudnn"}
_HALF = ("bf16", "fp16")


def uses_ring(degree: int, heads: int) -> bool:
    """Whether a split of ``degree`` over a transformer of ``heads`` heads runs ring attention
    (the degree does not divide the heads) rather than Ulysses."""
    return degree > 1 and heads % degree != 0


def world_problems(degree: int, world: int) -> list[str]:
    """Problems of splitting ``world`` ranks into sequence groups of ``degree``."""
    if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
        return [f"{KEY}={degree!r} must be an integer >= 1 (1 = off)"]
    if world % degree:
        return [f"{KEY}={degree} must divide the world size {world} (ranks = data groups x "
                f"sequence degree)"]
    return []


def family_problems(degree: int, transformer_class: str) -> list[str]:
    """Problems of splitting a transformer of diffusers class ``transformer_class``."""
    if degree == 1 or transformer_class in FAMILIES:
        return []
    supported = ", ".join(f"{name} ({cls})" for cls, name in FAMILIES.items())
    return [f"{KEY}={degree}: {transformer_class} cannot be split over a sequence group; "
            f"supported: {supported}"]


def model_problems(degree: int, *, model: str, sequences: Mapping[str, int]) -> list[str]:
    """Problems of a split of ``degree`` (Ulysses or ring alike) for a transformer whose split
    sequences (name -> token count for the run's geometry) are ``sequences``."""
    problems = []
    for name, tokens in sequences.items():
        if tokens % degree:
            problems.append(f"{KEY}={degree} must divide {model}'s {name} length {tokens}: each "
                            f"rank takes an equal slice of it")
    return problems


def ring_problems(degree: int, *, model: str, transformer_class: str, device_type: str,
                  compute_dtype: str | None = None) -> list[str]:
    """Problems of ring attention of ``degree`` for a transformer of diffusers class
    ``transformer_class`` computing on ``device_type`` in ``compute_dtype`` (None: not known
    yet, not checked)."""
    why = f"{KEY}={degree} runs ring attention for {model} (the degree does not divide its heads)"
    if device_type not in RING_BACKENDS:
        return [f"{why}, which has no attention backend on {device_type!r}; it runs on "
                f"{', '.join(RING_BACKENDS)}"]
    problems = []
    if device_type == "cuda" and compute_dtype is not None and compute_dtype not in _HALF:
        problems.append(f"{why} with diffusers' {RING_BACKENDS['cuda']} backend, which computes "
                        f"in {' or '.join(_HALF)}, not {compute_dtype} (fsdp.param_dtype)")
    if device_type == "cuda" and transformer_class == "QwenImageTransformer2DModel":
        # diffusers' ring gives every key chunk this rank's mask; only our CPU backend
        # gives each chunk its own, and Qwen-Image masks its padded text
        problems.append(f"{why} on CUDA, where diffusers' ring attention applies one rank's "
                        f"text mask to every rank's keys; Qwen-Image's padded prompts need "
                        f"their own masks: choose a degree that divides the heads")
    return problems
