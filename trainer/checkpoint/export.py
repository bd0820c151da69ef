"""``python -m trainer export``: a committed checkpoint -> files other tools load.

    python -m trainer export --save-dir RUN/checkpoints --output-dir OUT --form merged \\
        --base-model-path MODEL_DIR [--iteration N] [--task t2i] [--dtype keep] [--verify]

Forms:
* ``merged`` (LoRA checkpoints): every adapter folded into its base weight,
  W + (alpha / r) * B @ A in fp32, cast back to the base's dtype. Streams the base's
  safetensors shard by shard (memory: one shard) and keeps its file layout and config, so
  The base is --base-model-path, else the model path recorded in the checkpoint. When the
  base is a pipeline folder (``model_index.json``), OUT is a complete pipeline folder: the
  merged transformer in ``OUT/transformer`` and the base's other parts (VAE, text encoders,
  tokenizers, scheduler, ``model_index.json``) beside it, so
  ``DiffusionPipeline.from_pretrained(OUT)`` loads it; the parts are hard links to the base's
  files where the file system allows (they are unchanged, and a text encoder can be many GB),
  else copies. For a transformer-only base, OUT is a transformer folder
  (``<_class_name>.from_pretrained(OUT)``).
* ``adapter`` (LoRA checkpoints): a PEFT adapter directory (adapter_config.json +
  adapter_model.safetensors) for ``PeftModel.from_pretrained(base, OUT)``, and beside it
  diffusers' ``pytorch_lora_weights.safetensors`` for ``pipe.load_lora_weights(OUT)``
  (trainer/checkpoint/diffusers_lora.py).
* ``full`` (full checkpoints, the default for them): the trained transformer through
  diffusers' ``save_pretrained`` (safetensors), configured from the base model's config.json
  (--base-model-path, else the model path recorded in the checkpoint).

``--verify`` reloads what was written and compares it with the checkpoint: a merged export
against peft's own ``merge_and_unload`` of the base plus the checkpoint's adapter (an
independent path to the same weights), also checking it holds no lora_A/lora_B tensor and
exactly the base's tensor names; an adapter export by loading it with peft onto the base; a
full export tensor for tensor.

Design choices:
* The transformer class always comes from ``_class_name`` in the base's config.json
  (``<base>/transformer/config.json`` for a pipeline directory): no per-family code.
* A full export is a transformer directory; the other pipeline parts are unchanged, so
  ``Pipeline.from_pretrained(base, transformer=Cls.from_pretrained(OUT))``.
* Merged and full exports carry a model card, ``OUT/README.md`` (base model, recipe, LoRA
  rank, the last eval: trainer/checkpoint/model_card.py), and the run's resolved config as
  ``OUT/training_config.toml``, found beside the checkpoint or given with ``--run-dir``.
* A merged export refuses a base whose content hash differs from the one the adapter was
  trained on (it would fold the adapter into the wrong weights).
* OUT is written into a hidden sibling directory and renamed into place at the end, so an
  interrupted export never leaves a plausible-looking partial OUT.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import diffusers
import torch
import torch.distributed.checkpoint as dcp
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from trainer.checkpoint import layout
from trainer.checkpoint.contract import base_hash_matches, lora_scaling
from trainer.checkpoint.diffusers_lora import verify_diffusers_lora, write_diffusers_lora
from trainer.checkpoint.model_card import TRAINING_CONFIG, find_run_dir, model_card
from trainer.utils.dtypes import TORCH_DTYPES
from trainer.ema import ema_model_tensors

FORMS = ("merged", "adapter", "full")
DTYPES = {"keep": None, **TORCH_DTYPES}  # "keep": the dtype the checkpoint holds
_PEFT_PREFIX = "base_model.model."
_LORA_KEY = re.compile(r"^(?P<mod>.+)\.lora_(?P<kind>[AB])\.(?P<adapter>[^.]+)\.weight$")


class ExportError(ValueError):
    """The export cannot start; lists every problem at once."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("cannot export:\n  - " + "\n  - ".join(self.problems))


