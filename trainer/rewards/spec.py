"""Reward configuration: the scorers of ``[reward.scorers.NAME]`` tables (and the older
single-scorer keys) resolved into one list, their weights, and the checks of both.

    [reward.scorers.pickscore]          # NAME: a built-in (BUILTIN_SCORERS) or any name with
    weight = 1.0                        #   path = "package.module.Class"
    model_path = "/models/PickScore_v1"
    [reward.scorers.ocr]
    weight = 0.5
    required = true                     # a group missing this scorer's value is not trained on
    [reward.scorers.mine]
    path = "mypkg.rewards.MyScorer"
    threshold = 0.3                     # every other key goes to the scorer's constructor

Reserved keys: ``path``, ``weight`` (default 1.0; applies to each component the scorer
produces), ``model_path``, ``required``, ``options``, and for video batches
``frame_aggregation`` (how an image scorer's per-frame values become one per video: ``mean``
(the default), ``min``, or ``sampled`` with ``frames = K``: the mean over K evenly spread
frames, always the same ones; ``trainer.rewards.video``). ``[reward.scorers.NAME.options]``
passes its keys to the constructor verbatim, reserved names included: CLIPScore's own
``weight`` (its 2.5 rescale) is ``options = { weight = 100 }``. A reserved key set in the
table whose name the constructor also takes, with no ``options`` entry for it, is an error
(it used to become the mixing weight without a word). The old keys (``scorer_path``, ``model_path``,
``component_weights``, ``custom_reward_path``) keep working: without a ``scorers`` table,
``scorer_path`` is the one scorer; ``custom_reward_path`` runs beside either;
``component_weights`` still weighs components by name (a component weighed there and by its
scorer's ``weight`` is an error, not a silent override).

Checks come in two stages. ``static_problems`` is torch-free (preflight's static rules run it):
shapes, names, numbers, paths. ``import_problems`` imports every dotpath (scorers, custom
reward, a scorer's own dotpath options through its ``check_options`` hook) and checks every
option against the constructor's signature, without loading weights: a typo fails before the
run starts, in one line naming the table and the key.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.config import RewardConfig

BUILTIN_SCORERS: dict[str, str] = {
    "pickscore": "trainer.rewards.pickscore.PickScoreScorer",
    "hps": "trainer.rewards.hps.HPSv2Scorer",
    "aesthetic": "trainer.rewards.aesthetic.AestheticScorer",
    "clipscore": "trainer.rewards.clipscore.CLIPScoreScorer",
    "jpeg_compressibility": "trainer.rewards.jpeg.JpegCompressibilityScorer",
    "jpeg_incompressibility": "trainer.rewards.jpeg.JpegIncompressibilityScorer",
    "ocr": "trainer.rewards.ocr.OCRScorer",
    "imagereward": "trainer.rewards.imagereward.ImageRewardScorer",
    "vlm_judge": "trainer.rewards.vlm_judge.VLMJudgeScorer",
    "geneval": "trainer.rewards.geneval.GenEvalScorer",
    "geneval_server": "trainer.rewards.flowgrpo_server.GenEvalServerScorer",
    "deqa": "trainer.rewards.flowgrpo_server.DeQAServerScorer",
    "unifiedreward_server": "trainer.rewards.flowgrpo_server.UnifiedRewardServerScorer",
    "toy": "trainer.toy.reward.ToyCompositionScorer",
    "image_similarity": "trainer.rewards.edit.ImageSimilarityScorer",
    "clip_image_similarity": "trainer.rewards.edit.CLIPImageSimilarityScorer",
    "red_to_blue": "trainer.rewards.edit.RedToBlueScorer",
    "temporal_consistency": "trainer.rewards.video.TemporalConsistencyScorer",
}
RESERVED_KEYS = ("path", "weight", "model_path", "required", "options", "frame_aggregation",
                 "frames")
FRAME_AGGREGATIONS = ("mean", "min", "sampled")
# reserved keys a constructor may also take: set at the top level they mean the reserved thing,
# so a constructor option of the same name must come through the ``options`` sub-table
_ROLES = {"path": "scorer's dotpath", "weight": "mixing weight", "required": "required flag"}
_SHADOWING = tuple(_ROLES)
_DOTPATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
_IDENT = re.compile(r"^[A-Za-z_]\w*$")


@dataclass(frozen=True)
class ScorerSpec:
    """One configured scorer. ``weight`` None: a legacy scorer, weighed by component_weights."""
    name: str
    path: str
    weight: float | None = None
    model_path: str | None = None
    required: bool = False
    options: dict = field(default_factory=dict)
    reserved_set: tuple[str, ...] = ()  # _SHADOWING keys the table sets at its top level
    frame_aggregation: str | None = None  # None: the video default, "mean"
    frames: int | None = None  # how many frames ``sampled`` scores

    @property
    def where(self) -> str:
        return f"reward.scorers.{self.name}" if self.weight is not None else "reward.scorer_path"


def _default_scorer_path() -> str | None:
    return next(f.default for f in dataclasses.fields(RewardConfig) if f.name == "scorer_path")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _table_spec(name: str, table: Any, problems: list[str]) -> ScorerSpec | None:
    where = f"reward.scorers.{name}"
    if not isinstance(table, dict):
        problems.append(f"{where} must be a table of options, got {table!r}")
        return None
    path = table.get("path", BUILTIN_SCORERS.get(name))
    if path is None:
        problems.append(f"{where}: {name!r} is not a built-in scorer "
                        f"({', '.join(BUILTIN_SCORERS)}); add path = \"package.module.Class\"")
    elif not isinstance(path, str) or not _DOTPATH.match(path):
        problems.append(f"{where}.path={path!r} is not a dotpath package.module.Class")
    weight = table.get("weight", 1.0)
    if not _is_number(weight):
        problems.append(f"{where}.weight={weight!r} must be a finite number")
    model_path = table.get("model_path")
    if model_path is not None and not isinstance(model_path, str):
        problems.append(f"{where}.model_path={model_path!r} must be a string")
    required = table.get("required", False)
    if not isinstance(required, bool):
        problems.append(f"{where}.required={required!r} must be true or false")
    options = {k: v for k, v in table.items() if k not in RESERVED_KEYS}
    verbatim = table.get("options", {})
    if not isinstance(verbatim, dict):
        problems.append(f"{where}.options must be a table of constructor options, "
                        f"got {verbatim!r}")
        verbatim = {}
    twice = sorted(set(options) & set(verbatim))
    if twice:
        problems.append(f"{where}: options {twice} are given both in the table and in "
                        f"{where}.options; keep one")
    if "model_path" in verbatim:
        problems.append(f"{where}.options.model_path: give model_path in {where} itself")
    options.update(verbatim)
    bad = [k for k in options if not _IDENT.match(str(k))]
    if bad:
        problems.append(f"{where}: option names {bad} are not identifiers")
    aggregation, frames = table.get("frame_aggregation"), table.get("frames")
    problems += frame_problems(where, aggregation, frames)
    return ScorerSpec(name, path or "", float(weight) if _is_number(weight) else 1.0,
                      model_path, bool(required), options,
                      tuple(k for k in _SHADOWING if k in table), aggregation, frames)


def frame_problems(where: str, aggregation: Any, frames: Any) -> list[str]:
    """What is wrong with a scorer's ``frame_aggregation`` / ``frames`` pair (torch-free)."""
    if aggregation is not None and aggregation not in FRAME_AGGREGATIONS:
        return [f"{where}.frame_aggregation={aggregation!r} is not one of "
                f"{list(FRAME_AGGREGATIONS)}"]
    if aggregation == "sampled":
        if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1:
            return [f"{where}.frames={frames!r}: frame_aggregation = \"sampled\" needs "
                    f"frames = K, a whole number >= 1 of evenly spread frames to score"]
    elif frames is not None:
        return [f"{where}.frames={frames!r} applies to frame_aggregation = \"sampled\" only "
                f"(frame_aggregation is {aggregation or 'mean, the default'!r})"]
    return []


