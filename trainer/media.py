"""Conditioning media: the reference images an editing prompt carries. Torch-free.

A prompt record of an editing task names its source image(s) in an ``images`` list::

    {"prompt": "make the car blue", "images": ["src/001.png"],
     "metadata": {"sample_id": "cars_0001"}}
    {"prompt": "put the hat from the second picture on the cat",
     "images": ["cats/7.jpg", "data:image/png;base64,iVBORw0KGgo..."], "metadata": {...}}

Each entry is either a path (relative paths are relative to the file holding the record; the
reader makes them absolute) or the image's bytes inline, as a ``data:image/<type>;base64,``
URI (the form OpenAI-compatible servers take, so a JSONL line stays text). Several entries
are several reference images, in order (Qwen-Image-Edit-Plus takes several). ``<image>``
placeholders in the prompt are optional: with none, every entry is a reference image; with
some, their count must equal the number of entries (``trainer.data.schema``).

``ImageRef`` is one entry. It is decoded lazily (``decode`` -> uint8 [H, W, 3], RGB) so a
dataset of thousands of edits costs nothing until a rollout needs its images, and it is
JSON-friendly (``entry``) so records can still cross process boundaries as plain dicts.
``image_problem`` is the one check every tool uses (preflight, ``data inspect`` and ``data
curate``): the image exists, decodes, and its size is within ``MIN_SIDE`` .. ``MAX_PIXELS``.
Text-to-image records have no ``images`` key and no conditioning media.

Where the types go (what the request / engine / batch contract carries through):

* prompt record -> ``conditioning_images(record)`` (or ``batch_sources(records)`` for a batch:
  None when no record has any, so the text-to-image path stays exactly as it is); across a
  process boundary send ``ref.entry`` strings and rebuild with ``ImageRef(entry)``;
* engine: ``ref.decode()`` (or ``ref.open()`` for a PIL image, what diffusers' edit
  pipelines take);
* rewards: ``RewardManager.score(..., sources=per_sample_refs)``; scorers that set
  ``wants_sources`` get decoded arrays (``trainer.rewards.base.RewardScorer``);
* pictures: ``trainer.visuals.log_samples(..., sources=per_sample_refs)``, and
  ``trainer.last_samples`` with the sources as a fourth item.
"""
from __future__ import annotations

import base64
import binascii
import io
import os
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

IMAGES_KEY = "images"
DATA_URI_PREFIX = "data:"
# A side below 8 pixels cannot survive any family's VAE downsampling; above 64 megapixels a
# single reference would take gigabytes once decoded: both are data errors, caught up front.
MIN_SIDE = 8
MAX_PIXELS = 64 * 1024 * 1024


class MediaError(ValueError):
    """A conditioning image cannot be used; the message says which and why."""


def is_inline(entry: str) -> bool:
    """Whether a media entry holds the image's bytes (a ``data:`` URI) rather than a path."""
    return entry.startswith(DATA_URI_PREFIX)


_MAGIC = ((b"\x89PNG", "image/png"), (b"\xff\xd8", "image/jpeg"), (b"GIF8", "image/gif"),
          (b"BM", "image/bmp"))


def _sniffed_mime(data: bytes) -> str:
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return next((mime for magic, mime in _MAGIC if data.startswith(magic)),
                "application/octet-stream")


def inline_entry(data: bytes, mime: str | None = None) -> str:
    """The ``data:`` URI of raw image bytes, as a record's ``images`` list holds it; the type
    is read from the bytes' signature when not given (decoding never depends on it)."""
    mime = mime or _sniffed_mime(data)
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def _inline_bytes(entry: str) -> bytes:
    header, sep, payload = entry.partition(",")
    if not sep or not header.endswith(";base64"):
        raise MediaError(f"inline image {entry[:40]!r}... is not a data:<type>;base64,<bytes> "
                         f"URI")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(f"inline image: its base64 does not decode ({exc})") from None


