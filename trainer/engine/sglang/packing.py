"""The names a native SGLang DiT holds our parameters under, from SGLang's own name mapping.

SGLang's native DiTs pack some projections into one parameter (Qwen-Image's text-stream
``add_q_proj`` / ``add_k_proj`` / ``add_v_proj`` into ``attn.to_added_qkv``) and some rename
ours (Wan's ``blocks.0.attn1.to_q`` is ``blocks.0.to_q``, its ``ffn.net.0.proj`` is
``ffn.fc_in``). The table is the model class's ``lora_param_names_mapping`` then its
``param_names_mapping``, chained as SGLang's weight updater chains them: a rule whose
replacement is a name renames, one whose replacement is ``(target, index, sections)`` packs the
matched tensor as section ``index`` of ``target``. The updater (``update_weights_from_tensor``
and ``_from_disk``) maps a sent name through that chain when the module has no parameter of
that name, and its loader writes a section at its rows (the packed parameter is the sections
concatenated along dim 0 in index order, for one TP rank). Its ``TensorUpdateChecker`` then
looks names up on the live module, so a manifest in our names misses every packed or renamed
tensor: ``ServedLayout`` names what the server holds instead.

The chain is read from the class the adapter names (``sglang_dit`` in
trainer/models/<family>.py) through SGLang's own regex mapper, so the trainer's process needs
``sglang==0.5.23`` importable (it imports no GPU code). It is applied to every sent name, where
SGLang applies it only to a name its module lacks: for the shipped families the two agree (no
rule matches a diffusers name the native module holds; tests/test_sglang_wan.py checks the
chain against the packing-only names of Qwen-Image, SD3 and FLUX.1, and every sync test checks
the served names on the live module). The mapping is the one an unquantized server uses (a
quantized server may pack more, and takes no bf16 sync anyway).
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Iterable

import torch

NameMapper = Callable[[str], tuple[str, Any, Any]]


def packing_mapper(dit_class: str) -> NameMapper:
    """SGLang's name mapping of ``dit_class`` (``module.Class``): (served name, section index,
    sections), the index and count None for a tensor that is not packed."""
    module_name, _, class_name = dit_class.rpartition(".")
    try:
        from sglang.multimodal_gen.runtime.loader.utils import get_param_names_mapping
        cls = getattr(importlib.import_module(module_name), class_name)
        tables = [getattr(cls, "lora_param_names_mapping", None), cls.param_names_mapping]
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot read SGLang's packing table from {dit_class!r} ({exc}): the "
                         "trainer names the server's packed parameters from it; install "
                         "sglang==0.5.23 next to the trainer (tests/requirements-sglang.txt, "
                         "then pip install --no-deps sglang==0.5.23)") from None
    mappers = [get_param_names_mapping(table) for table in tables if table]

    def chained(name: str) -> tuple[str, Any, Any]:
        index = sections = None
        for mapper in mappers:  # as SGLang's updater chains them: the last packing rule wins
            name, i, n = mapper(name)
            if i is not None:
                index, sections = i, n
        return name, index, sections

    return chained


class ServedLayout:
    """Where each sent tensor lands on the server. ``dit_class`` None: names are kept."""

    def __init__(self, dit_class: str | None) -> None:
        self.dit_class = dit_class
        self._mapper = None if dit_class is None else packing_mapper(dit_class)

    def place(self, name: str) -> tuple[str, int | None, int | None]:
        """(served name, section index, sections) of the tensor sent as ``name``; the index
        and count are None for a tensor served under its own name."""
        if self._mapper is None:
            return name, None, None
        served, index, sections = self._mapper(name)
        if not served:
            raise ValueError(f"{name!r}: SGLang's name mapping of {self.dit_class} drops it "
                             "(the server would not take it)")
        if index is None:
            return served, None, None
        return served, int(index), int(sections)

    def packer(self) -> "Packer":
        return Packer(self)


class Packer:
    """Collects sent tensors and yields (served name, served tensor) as each becomes whole."""

    def __init__(self, layout: ServedLayout) -> None:
        self.layout = layout
        self.pending: dict[str, dict[int, torch.Tensor]] = {}
        self.sections: dict[str, int] = {}

    def add(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        served, index, sections = self.layout.place(name)
        if index is None:
            yield served, tensor
            return
        parts = self.pending.setdefault(served, {})
        self.sections[served] = sections
        if index in parts:
            raise ValueError(f"{name!r}: section {index} of {served!r} sent twice")
        parts[index] = tensor
        if len(parts) == sections:
            del self.pending[served]
            yield served, torch.cat([parts[i] for i in range(sections)], dim=0)

    def missing(self) -> list[str]:
        """Packed parameters some of whose sections were never sent."""
        return [f"{served} (sections {sorted(parts)} of {self.sections[served]})"
                for served, parts in sorted(self.pending.items())]


def packed_lora_groups(layout: ServedLayout, layers: Iterable[str]
                       ) -> dict[str, list[tuple[int | None, str]]]:
    """served layer -> [(section index or None, sent layer)], for LoRA layers named as sent."""
    groups: dict[str, list[tuple[int | None, str]]] = {}
    for layer in layers:
        served, index, _ = layout.place(f"{layer}.weight")
        groups.setdefault(served.removesuffix(".weight"), []).append((index, layer))
    for members in groups.values():
        members.sort(key=lambda m: -1 if m[0] is None else m[0])
    return groups
