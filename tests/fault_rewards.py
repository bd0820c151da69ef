"""Custom reward functions that fail on purpose (tests of the loop's fault handling)."""
import threading


def always_nan(images, prompts, metadata):
    """Scores nothing: every sample is NaN, so every group fails a required-component check."""
    return [float("nan")] * len(prompts)


RELEASE = threading.Event()  # set by a test's teardown so that no hung thread outlives it


def hangs(images, prompts, metadata):
    """Never returns on its own (a reward stuck on a lock or a dead server)."""
    RELEASE.wait(3600)
    return [0.0] * len(prompts)


def huge(images, prompts, metadata):
    """Finite in float64, inf in float32."""
    return [1e300] * len(prompts)


def strings(images, prompts, metadata):
    """Numbers as text, as a reward parsing a judge's reply might forget to convert."""
    return ["0.5"] * len(prompts)


_CALLS = {"n": 0}


def hangs_after_preflight(images, prompts, metadata):
    """Answers preflight's dummy call, then hangs in the run (a reward that hangs sometimes).
    Preflight and the single rank share one process, hence the call count."""
    _CALLS["n"] += 1
    if _CALLS["n"] > 1:
        RELEASE.wait(3600)
    return [0.0] * len(prompts)