@dataclass(frozen=True)
class ImageRef:
    """One conditioning image: ``entry`` is an absolute path or a ``data:`` URI."""

    entry: str

    @classmethod
    def from_entry(cls, entry: str, base_dir: str) -> "ImageRef":
        """A record's entry, a relative path taken relative to ``base_dir``."""
        if is_inline(entry) or os.path.isabs(entry):
            return cls(entry)
        return cls(os.path.normpath(os.path.join(base_dir, entry)))

    @classmethod
    def from_bytes(cls, data: bytes, mime: str | None = None) -> "ImageRef":
        return cls(inline_entry(data, mime))

    @property
    def label(self) -> str:
        """How error messages name it: the path, or the inline image's size."""
        if is_inline(self.entry):
            return f"inline image ({len(self.entry)} characters)"
        return self.entry

    def read_bytes(self) -> bytes:
        """The encoded image (PNG, JPEG, ...); MediaError when it cannot be read."""
        if is_inline(self.entry):
            return _inline_bytes(self.entry)
        try:
            with open(self.entry, "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise MediaError(f"no file {self.entry}") from None
        except OSError as exc:
            raise MediaError(f"cannot read {self.entry} ({exc.strerror or exc})") from None

    def open(self):
        """The image fully decoded by PIL, as RGB; MediaError when it does not decode."""
        from PIL import Image  # local: the data tools and preflight import this module

        data = self.read_bytes()
        try:
            with Image.open(io.BytesIO(data)) as image:
                if image.width * image.height > MAX_PIXELS:
                    raise MediaError(f"{self.label}: {image.width}x{image.height} is more than "
                                     f"{MAX_PIXELS} pixels")
                image.load()
                return image.convert("RGB")
        except MediaError:
            raise
        except Exception as exc:  # PIL raises many types for corrupt data
            raise MediaError(f"{self.label} does not decode as an image "
                             f"({type(exc).__name__}: {exc})") from None

    def decode(self):
        """uint8 numpy [H, W, 3] (RGB)."""
        import numpy as np

        return np.asarray(self.open(), dtype=np.uint8)


def image_problem(ref: ImageRef) -> str | None:
    """None when the image is usable; otherwise why not (it is missing, does not decode, or
    its size is out of bounds)."""
    try:
        image = ref.open()
    except MediaError as exc:
        return str(exc)
    if min(image.size) < MIN_SIDE:
        return (f"{ref.label} is {image.width}x{image.height}; a side under {MIN_SIDE} pixels "
                f"is too small to condition on")
    return None


def conditioning_images(record: dict[str, Any]) -> tuple[ImageRef, ...]:
    """The reference images of a record as ``trainer.data.prompt_files`` returns it (entries
    already absolute); empty for a text-to-image record."""
    return tuple(ImageRef(entry) for entry in record.get(IMAGES_KEY, ()))


def record_media_problems(record: dict[str, Any],
                          seen: dict[ImageRef, str | None] | None = None) -> list[str]:
    """Every unusable reference image of one read record, each naming its entry. ``seen``
    (shared across a file's records) decodes an image that many records name only once."""
    problems = []
    seen = {} if seen is None else seen
    for index, ref in enumerate(conditioning_images(record)):
        if ref not in seen:
            seen[ref] = image_problem(ref)
        problem = seen[ref]
        if problem:
            problems.append(f"images[{index}]: {problem}")
    return problems


def as_arrays(sources: Iterable[ImageRef | Any]) -> tuple[Any, ...]:
    """One sample's sources as uint8 [H, W, 3] arrays: ImageRefs are decoded, arrays (and
    anything ``numpy.asarray`` takes, tensors on the CPU included) checked for shape."""
    import numpy as np

    out = []
    for source in sources:
        array = source.decode() if isinstance(source, ImageRef) else np.asarray(source)
        if array.dtype != np.uint8 or array.ndim != 3 or array.shape[-1] != 3:
            raise MediaError(f"a source image must be uint8 [H, W, 3], got {array.dtype} "
                             f"{list(array.shape)}")
        out.append(array)
    return tuple(out)


def batch_sources(records: Sequence[dict[str, Any]]) -> list[tuple[ImageRef, ...]] | None:
    """Per-sample reference images of a batch of records; None when no record has any (a
    text-to-image batch), so callers can keep that path exactly as it was."""
    sources = [conditioning_images(r) for r in records]
    return sources if any(sources) else None
