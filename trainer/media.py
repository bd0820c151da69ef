"""Conditioning media (the reference images an editing prompt carries) and the video
convention of rewards and pictures. Torch-free.

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

Video (the section at the end): a video batch is uint8 [B, F, H, W, 3] for every reward and
picture; ``as_video`` converts the channel-first layouts at the boundary, ``spread_indices``
picks the frames a sampled reward or a frame strip uses, and ``gif_bytes`` / ``write_gif`` /
``read_frames`` make and read the animated previews.
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


# ---- video ------------------------------------------------------------------------------
# One convention for every reward and picture: a video batch is uint8 [B, F, H, W, 3] (RGB),
# the image convention [B, H, W, 3] with a frame axis after the batch, so one frame of it is
# an image as every scorer already takes it. Engines and VAEs hand out channel-first layouts
# ([B, C, F, H, W] from a video VAE's decode, [B, F, C, H, W] from frame-wise code);
# ``as_video`` converts at that boundary. The layout is always named, never guessed from the
# shape: a three-frame video in [B, C, F, H, W] has the same shape as in [B, F, C, H, W].
# A video with F = 1 is an image: the reward manager and the pictures drop its frame axis.
VIDEO_LAYOUTS: dict[str, tuple[int, ...]] = {
    "bfhwc": (0, 1, 2, 3, 4),  # ours
    "bcfhw": (0, 2, 3, 4, 1),  # a video VAE's decode (diffusers' Wan, Hunyuan, LTX)
    "bfchw": (0, 1, 3, 4, 2),  # a list of channel-first frames, stacked
}


def as_video(video: Any, layout: str) -> Any:
    """A uint8 video batch in ``layout`` (a key of ``VIDEO_LAYOUTS``) -> uint8
    [B, F, H, W, 3], a torch tensor or numpy array as given (a view where the layout allows).
    MediaError naming the problem for another layout, rank, channel count or dtype."""
    if layout not in VIDEO_LAYOUTS:
        raise MediaError(f"video layout {layout!r} is not one of {sorted(VIDEO_LAYOUTS)}")
    shape = tuple(getattr(video, "shape", ()))
    dtype = str(getattr(video, "dtype", type(video).__name__))
    if len(shape) != 5:
        raise MediaError(f"a video batch in layout {layout!r} has 5 dimensions, got shape "
                         f"{list(shape)}")
    if not dtype.endswith("uint8"):
        raise MediaError(f"a video batch must be uint8 (0..255), got {dtype}: convert floats "
                         f"once, where their range ([0, 1] or [-1, 1]) is known")
    perm = VIDEO_LAYOUTS[layout]
    out = video.permute(*perm) if hasattr(video, "permute") else video.transpose(perm)
    if out.shape[-1] != 3:
        raise MediaError(f"a video batch in layout {layout!r} has 3 channels at axis "
                         f"{perm[-1]}, got shape {list(shape)}")
    return out


def spread_indices(count: int, k: int) -> list[int]:
    """``k`` of ``count`` frame indices, evenly spread and always the same: first and last
    included (k >= 2), the middle frame for k = 1, every frame when k >= count."""
    if count < 1 or k < 1:
        raise ValueError(f"spread_indices needs count >= 1 and k >= 1, got {count}, {k}")
    if k >= count:
        return list(range(count))
    if k == 1:
        return [(count - 1) // 2]
    return sorted({round(i * (count - 1) / (k - 1)) for i in range(k)})


GIF_FPS = 8  # a preview rate: slow enough to follow a short clip frame by frame


def gif_bytes(frames: Any, fps: float = GIF_FPS) -> bytes:
    """uint8 [F, H, W, 3] frames -> an animated GIF (looping), through PIL's GIF writer.

    GIF has a 256-colour palette per frame (PIL quantises each frame): a preview for eyes,
    not a record. PIL stores consecutive identical frames once with their durations added,
    so the file plays for the same time but a static stretch decodes to fewer frames."""
    from PIL import Image
    import numpy as np

    arrays = np.asarray(frames.cpu() if hasattr(frames, "cpu") else frames)
    if arrays.dtype != np.uint8 or arrays.ndim != 4 or arrays.shape[-1] != 3 or \
            not len(arrays):
        raise MediaError(f"GIF frames must be uint8 [F, H, W, 3] with F >= 1, got "
                         f"{arrays.dtype} {list(arrays.shape)}")
    if not fps > 0:
        raise MediaError(f"GIF fps={fps!r} must be > 0")
    images = [Image.fromarray(np.ascontiguousarray(a)) for a in arrays]
    buffer = io.BytesIO()
    images[0].save(buffer, format="GIF", save_all=True, append_images=images[1:],
                   duration=max(1, round(1000 / fps)), loop=0)
    return buffer.getvalue()


def write_gif(path: str | os.PathLike, frames: Any, fps: float = GIF_FPS) -> None:
    """``gif_bytes`` to ``path`` through a temporary file and a rename: a viewer never
    sees half a file."""
    data = gif_bytes(frames, fps)
    tmp = f"{os.fspath(path)}.tmp"
    os.makedirs(os.path.dirname(os.path.abspath(tmp)), exist_ok=True)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_frames(data: bytes | str | os.PathLike) -> Any:
    """An animated file (GIF, APNG, WebP; bytes or a path) -> uint8 [F, H, W, 3] numpy."""
    from PIL import Image, ImageSequence
    import numpy as np

    source = io.BytesIO(data) if isinstance(data, bytes) else data
    with Image.open(source) as image:
        return np.stack([np.asarray(frame.convert("RGB"))
                         for frame in ImageSequence.Iterator(image)])
