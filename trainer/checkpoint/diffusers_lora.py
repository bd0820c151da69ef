"""The diffusers LoRA format, written beside the PEFT adapter of ``export --form adapter``.

``pipe.load_lora_weights(OUT)`` (and ``transformer.load_lora_adapter(OUT, prefix=...)``) read
``OUT/pytorch_lora_weights.safetensors``:

* tensor names ``<component>.<module>.lora_A.weight`` / ``lora_B``, where ``<component>`` is
  the pipeline's ``transformer_name`` (``transformer`` for the Qwen-Image, SD3 and FLUX
  pipelines). diffusers keeps only the names under the prefix, so a PEFT-named file
  (``base_model.model.``) loads nothing and only logs a warning.
* header entry ``lora_adapter_metadata``: the JSON of the LoraConfig, each key prefixed
  ``<component>.``. diffusers builds its LoraConfig from it; without it, the rank is inferred
  from the shapes and alpha defaults to the rank, which rescales the adapter (alpha = 2r loads
  at half strength).

The file is written by hand with diffusers' own constants rather than through a pipeline's
``save_lora_weights``: a transformer-only base has no pipeline class to call, and the format
does not depend on one.
"""
from __future__ import annotations

import json
from pathlib import Path

import diffusers
import torch
from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY, LORA_WEIGHT_NAME_SAFE
from safetensors.torch import save_file

DEFAULT_COMPONENT = "transformer"


def component_name(base: Path | None) -> str:
    """The key prefix the base's pipeline expects: its ``transformer_name`` when the base is a
    pipeline directory (``model_index.json`` beside ``transformer/``), else ``transformer``."""
    if base is None:
        return DEFAULT_COMPONENT
    base = Path(base)
    for root in (base, base.parent):
        index = root / "model_index.json"
        if index.is_file():
            cls = getattr(diffusers, json.loads(index.read_text()).get("_class_name", ""), None)
            return getattr(cls, "transformer_name", None) or DEFAULT_COMPONENT
    return DEFAULT_COMPONENT


def adapter_metadata(lora_config, component: str) -> dict[str, str]:
    """The safetensors header entry diffusers reads the LoraConfig back from."""
    config = {}
    for key, value in lora_config.to_dict().items():
        if isinstance(value, set):  # target_modules: JSON has no sets
            value = sorted(value)
        config[f"{component}.{key}"] = value
    return {"format": "pt",
            LORA_ADAPTER_METADATA_KEY: json.dumps(config, indent=2, sort_keys=True, default=str)}


def lora_state(pairs: dict[str, dict[str, torch.Tensor]], component: str,
               dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """{plain module: {"A", "B"}} -> the diffusers tensor names."""
    out = {}
    for mod, pair in pairs.items():
        for kind, t in pair.items():
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            out[f"{component}.{mod}.lora_{kind}.weight"] = t.contiguous()
    return out


def write_diffusers_lora(dest: Path, pairs: dict[str, dict[str, torch.Tensor]], lora_config,
                         base: Path | None, dtype: torch.dtype | None) -> Path:
    component = component_name(base)
    path = Path(dest) / LORA_WEIGHT_NAME_SAFE
    save_file(lora_state(pairs, component, dtype), str(path),
              metadata=adapter_metadata(lora_config, component))
    return path


def verify_diffusers_lora(out: Path, base: Path, model_cls: type, contract: dict,
                          pairs: dict[str, dict[str, torch.Tensor]],
                          dtype: torch.dtype | None) -> list[str]:
    """Load OUT the way diffusers users do (``load_lora_adapter`` on the base transformer) and
    compare rank, alpha and every LoRA tensor with the checkpoint's."""
    model = model_cls.from_pretrained(str(base))
    try:
        model.load_lora_adapter(str(out), weight_name=LORA_WEIGHT_NAME_SAFE,
                                prefix=component_name(base), adapter_name="export")
    except Exception as exc:  # any loader failure is the finding
        return [f"diffusers cannot load the LoRA in {out}: {type(exc).__name__}: {exc}"]
    problems = []
    config = getattr(model, "peft_config", {}).get("export")
    if config is None:
        return [f"diffusers loaded no LoRA from {out}"]
    if config.r != contract["rank"] or float(config.lora_alpha) != float(contract["alpha"]):
        problems.append(f"diffusers read r={config.r} alpha={config.lora_alpha}, checkpoint "
                        f"r={contract['rank']} alpha={contract['alpha']}")
    loaded = {n.replace(".export.weight", ".weight"): p.detach()
              for n, p in model.named_parameters() if ".lora_" in n}
    want = lora_state(pairs, "", dtype)
    want = {k[1:]: v for k, v in want.items()}  # drop the empty component's dot
    if set(loaded) != set(want):
        problems.append(f"diffusers loaded {len(loaded)} LoRA tensors, the checkpoint has "
                        f"{len(want)}: e.g. {sorted(set(loaded) ^ set(want))[:3]}")
    for k in sorted(set(loaded) & set(want)):
        if not torch.equal(loaded[k], want[k].to(loaded[k].dtype)):
            problems.append(f"diffusers-loaded {k} differs from the checkpoint's")
    return problems
