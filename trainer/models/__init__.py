"""Model adapters: one class per model family, chosen by dotpath (``--model-adapter-path``).

The shipped families and their dotpaths are in ``ADAPTERS``; ``adapter_class`` resolves either
a family name from it or any ``package.module.Class`` dotpath (a user's own adapter).
Importing this package imports neither torch-heavy modules nor diffusers.
"""
from __future__ import annotations

import importlib

ADAPTERS: dict[str, str] = {
    "qwen_image": "trainer.models.qwen_image.QwenImageAdapter",
    "qwen_image_edit": "trainer.models.qwen_image_edit.QwenImageEditAdapter",
    "qwen_image_edit_plus": "trainer.models.qwen_image_edit.QwenImageEditPlusAdapter",
    "sd3": "trainer.models.sd3.SD3Adapter",
    "flux": "trainer.models.flux.FluxAdapter",
    "flux_kontext": "trainer.models.flux_kontext.FluxKontextAdapter",
    "wan": "trainer.models.wan.WanAdapter",
    "wan_i2v": "trainer.models.wan_i2v.WanI2VAdapter",
    "toy": "trainer.toy.adapter.ToyAdapter",
}


def adapter_class(path: str) -> type:
    """The adapter class named by a family in ``ADAPTERS`` or by a ``module.Class`` dotpath."""
    from trainer.models.base import GenerativeModelAdapter  # local: torch (see the docstring)

    dotpath = ADAPTERS.get(path, path)
    module_name, _, class_name = dotpath.rpartition(".")
    if not module_name:
        raise ValueError(f"adapter path {path!r} is neither a family {sorted(ADAPTERS)} "
                         "nor a 'package.module.Class' dotpath")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import adapter {dotpath!r}: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, GenerativeModelAdapter)):
        raise ValueError(f"{dotpath!r} is not a GenerativeModelAdapter subclass")
    return cls
