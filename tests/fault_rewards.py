"""Custom reward functions that fail on purpose (tests of the loop's fault handling)."""


def always_nan(images, prompts, metadata):
    """Scores nothing: every sample is NaN, so every group fails a required-component check."""
    return [float("nan")] * len(prompts)
