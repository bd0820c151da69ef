"""What sequence parallelism needs of a world, a transformer and a geometry (torch-free).

Preflight calls these before any process starts (the world); the actor calls them again with
the transformer's head count and the sequence lengths of its geometry. Each returns every
problem it finds, so the caller raises one error naming them all.

Only Ulysses (an all-to-all that trades the sequence split for a head split around attention)
is supported: diffusers' ring attention merges partial results through each backend's
log-sum-exp, and the only backend that runs on CPU (torch's SDPA, diffusers' ``native``) does not
return one, so the ring path cannot be tested here; it is refused rather than shipped untested.
"""
from __future__ import annotations

from collections.abc import Mapping

KEY = "fsdp.sequence_parallel"

#: diffusers transformer class -> family, for the families whose context-parallel plan is split
#: here and tested against one rank (tests/test_sequence_parallel.py): each splits other
#: sequences (``trainer.parallel.sequence.split_lengths`` knows which), so a family outside this
#: table is refused rather than split by a plan nobody checked.
FAMILIES = {"WanTransformer3DModel": "Wan", "QwenImageTransformer2DModel": "Qwen-Image"}


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


def model_problems(degree: int, *, model: str, heads: int, sequences: Mapping[str, int]) -> list[str]:
    """Problems of a Ulysses split of ``degree`` for a transformer with ``heads`` attention heads
    whose split sequences (name -> token count for the run's geometry) are ``sequences``."""
    problems = []
    if heads % degree:
        problems.append(
            f"{KEY}={degree} must divide {model}'s {heads} attention heads (Ulysses gives each "
            f"rank heads/{degree} heads); ring attention, which would lift this, is not supported: "
            f"diffusers' ring needs an attention backend that returns the log-sum-exp, which its "
            f"native (SDPA) backend does not")
    for name, tokens in sequences.items():
        if tokens % degree:
            problems.append(f"{KEY}={degree} must divide {model}'s {name} length {tokens}: each "
                            f"rank takes an equal slice of it")
    return problems