class VerifyError(RuntimeError):
    def __init__(self, out: Path, problems: list[str]):
        self.problems = list(problems)
        super().__init__(f"verification of {out} failed:\n  - " + "\n  - ".join(self.problems))


# ---- the base transformer -------------------------------------------------------------------
def transformer_dir(path: str | Path) -> Path:
    """``<path>/transformer`` or ``path`` itself: the first holding a diffusers config.json."""
    p = Path(path)
    for cand in (p / "transformer", p):
        cfg = cand / "config.json"
        if cfg.is_file() and "_class_name" in json.loads(cfg.read_text()):
            return cand
    raise ValueError(f"{p} holds no diffusers transformer (no config.json with _class_name in "
                     f"{p / 'transformer'} or {p})")


def pipeline_root(tdir: Path | None) -> Path | None:
    """The pipeline folder a transformer folder sits in (``<root>/transformer`` beside
    ``<root>/model_index.json``), else None."""
    if tdir is None or Path(tdir).name != "transformer":
        return None
    root = Path(tdir).parent
    return root if (root / "model_index.json").is_file() else None


def _link_or_copy(src: str, dst: str) -> str:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links not allowed: a copy
        shutil.copy2(src, dst)
    return dst


def copy_pipeline_parts(root: Path, dest: Path) -> None:
    """Every part of the pipeline at ``root`` but its transformer (and its own README, the
    base's model card) into ``dest``."""
    for entry in sorted(root.iterdir()):
        if entry.name in ("transformer", "README.md") or entry.name.startswith("."):
            continue
        if entry.is_dir():
            shutil.copytree(entry, dest / entry.name, copy_function=_link_or_copy)
        else:
            _link_or_copy(str(entry), str(dest / entry.name))


def transformer_class(tdir: Path) -> type:
    name = json.loads((Path(tdir) / "config.json").read_text())["_class_name"]
    cls = getattr(diffusers, name, None)
    if not isinstance(cls, type) or not issubclass(cls, diffusers.ModelMixin):
        raise ValueError(f"{tdir}/config.json names {name!r}, which is not a diffusers model "
                         f"class in diffusers {diffusers.__version__}")
    return cls


def _weight_files(tdir: Path) -> list[Path]:
    return sorted(Path(tdir).glob("*.safetensors"))