def shadowing_problems(spec: ScorerSpec, cls: type) -> list[str]:
    """A reserved key set in the table that the constructor also takes, with no
    ``options`` entry saying what the constructor gets: the user may have meant either."""
    params = inspect.signature(cls).parameters
    clash = [k for k in spec.reserved_set if k in params and k not in spec.options]
    return [f"{spec.where}.{k} is read as the table's {_ROLES[k]}, but {spec.path} also takes "
            f"a constructor option {k!r}: say what the constructor gets in {spec.where}.options "
            f"(e.g. options = {{ {k} = ... }}) and keep {k} = ... for the {_ROLES[k]}"
            for k in clash]


def frame_rule_problems(spec: ScorerSpec, cls: type, runtime: str) -> list[str]:
    """A frame rule where none applies: on a scorer that reads whole videos, or on a remote
    scorer (its server aggregates frames, ``trainer.rewards.serve --frame-aggregation``)."""
    if spec.frame_aggregation is None and spec.frames is None:
        return []
    if getattr(cls, "takes_video", False):
        return [f"{spec.where}.frame_aggregation: {spec.path} reads whole videos, so no "
                f"per-frame aggregation applies; drop frame_aggregation / frames"]
    if runtime == "remote":
        return [f"{spec.where}.frame_aggregation: with runtime 'remote' the reward server "
                f"scores the frames; set it there (python -m trainer.rewards.serve "
                f"--frame-aggregation ...)"]
    return []


