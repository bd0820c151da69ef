"""Preflight: every check a run's configuration passes before the run starts, each stage
rejecting a bad config with one error that lists every problem.

- ``static``: the torch-free rules (model, trainable steps, sampling, geometry, optimizer,
  dtypes, launch, rewards), run before anything heavy is imported;
- ``data_rules``: the rules of the data, evaluation, EMA and reliability sections;
- ``imports``: the second stage, which imports every dotpath and checks reward options
  against the scorers' constructors (no weights loaded);
- ``checker``: the config under check, the problems found, each key named as its flag.
"""
from trainer.preflight.static import (local_sample_count, preflight,  # noqa: F401
                                      static_sde_indices, trainable_indices_upper_bound)