# ---- the checkpoint -------------------------------------------------------------------------
def read_model_tensors(iter_dir: Path) -> dict[str, torch.Tensor]:
    """The model part of a DCP checkpoint as full tensors, in one process, without building
    the model: the template comes from the checkpoint's own metadata."""
    fsdp = Path(iter_dir) / layout.FSDP_DIR
    meta = dcp.FileSystemReader(str(fsdp)).read_metadata().state_dict_metadata
    template = {k[len("model."):]: torch.empty(tuple(v.size), dtype=v.properties.dtype)
                for k, v in meta.items()
                if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
        dcp.load({"model": template}, checkpoint_id=str(fsdp), no_dist=True)
    return template


def lora_pairs(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, dict[str, torch.Tensor]],
                                                         list[str]]:
    """{plain module name: {"A": A, "B": B}} and the problems found (unpaired or foreign
    tensors)."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    problems = []
    for key, t in tensors.items():
        plain = key[len(_PEFT_PREFIX):] if key.startswith(_PEFT_PREFIX) else key
        m = _LORA_KEY.match(plain)
        if m is None:
            problems.append(f"{key} is not a LoRA A/B weight (unsupported in a LoRA export)")
            continue
        pairs.setdefault(m["mod"], {})[m["kind"]] = t
    for mod, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            problems.append(f"LoRA module {mod} has only lora_{''.join(pair)}")
        elif pair["A"].dim() != 2 or pair["B"].dim() != 2:
            problems.append(f"LoRA module {mod} is not a linear layer (A {tuple(pair['A'].shape)}"
                            f", B {tuple(pair['B'].shape)}); only linear LoRA can be merged")
    return pairs, problems


# ---- planning: every problem at once --------------------------------------------------------
@dataclass
class ExportPlan:
    iter_dir: Path
    contract: dict
    state: dict
    form: str
    out: Path
    base: Path | None          # transformer directory of the base, when one is used
    dtype: torch.dtype | None
    verify: bool
    overwrite: bool


def plan_export(save_dir: str | Path, output_dir: str | Path, *, form: str | None = None,
                task: str = "t2i", iteration: int | None = None,
                base_model_path: str | Path | None = None, dtype: str = "keep",
                verify: bool = False, overwrite: bool = False) -> ExportPlan:
    problems = []
    try:
        iter_dir = layout.resolve_checkpoint(save_dir, task, iteration)
        contract = layout.read_json(iter_dir / layout.ADAPTER_CONTRACT)
        state = layout.read_json(iter_dir / layout.TRAINER_STATE)
    except (layout.CheckpointError, OSError, ValueError) as exc:
        raise ExportError([str(exc)]) from None
    lora = contract["mode"] == "lora"
    if form is None:
        form = "full" if not lora else None
        if lora:
            problems.append("a LoRA checkpoint needs --form merged (fold into the base) or "
                            "--form adapter (a PEFT adapter directory)")
    elif form not in FORMS:
        problems.append(f"--form {form!r}: choose one of {FORMS}")
    elif lora and form == "full":
        problems.append("--form full needs a full checkpoint; this one holds only a LoRA "
                        "adapter: use --form merged or --form adapter")
    elif not lora and form in ("merged", "adapter"):
        problems.append(f"--form {form} needs a LoRA checkpoint; this one is a full checkpoint: "
                        "use --form full")
    if dtype not in DTYPES:
        problems.append(f"--dtype {dtype!r}: choose one of {list(DTYPES)}")

    base = None
    candidate = base_model_path if base_model_path is not None else state.get("model_path")
    if form == "merged" and candidate is None:
        problems.append("--form merged needs --base-model-path: the adapter is folded into the "
                        "base weights, and without them the export would be made of "
                        "lora_A/lora_B tensors only")
    # an adapter export only names its base (and picks the diffusers key prefix from it)
    base_optional = base_model_path is None and form == "adapter" and not verify
    if candidate is not None and form in FORMS:
        try:
            base = transformer_dir(candidate)
        except (ValueError, OSError) as exc:
            why = "" if base_model_path else " (the model path recorded in the checkpoint; " \
                                             "pass --base-model-path)"
            if not base_optional:
                problems.append(f"base model: {exc}{why}")
    if base is not None and form == "merged":
        if not _weight_files(base):
            problems.append(f"base model {base} has no *.safetensors weights to merge into")
        if lora and not base_hash_matches(base, contract.get("revision"),
                                          contract["base_model_hash"]):
            problems.append(f"base model {base} is not the one the adapter was trained on "
                            f"(content hash differs from the checkpoint's; trained on "
                            f"{contract.get('base_model_path')})")
    out = Path(output_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        problems.append(f"--output-dir {out} exists and is not empty (pass --overwrite to "
                        "replace it)")
    if problems:
        raise ExportError(problems)
    return ExportPlan(iter_dir, contract, state, form, out, base, DTYPES[dtype], verify,
                      overwrite)


# ---- writers --------------------------------------------------------------------------------
def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def write_merged(plan: ExportPlan, tensors: dict[str, torch.Tensor], dest: Path) -> None:
    root = pipeline_root(plan.base)
    if root is not None:
        copy_pipeline_parts(root, dest)
        dest = dest / "transformer"
        dest.mkdir()
    pairs, problems = lora_pairs(tensors)
    scaling = lora_scaling(plan.contract)
    files = _weight_files(plan.base)
    shapes = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            shapes.update({k: tuple(h.get_slice(k).get_shape()) for k in h.keys()})
    for mod, pair in pairs.items():
        shape = shapes.get(f"{mod}.weight")
        if shape is None:
            problems.append(f"LoRA module {mod} has no base tensor {mod}.weight")
        elif "A" in pair and "B" in pair and shape != (pair["B"].shape[0], pair["A"].shape[1]):
            problems.append(f"{mod}.weight is {shape} but B @ A is "
                            f"{(pair['B'].shape[0], pair['A'].shape[1])}")
    if problems:
        raise ExportError(problems)
    total = 0
    for f in files:
        merged = {}
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                t = h.get_tensor(k)
                pair = pairs.get(k[:-len(".weight")]) if k.endswith(".weight") else None
                if pair is not None:
                    delta = pair["B"].float() @ pair["A"].float()
                    t = (t.float() + scaling * delta).to(t.dtype)
                merged[k] = _cast(t, plan.dtype).contiguous()
                total += merged[k].numel() * merged[k].element_size()
        save_file(merged, str(dest / f.name), metadata={"format": "pt"})
    shutil.copy2(plan.base / "config.json", dest / "config.json")
    for index in plan.base.glob("*.safetensors.index.json"):
        data = json.loads(index.read_text())
        data.setdefault("metadata", {})["total_size"] = total
        (dest / index.name).write_text(json.dumps(data, indent=2))


def _adapter_state(tensors: dict[str, torch.Tensor], dtype) -> dict[str, torch.Tensor]:
    """PEFT's on-disk names: the adapter name is not part of them."""
    pairs, problems = lora_pairs(tensors)
    if problems:
        raise ExportError(problems)
    return {f"{_PEFT_PREFIX}{mod}.lora_{kind}.weight": _cast(t, dtype).contiguous()
            for mod, pair in pairs.items() for kind, t in pair.items()}


