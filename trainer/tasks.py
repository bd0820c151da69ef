"""The generation-task vocabulary, importable without torch.

- ``t2i``: text to image, the case without conditioning media.
- ``edit``: image editing: a prompt and one or several reference images (the prompt record's
  ``images``, ``trainer.media``) to one image. One task for every editing family (Qwen-Image-
  Edit, Qwen-Image-Edit-Plus, FLUX.1 Kontext): what differs between them, such as how many
  reference images they take, is the adapter's (``max_condition_images``), not the task's.
- ``t2v``: text to video (Wan): no conditioning media; the sampling table's ``num_frames``
  gives the frames (``trainer.models.geometry``).
- ``i2v``: image to video (Wan I2V): a prompt and one image per prompt record (its ``images``),
  the video's first frame; the frames as for ``t2v``.

A family that brings its own adapter for another task must add the task name here too, so
that the vocabulary never lists a task without a replay path. ``trainer.preflight`` checks
``--generation-task`` against this tuple before anything heavy is imported;
``trainer.models.base`` re-exports it.
"""
from __future__ import annotations

GENERATION_TASKS: tuple[str, ...] = ("t2i", "edit", "t2v", "i2v")
# The tasks whose families take conditioning media (reference images: ``trainer.media``); a
# subset of GENERATION_TASKS. Preflight refuses prompt records that carry images for any
# other task: a text-to-image family would silently drop them.
CONDITIONED_TASKS: tuple[str, ...] = ("edit", "i2v")