def scorer_specs(reward) -> tuple[list[ScorerSpec], list[str]]:
    """The configured scorers (torch-free) and every problem found in their tables."""
    problems: list[str] = []
    specs: list[ScorerSpec] = []
    tables = reward.scorers if reward.scorers is not None else {}
    if not isinstance(tables, dict):
        return [], [f"reward.scorers must be a table of [reward.scorers.NAME] tables"]
    for name, table in tables.items():
        spec = _table_spec(str(name), table, problems)
        if spec is not None:
            specs.append(spec)
    legacy = reward.scorer_path
    if tables and legacy and legacy != _default_scorer_path():
        problems.append(f"reward.scorer_path={legacy!r} and [reward.scorers] are both set: move "
                        f"it into a [reward.scorers.NAME] table (path = {legacy!r})")
    if tables and reward.model_path:
        problems.append("reward.model_path belongs to the single-scorer form; with "
                        "[reward.scorers] give model_path inside the scorer's table")
    if not tables and legacy:
        specs.append(ScorerSpec("scorer", legacy, None, reward.model_path))
    return specs, problems


def static_problems(reward, *, check_paths: bool = True) -> list[str]:
    """Torch-free checks of the scorer tables (preflight's static stage)."""
    specs, problems = scorer_specs(reward)
    if check_paths:
        for spec in specs:
            if spec.weight is not None and spec.model_path and not Path(spec.model_path).exists():
                problems.append(f"{spec.where}.model_path={spec.model_path!r} does not exist")
    return problems


# ---- the import stage -------------------------------------------------------------------
def option_problems(cls: type, options: dict[str, Any], model_path: str | None,
                    dotpath: str, model_key: str = "--reward-model-path") -> list[str]:
    """What ``cls(**options, model_path=..., device=...)`` would reject, without calling it."""
    params = inspect.signature(cls).parameters
    accepts_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    problems = []
    if model_path is not None:
        if "model_path" not in params and not accepts_any:
            problems.append(f"{dotpath} takes no model_path but {model_key}={model_path!r}")
    elif "model_path" in params and params["model_path"].default is inspect.Parameter.empty:
        problems.append(f"{dotpath} needs a model path ({model_key})")
    unknown = sorted(k for k in options if k not in params) if not accepts_any else []
    if unknown:
        known = sorted(k for k, p in params.items() if k not in ("device", "model_path")
                       and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
        problems.append(f"{dotpath} has no option(s) {unknown} (its options: {known})")
    missing = sorted(k for k, p in params.items()
                     if p.default is inspect.Parameter.empty and k not in options
                     and k not in ("self", "device", "model_path")
                     and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))
    if missing:
        problems.append(f"{dotpath} needs option(s) {missing}")
    check = getattr(cls, "check_options", None)
    if not problems and callable(check):
        problems += list(check(**options))
    return problems


def scorer_class(dotpath: str) -> type:
    from trainer.rewards.base import load_object  # local: torch (this module is torch-free)
    cls = load_object(dotpath, "reward scorer path")
    if not isinstance(cls, type) or not callable(getattr(cls, "score", None)) or \
            not isinstance(getattr(cls, "components", None), tuple):
        raise ValueError(f"reward scorer path {dotpath!r} is not a scorer class (needs a "
                         "`components` tuple and a `score` method; see RewardScorer)")
    return cls


