"""``Geometry``: what a generation task produces, in pixels and frames. Torch-free.

Every adapter method that depends on the output's size (latent shape, x_T's draw shape, the
sigma schedule's shift, the forward, decoding, compute accounting) takes one ``Geometry`` in
place of loose ``height, width`` arguments, so a family that adds a dimension (video: frames)
changes the value, not every signature between the request and the transformer.

``frames`` is 1 for an image. Images are the case every shipped family serves today; a video
family reads ``frames`` and its request carries ``num_frames`` (``trainer.models.wire``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class Geometry:
    """The output of one candidate: ``height`` x ``width`` pixels, ``frames`` frames (1: an image)."""

    height: int
    width: int
    frames: int = 1

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("invalid geometry: " + "; ".join(problems))

    def problems(self) -> list[str]:
        """Why this is not a geometry ([] when it is): each field a positive integer."""
        return [f"{name} must be a positive integer, got {value!r}"
                for name, value in (("height", self.height), ("width", self.width),
                                    ("frames", self.frames))
                if isinstance(value, bool) or not isinstance(value, int) or value <= 0]

    @property
    def is_video(self) -> bool:
        return self.frames > 1

    def request_fields(self) -> dict[str, int]:
        """The rollout request's geometry fields (SGLang's names); ``num_frames`` only for
        video, so an image request is what it was before frames existed."""
        fields = {"height": self.height, "width": self.width}
        if self.is_video:
            fields["num_frames"] = self.frames
        return fields

    @classmethod
    def from_request(cls, request: Mapping[str, Any]) -> "Geometry":
        """The geometry of a request or response carrying ``request_fields``."""
        return cls(request["height"], request["width"], request.get("num_frames", 1))

    def __str__(self) -> str:
        size = f"{self.height}x{self.width}"
        return f"{size}x{self.frames}f" if self.is_video else size
