"""Custom reward functions by dotpath (``--custom-reward-path module.fn``), in our form or in
the Flow-GRPO reference's, each call bounded by a deadline.

Two forms are accepted (``adapt`` tells them apart once, when the scorer is built):

* **Batch function** (ours): ``fn(images, prompts, metadata)`` with images uint8
  [B, H, W, 3] on the rollout device, prompts list[str], metadata list[dict].
* **Factory** (Flow-GRPO's ``flow_grpo/rewards.py``): ``fn()`` or ``fn(device)`` builds the
  scorer once and returns the batch function ``_fn(images, prompts, metadata)``. Its images
  come in the reference's layout, float32 [B, 3, H, W] in [0, 1], because reference code
  converts with ``(images * 255).round()...transpose(0, 2, 3, 1)``, which our uint8 layout
  would silently garble.

Either form may set ``image_layout = "uint8_bhwc"`` (ours) or ``"float_bchw"`` (the
reference's) on the function (or on the factory) to choose the layout explicitly.

**Video functions** set ``media = "video"`` (on the function or the factory): their first
argument is then the video batch, uint8 [B, F, H, W, 3] (the convention of
``trainer.media``; an image batch comes as one-frame videos [B, 1, H, W, 3]), whichever
form they are written in, with the prompts, metadata and (a function that takes ``sources``)
the sources as for images. An ``image_layout`` other than ``"uint8_bfhwc"`` on a video
function is an error: there is no reference layout for video to follow.

The batch function returns

* B numbers (a list, tuple, numpy array or tensor): one component, named by the function's
  ``component`` attribute if it has one, else by the function's (or the factory's) name; or
* a dict ``{component: B numbers}``: several components, declared up front as
  ``fn.components = ("a", "b")`` (on the function or the factory) so the configured weights
  and required components are checked before the first rollout;
* or either of these as the first item of a pair ``(scores, info)``, the reference's return
  (``info`` is a dict and is discarded).

Numbers only: ``None`` (or NaN) marks a sample the function could not score; strings, bools
and values beyond float32's range are refused (``base.to_component_tensor``).

Deadline: every call into the user's code (the factory, and each scoring call) runs in a
daemon thread and must return within ``timeout_s`` (``reward.custom_timeout_s``); otherwise a
RewardError names the function and the deadline. Python cannot stop the hung thread; the run
stops instead, which is the point: a reward that hangs must not hang the run forever.

Preflight (``dummy_batch_problems``) calls every custom reward on a batch of two grey images
(two grey two-frame videos for a video function) before any model loads, so a wrong
signature or return is one error naming the form wanted. A factory is therefore called
twice: once in preflight (``device`` "cpu"), once when the rank builds its reward manager
(the rollout device).
"""
from __future__ import annotations

import functools
import inspect
import threading
from typing import Any, Callable, Mapping

import torch

from trainer.rewards.base import RewardError, RewardScorer, frames_of, load_object, \
    to_component_tensor

LAYOUTS = {"uint8_bhwc": "uint8 [B, H, W, 3]", "float_bchw": "float32 [B, 3, H, W] in [0, 1]",
           "uint8_bfhwc": "uint8 videos [B, F, H, W, 3]"}
VIDEO_LAYOUT = "uint8_bfhwc"
MEDIA = ("image", "video")
DEFAULT_TIMEOUT_S = 600.0
WANTED = ("fn(images, prompts, metadata) -> B numbers | {component: B numbers} | (either, "
          "info dict), or a factory fn() / fn(device) returning such a function")