def resolve_weights(reward, components: dict[str, tuple[str, ...]],
                    specs: list[ScorerSpec]) -> tuple[dict[str, float], list[str], list[str]]:
    """({component: weight}, required components, problems). An empty weight dict means
    "every component weighs 1" (the single-scorer default)."""
    explicit = dict(reward.component_weights or {})
    weights = dict(explicit)
    required = list(reward.required_components or [])
    problems = []
    for spec in specs:
        for comp in components.get(spec.name, ()):
            if spec.weight is not None:
                if comp in explicit:
                    problems.append(f"component {comp!r} is weighed twice: "
                                    f"reward.component_weights and {spec.where}.weight")
                weights[comp] = spec.weight
            if spec.required and comp not in required:
                required.append(comp)
    return weights, required, problems


def unweighed_problem(produced, weights: dict[str, float],
                      owners: dict[str, str] | None = None) -> str | None:
    """With any weight given, every produced component needs one: a component left out would
    silently weigh 0 (a custom reward beside the toy recipe's weights trained on nothing)."""
    missing = [c for c in produced if c not in weights] if weights else []
    if not missing:
        return None
    named = ", ".join(f"{c!r}" + (f" ({owners[c]})" if owners and c in owners else "")
                      for c in missing)
    return (f"components {named} are produced but have no weight, so training would ignore "
            f"them: give each a weight in reward.component_weights (or its scorer table's "
            f"weight); 0 logs a component without training on it")


def _custom_problems(reward, dummy_batch: dict | None
                     ) -> tuple[tuple[str, ...] | None, list[str]]:
    """The custom reward's components, and its problems: import, form, and (``dummy_batch``:
    preflight's height, width and first records) one call on a dummy batch."""
    from trainer.rewards.function import FunctionScorer, dummy_batch_problems  # local: torch
    where = "reward.custom_reward_path"
    if not (isinstance(reward.custom_timeout_s, (int, float)) and reward.custom_timeout_s > 0):
        return None, [f"reward.custom_timeout_s={reward.custom_timeout_s!r} must be > 0"]
    try:
        scorer = FunctionScorer.from_dotpath(reward.custom_reward_path,
                                             timeout_s=reward.custom_timeout_s)
    except ValueError as exc:
        return None, [f"{where}: {exc}"]
    except Exception as exc:  # the user's factory failed (or missed its deadline)
        return None, [f"{where}: building {reward.custom_reward_path} failed: "
                      f"{type(exc).__name__}: {exc}"]
    if dummy_batch is None:
        return scorer.components, []
    return scorer.components, dummy_batch_problems(scorer, **dummy_batch)


def import_problems(reward, *, dummy_batch: dict | None = None) -> list[str]:
    """Import every reward dotpath and check every option (no weights are loaded); with
    ``dummy_batch`` (``dummy_batch_problems``' keywords), call the custom reward once."""
    specs, problems = scorer_specs(reward)
    components: dict[str, tuple[str, ...]] = {}
    for spec in specs:
        try:
            cls = scorer_class(spec.path)
        except ValueError as exc:
            problems.append(f"{spec.where}: {exc}")
            continue
        components[spec.name] = cls.components
        problems += shadowing_problems(spec, cls)
        problems += frame_rule_problems(spec, cls, reward.runtime)
        if reward.runtime == "remote":
            continue  # the remote server builds it; here only its component names count
        model_key = f"{spec.where}.model_path" if spec.weight is not None else \
            "--reward-model-path"
        problems += [f"{spec.where}: {p}" for p in
                     option_problems(cls, spec.options, spec.model_path, spec.path, model_key)]
    if reward.custom_reward_path:
        custom, custom_problems = _custom_problems(reward, dummy_batch)
        problems += custom_problems
        if custom is not None:
            components["custom"] = custom
    weights, required, weight_problems = resolve_weights(reward, components, specs)
    problems += weight_problems
    produced = {c for comps in components.values() for c in comps}
    all_known = len(components) == len(specs) + bool(reward.custom_reward_path)
    if all_known and (specs or reward.runtime != "remote"):  # a bare remote names its own
        unknown = sorted(set(required) - produced)
        if unknown:
            problems.append(f"required components {unknown} are produced by no scorer "
                            f"(produced: {sorted(produced)})")
        unweighed = sorted(set(weights) - produced)
        if unweighed:
            problems.append(f"weights for components {unweighed} that no scorer produces "
                            f"(produced: {sorted(produced)})")
        owners = {c: ("reward.custom_reward_path" if name == "custom" else
                      next(s.where for s in specs if s.name == name))
                  for name, comps in components.items() for c in comps}
        problem = unweighed_problem([c for comps in components.values() for c in comps],
                                    weights, owners)
        if problem:
            problems.append(problem)
    return problems
