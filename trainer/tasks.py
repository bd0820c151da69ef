"""The generation-task vocabulary, importable without torch.

Only text-to-image exists. A family that brings its
own adapter for another task must add the task name here too, so that the vocabulary never
lists a task without a replay path. ``trainer.preflight`` checks ``--generation-task`` against
this tuple before anything heavy is imported; ``trainer.models.base`` re-exports it.
"""
from __future__ import annotations

GENERATION_TASKS: tuple[str, ...] = ("t2i",)
# The tasks whose families take conditioning media (reference images: ``trainer.media``); a
# subset of GENERATION_TASKS. Preflight refuses prompt records that carry images for any
# other task: a text-to-image family would silently drop them. Empty until the first editing
# family registers its task here.
CONDITIONED_TASKS: tuple[str, ...] = ()