def call_with_deadline(fn: Callable[..., Any], args: tuple, timeout_s: float, what: str) -> Any:
    """``fn(*args)`` in a daemon thread; its result, its exception, or a RewardError after
    ``timeout_s`` naming ``what``. The caller's CUDA device and grad mode are the thread's
    too (torch keeps both per thread)."""
    box: dict[str, Any] = {}
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
    grad = torch.is_grad_enabled()

    def run() -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)
            with torch.set_grad_enabled(grad):
                box["value"] = fn(*args)
        except BaseException as exc:  # handed to the caller's thread, raised there
            box["error"] = exc

    worker = threading.Thread(target=run, name=f"reward:{what}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise RewardError(f"{what} did not return within {timeout_s:g} s "
                          f"(reward.custom_timeout_s); it may hang: the run stops here")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _required_positional(fn: Callable[..., Any]) -> list[str] | None:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None  # a builtin without a signature: taken as a batch function
    params = list(params)
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None  # fn(*args) takes a batch as well as nothing: taken as a batch function
    return [p.name for p in params if p.default is p.empty
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _attr(name: str, *objects: Any) -> Any:
    return next((getattr(o, name) for o in objects if getattr(o, name, None) is not None), None)


def adapt(obj: Any, *, name: str, device: torch.device, timeout_s: float
          ) -> tuple[Callable[..., Any], str, Any]:
    """(batch function, image layout, object whose attributes declare components)."""
    if not callable(obj) or isinstance(obj, type):
        raise ValueError(f"custom reward {name} is not a function; wanted {WANTED}")
    required = _required_positional(obj)
    if required is None or len(required) == 3:
        fn, source, default_layout = obj, obj, "uint8_bhwc"
    elif required == [] or required == ["device"]:
        args = (device,) if required else ()
        fn = call_with_deadline(obj, args, timeout_s, f"custom reward factory {name}")
        if not callable(fn):
            raise ValueError(f"custom reward {name} is a factory (takes {required or 'nothing'})"
                             f" but returned {type(fn).__name__}, not a function; wanted "
                             f"{WANTED}")
        inner = _required_positional(fn)
        if inner is not None and len(inner) != 3:
            raise ValueError(f"custom reward {name}: the factory's function takes {inner}; "
                             f"wanted _fn(images, prompts, metadata)")
        source, default_layout = obj, "float_bchw"
    else:
        raise ValueError(f"custom reward {name} takes {required}; wanted {WANTED}")
    layout = _attr("image_layout", fn, obj)
    media = _attr("media", fn, obj) or ("video" if layout == VIDEO_LAYOUT else "image")
    if media not in MEDIA:
        raise ValueError(f"custom reward {name}: media={media!r}, choose one of {list(MEDIA)}")
    if media == "video" and layout not in (None, VIDEO_LAYOUT):
        raise ValueError(f"custom reward {name}: a video function (media = 'video') takes "
                         f"{LAYOUTS[VIDEO_LAYOUT]}, but sets image_layout={layout!r}; drop it")
    layout = VIDEO_LAYOUT if media == "video" else layout or default_layout
    if layout not in LAYOUTS:
        raise ValueError(f"custom reward {name}: image_layout={layout!r}, choose one of "
                         f"{list(LAYOUTS)}")
    return fn, layout, source


def _takes_sources(fn: Callable[..., Any]) -> bool:
    try:
        return "sources" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: it takes none
        return False


def to_layout(images: torch.Tensor, layout: str) -> torch.Tensor:
    """Our uint8 [B, H, W, 3] (or video [B, F, H, W, 3]) -> what the function asked for."""
    if layout == VIDEO_LAYOUT:
        return frames_of(images)
    if layout == "float_bchw":
        return images.permute(0, 3, 1, 2).float().div_(255.0)
    return images


class FunctionScorer(RewardScorer):
    """A RewardScorer around a plain batch function or a reference factory (module docstring).

    Args:
        fn: the function or factory.
        name: how errors name it (the dotpath).
        device: given to a factory that takes ``device``.
        timeout_s: deadline of each call into ``fn`` (and of the factory call).
    """

    required_tracks = ("image",)

    def __init__(self, fn: Callable[..., Any], *, name: str | None = None,
                 device: str | torch.device | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.name = name or getattr(fn, "__qualname__", repr(fn))
        if not timeout_s > 0:
            raise ValueError(f"custom reward {self.name}: timeout_s={timeout_s} must be > 0")
        self.timeout_s = float(timeout_s)
        self.fn, self.image_layout, source = adapt(
            fn, name=self.name, device=torch.device(device or "cpu"), timeout_s=self.timeout_s)
        self.wants_sources = _takes_sources(self.fn)  # per function: shadows the class default
        self.takes_video = self.image_layout == VIDEO_LAYOUT  # likewise
        self.required_tracks = ("video",) if self.takes_video else ("image",)
        declared = _attr("components", self.fn, source)
        self.declared = declared is not None
        if declared is not None:
            if isinstance(declared, str) or not declared or \
                    not all(isinstance(c, str) and c for c in declared):
                raise ValueError(f"custom reward {self.name}: fn.components must be a non-empty "
                                 f"tuple of names, got {declared!r}")
            self.components = tuple(declared)
        else:
            self.components = (str(_attr("component", self.fn, source)
                                   or getattr(source, "__name__", "custom")),)

    @classmethod
    def from_dotpath(cls, dotpath: str, **kwargs: Any) -> "FunctionScorer":
        return cls(load_object(dotpath, "custom reward path"), name=dotpath, **kwargs)

    def score(self, images: torch.Tensor, prompts: list[str],
              metadata: list[dict[str, Any]], sources: Any = None) -> dict[str, Any]:
        fn = functools.partial(self.fn, sources=sources) if self.wants_sources else self.fn
        out = call_with_deadline(fn, (to_layout(images, self.image_layout), prompts,
                                           metadata), self.timeout_s,
                                 f"custom reward {self.name}")
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
            out = out[0]  # the reference's (scores, info)
        if isinstance(out, Mapping):
            if not self.declared and len(self.components) == 1 and set(out) != set(self.components):
                raise RewardError(
                    f"custom reward {self.name} returned a dict with keys {sorted(out)} but does "
                    f"not declare them: set `{getattr(self.fn, '__name__', 'fn')}.components = "
                    f"{tuple(sorted(map(str, out)))!r}`")
            unknown = sorted(set(out) - set(self.components))
            if unknown:
                raise RewardError(f"custom reward {self.name} returned undeclared components "
                                  f"{unknown} (declared: {list(self.components)})")
            return dict(out)
        if isinstance(out, (int, float)):
            raise RewardError(f"custom reward {self.name} returned one number for a batch of "
                              f"{len(prompts)}; return one value per sample")
        if isinstance(out, (str, bytes)) or out is None:
            raise RewardError(f"custom reward {self.name} returned {type(out).__name__} "
                              f"{str(out)[:40]!r} for a batch of {len(prompts)}; return one "
                              f"number per sample")
        return {self.components[0]: out}


DUMMY_PROMPTS = ("a photo of a cat", "a red cube to the left of a blue ball")


def _dummy_sources(records: list[dict], images: torch.Tensor) -> list[tuple]:
    """The records' own source images when they all have decodable ones, else one grey
    source per sample (a broken image is the data rules' finding, not this check's)."""
    from trainer.media import MediaError, as_arrays, conditioning_images

    try:
        real = [as_arrays(conditioning_images(r)) for r in records]
    except MediaError:
        real = []
    if len(real) == len(images) and all(real):
        return real
    return [(images[0].numpy(),)] * len(images)


def dummy_batch_problems(scorer: FunctionScorer, *, height: int = 64, width: int = 64,
                         records: list[dict] | None = None, frames: int = 2) -> list[str]:
    """Call ``scorer`` on two grey uint8 images (``frames``-frame grey videos for a video
    function; prompts, metadata and, for a function that takes them, source images from
    ``records``, the run's first prompt records when given) and check what comes back, as
    the manager will."""
    records = list(records or [])[:2]
    prompts = [r["prompt"] for r in records] or list(DUMMY_PROMPTS)
    metadata = [dict(r.get("metadata") or {}) for r in records] or [{} for _ in prompts]
    images = torch.full((len(prompts), height, width, 3), 128, dtype=torch.uint8)
    media = images
    if scorer.takes_video:
        media = images.unsqueeze(1).expand(-1, max(1, frames), -1, -1, -1).contiguous()
    where = (f"reward.custom_reward_path: {scorer.name} called on a dummy batch of "
             f"{len(prompts)} (images {LAYOUTS[scorer.image_layout]})")
    sources = {"sources": _dummy_sources(records, images)} if scorer.wants_sources else {}
    try:
        out = scorer.score(media, prompts, metadata, **sources)
    except RewardError as exc:
        return [f"{where}: {exc} (wanted {WANTED})"]
    except Exception as exc:  # the user's code: any failure is reported, not raised
        return [f"{where} raised {type(exc).__name__}: {exc} (prompts {prompts}, metadata "
                f"{metadata}; wanted {WANTED})"]
    problems: list[str] = []
    for component, values in out.items():
        to_component_tensor(component, values, len(prompts), problems)
    return [f"{where}: {p} (wanted {WANTED})" for p in problems]