def _lora_config(contract: dict, base_name: str | None):
    return LoraConfig(r=int(contract["rank"]), lora_alpha=contract["alpha"],
                      lora_dropout=float(contract["dropout"]),
                      target_modules=list(contract["target_modules"]),
                      base_model_name_or_path=base_name, inference_mode=True)


def write_adapter(plan: ExportPlan, tensors: dict[str, torch.Tensor], dest: Path) -> None:
    state = _adapter_state(tensors, plan.dtype)
    base_name = str(plan.base) if plan.base is not None else plan.contract.get("base_model_path")
    config = _lora_config(plan.contract, base_name)
    config.save_pretrained(str(dest))
    save_file(state, str(dest / "adapter_model.safetensors"), metadata={"format": "pt"})
    write_diffusers_lora(dest, lora_pairs(tensors)[0], config, plan.base, plan.dtype)


def write_full(plan: ExportPlan, tensors: dict[str, torch.Tensor], dest: Path) -> None:
    cls = transformer_class(plan.base)
    with torch.device("meta"):  # no random init of weights that are replaced right away
        model = cls.from_config(cls.load_config(str(plan.base)))
    expected = set(model.state_dict())
    missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or extra:
        raise ExportError([f"checkpoint does not match {cls.__name__} from {plan.base}: "
                           f"missing {missing[:5]}, unexpected {extra[:5]}"])
    model.load_state_dict({k: _cast(t, plan.dtype) for k, t in tensors.items()},
                          strict=True, assign=True)
    model.save_pretrained(str(dest), safe_serialization=True)


WRITERS = {"merged": write_merged, "adapter": write_adapter, "full": write_full}


# ---- verification ---------------------------------------------------------------------------
def _compare(name: str, got: torch.Tensor, want: torch.Tensor, problems: list[str], *,
             exact: bool) -> None:
    want = want.to(got.dtype)
    if got.shape != want.shape:
        problems.append(f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    elif exact and not torch.equal(got, want):
        problems.append(f"{name}: differs (max |diff| "
                        f"{(got.float() - want.float()).abs().max().item():.3g})")
    elif not exact:
        try:  # the default tolerances of got's dtype: the export is a cast of fp32 math
            torch.testing.assert_close(got, want)
        except AssertionError as exc:
            problems.append(f"{name}: {str(exc).splitlines()[0]} "
                            f"(max |diff| {(got.float() - want.float()).abs().max().item():.3g})")


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in _weight_files(directory):
        out.update(load_file(str(f)))
    return out


def _diffusers_reload_problems(out: Path, written: dict[str, torch.Tensor]) -> list[str]:
    """``from_pretrained`` must load OUT and hold exactly what was written (diffusers only
    warns about names it does not know, so the names are checked here)."""
    try:
        loaded = transformer_class(out).from_pretrained(str(out)).state_dict()
    except Exception as exc:  # any loader failure is the finding
        return [f"diffusers cannot load {out}: {type(exc).__name__}: {exc}"]
    problems = []
    unknown = sorted(set(written) - set(loaded))
    if unknown:
        problems.append(f"{len(unknown)} written tensors are unknown to the model class, e.g. "
                        f"{unknown[:3]}")
    for k in sorted(set(written) & set(loaded)):
        _compare(f"reloaded {k}", loaded[k], written[k], problems, exact=True)
    return problems


def verify_export(plan: ExportPlan, tensors: dict[str, torch.Tensor], out: Path) -> list[str]:
    """Every way the export at ``out`` disagrees with the checkpoint (empty: it agrees)."""
    problems: list[str] = []
    if plan.form == "adapter":
        base = transformer_class(plan.base).from_pretrained(str(plan.base))
        model = PeftModel.from_pretrained(base, str(out))
        pcfg = model.peft_config["default"]
        if pcfg.r != plan.contract["rank"] or float(pcfg.lora_alpha) != plan.contract["alpha"]:
            problems.append(f"adapter config r={pcfg.r} alpha={pcfg.lora_alpha}, checkpoint "
                            f"r={plan.contract['rank']} alpha={plan.contract['alpha']}")
        want = _adapter_state(tensors, plan.dtype)
        got = {re.sub(r"\.default\.weight$", ".weight", n): p.detach()
               for n, p in model.named_parameters() if "lora_" in n}
        if set(got) != set(want):
            problems.append(f"peft loaded {len(got)} LoRA tensors, the checkpoint has "
                            f"{len(want)}: e.g. {sorted(set(got) ^ set(want))[:3]}")
        for k in sorted(set(got) & set(want)):
            _compare(k, got[k], want[k], problems, exact=True)
        return problems + verify_diffusers_lora(out, plan.base, transformer_class(plan.base),
                                                plan.contract, lora_pairs(tensors)[0], plan.dtype)

    out = transformer_dir(out)  # OUT/transformer for a pipeline export
    written = _read_weights(out)
    problems += _diffusers_reload_problems(out, written)
    if plan.form == "full":
        want = {k: _cast(t, plan.dtype) for k, t in tensors.items()}
        if set(written) != set(want):
            problems.append(f"export has {len(written)} tensors, checkpoint {len(want)}: e.g. "
                            f"{sorted(set(written) ^ set(want))[:3]}")
        for k in sorted(set(written) & set(want)):
            _compare(k, written[k], want[k], problems, exact=True)
        return problems

    lora_names = sorted(k for k in written if "lora_A" in k or "lora_B" in k)
    if lora_names:
        problems.append(f"merged export holds {len(lora_names)} lora_A/lora_B tensors, e.g. "
                        f"{lora_names[:3]}")
    base_names = set()
    for f in _weight_files(plan.base):
        with safe_open(str(f), framework="pt") as h:
            base_names.update(h.keys())
    if set(written) != base_names:
        problems.append(f"merged export names differ from the base's: e.g. "
                        f"{sorted(set(written) ^ base_names)[:3]}")
    cls = transformer_class(plan.base)
    oracle = get_peft_model(cls.from_pretrained(str(plan.base), torch_dtype=torch.float32),
                            _lora_config(plan.contract, None))
    result = set_peft_model_state_dict(oracle, _adapter_state(tensors, None))
    if getattr(result, "unexpected_keys", None):
        problems.append(f"peft did not place adapter tensors {result.unexpected_keys[:3]}")
    want = oracle.merge_and_unload().state_dict()
    for k in sorted(set(written) & set(want)):
        _compare(k, written[k], _cast(want[k], plan.dtype), problems, exact=False)
    return problems


# ---- driver ---------------------------------------------------------------------------------
def write_card(plan: ExportPlan, dest: Path, run_dir: str | Path | None) -> None:
    """``README.md`` (the model card) and the run's ``training_config.toml`` into ``dest``."""
    run = Path(run_dir) if run_dir is not None else find_run_dir(plan.iter_dir)
    if run is not None and (run / "config.toml").is_file():
        shutil.copy2(run / "config.toml", dest / TRAINING_CONFIG)
    (dest / "README.md").write_text(model_card(
        form=plan.form, contract=plan.contract, state=plan.state, run_dir=run,
        pipeline=(dest / "model_index.json").is_file()))


def export_checkpoint(save_dir: str | Path, output_dir: str | Path, *, ema: bool = False,
                      run_dir: str | Path | None = None, **options) -> Path:
    """Export one committed checkpoint (keyword options as ``plan_export``); returns OUT.
    ``ema``: the EMA weights instead of the live ones (trainer.ema). ``run_dir``: the run
    whose config and metrics the model card reads (default: found beside the checkpoint).
    Raises ExportError before writing anything, VerifyError after a failed --verify."""
    plan = plan_export(save_dir, output_dir, **options)
    tensors = read_model_tensors(plan.iter_dir)
    if ema:
        try:
            tensors = ema_model_tensors(plan.iter_dir, tensors)
        except (OSError, ValueError) as exc:
            raise ExportError([str(exc)]) from None
    out = plan.out
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    try:
        WRITERS[plan.form](plan, tensors, staging)
        if plan.form in ("merged", "full"):  # an adapter folder keeps PEFT's own README
            write_card(plan, staging, run_dir)
        info = {"source": str(plan.iter_dir), "iteration": plan.state.get("iteration"),
                "form": plan.form, "base": str(plan.base) if plan.base else None,
                "dtype": str(plan.dtype) if plan.dtype else "keep", "contract": plan.contract}
        (staging / "export_info.json").write_text(json.dumps(info, indent=2))
        if out.exists():
            layout.remove_tree(out) if out.is_dir() else out.unlink()
        os.replace(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    if plan.verify:
        problems = verify_export(plan, tensors, out)
        if problems:
            raise VerifyError(out, problems)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer export",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--save-dir", required=True,
                   help="checkpoint root (--save), its task directory, or one iter_* directory")
    p.add_argument("--output-dir", required=True, help="where the export is written")
    p.add_argument("--form", choices=FORMS,
                   help="merged | adapter (LoRA checkpoints); full (default for full ones)")
    p.add_argument("--task", default="t2i", help="task subdirectory (default t2i)")
    p.add_argument("--iteration", type=int, help="iteration to export (default: newest "
                   "committed)")
    p.add_argument("--base-model-path", help="base model directory (pipeline or transformer; "
                   "default: the model path recorded in the checkpoint)")
    p.add_argument("--dtype", default="keep", choices=list(DTYPES),
                   help="cast floating tensors (default: keep the stored dtypes)")
    p.add_argument("--verify", action="store_true", help="reload the export and compare it "
                   "with the checkpoint numerically")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --output-dir")
    p.add_argument("--ema", action="store_true", help="export the EMA weights (ema.enabled runs)")
    p.add_argument("--run-dir", help="the run directory whose config.toml and metrics.jsonl "
                   "the model card reads (default: found above the checkpoint)")
    return p


def main(argv: list[str]) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help or a usage error, already printed by argparse
        return int(exc.code or 0)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        out = export_checkpoint(args.save_dir, args.output_dir, form=args.form, task=args.task,
                                iteration=args.iteration, base_model_path=args.base_model_path,
                                dtype=args.dtype, verify=args.verify, overwrite=args.overwrite,
                                ema=args.ema, run_dir=args.run_dir)
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except VerifyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"exported {args.form or 'full'} -> {out} (checkpoint contents matched their COMMITTED "
          f"checksums" + ("; export verified against the checkpoint)" if args.verify else ")"))
    return 0
