"""Preflight rules of the data (prompt files, evaluation, EMA), reliability (engine deadlines
and restarts, resume) and logging sections. Torch-free, like every preflight module."""
from __future__ import annotations

import math
import os
import re
from pathlib import Path

from trainer.data.prompt_files import PromptFileError, cut, overlap_problems, read_numbered
from trainer.evaluation import eval_sampling
from trainer.media import record_media_problems
from trainer.tasks import CONDITIONED_TASKS
from trainer.preflight.checker import Checker, flagged
from trainer.config.sampling import SamplingConfig

EVAL_MODES: tuple[str, ...] = ("sde", "ode")


def check_data(c: Checker) -> None:
    d, s = c.cfg.data, c.cfg.rollout.sampling
    if not d.prompt_data:
        c.error(f"{flagged('data.prompt_data')} is required")
    if d.eval_prompt_data:
        c.at_least("data.n_samples_per_eval_prompt", d.n_samples_per_eval_prompt, 1)
        c.at_least("data.eval_interval", d.eval_interval, 1)
        if d.eval_max_prompts is not None:
            c.at_least("data.eval_max_prompts", d.eval_max_prompts, 1)
        if c.one_of("data.eval_mode", d.eval_mode, EVAL_MODES):
            _, problems = SamplingConfig.check(eval_sampling(c.cfg.data, c.cfg.rollout.sampling))
            for problem in problems:
                c.error(f"eval sampling (data.eval_mode={d.eval_mode!r}, data.eval_sde_indices, "
                        f"data.eval_num_inference_steps, data.eval_guidance_scale over "
                        f"rollout.sampling): {problem}")
    e = c.cfg.ema
    if e.enabled:
        if not 0.0 <= e.decay < 1.0:
            c.error(f"{flagged('ema.decay')}={e.decay} must be in [0, 1)")
        c.at_least("ema.update_interval", e.update_interval, 1)
    if c.check_paths:
        check_prompt_files(c)
        if c.cfg.checkpoint.load and not Path(c.cfg.checkpoint.load).is_dir():
            c.error(f"{flagged('checkpoint.load')}={c.cfg.checkpoint.load!r} is not a directory")


def check_prompt_files(c: Checker) -> None:
    """Open and parse the prompt files (every bad line as file:line) and refuse eval prompts
    that are also training prompts: both would otherwise surface after the model loads."""
    d, parsed = c.cfg.data, {}
    for name in ("prompt_data", "eval_prompt_data"):
        v = getattr(d, name)
        if not v or v.startswith("toy:"):
            continue
        if not Path(v).is_file():
            c.error(f"{flagged('data.' + name)}={v!r} is not a file")
            continue
        try:
            parsed[name] = read_numbered(v)
        except PromptFileError as exc:
            c.errors += [f"{flagged('data.' + name)}: {p}" for p in exc.problems[:20]]
            if len(exc.problems) > 20:
                c.error(f"{flagged('data.' + name)}: ... and {len(exc.problems) - 20} more")
            continue
        check_prompt_media(c, name, parsed[name])
    if len(parsed) == 2:
        for problem in overlap_problems(parsed["prompt_data"], parsed["eval_prompt_data"]):
            c.error(f"{flagged('data.eval_prompt_data')}: {problem}")
    for name, numbered in parsed.items():
        problems = prompt_length_problems(c.cfg, numbered)
        c.errors += [f"{flagged('data.' + name)}: {p}" for p in problems[:20]]
        if len(problems) > 20:
            c.error(f"{flagged('data.' + name)}: ... and {len(problems) - 20} more")


def prompt_length_problems(cfg, numbered: list[tuple[str, dict]]) -> list[str]:
    """Prompts longer than the text window, as ``file:line``, where preflight can know the
    window without loading a model: the toy model (its adapter refuses a longer prompt at the
    first generate, where the diffusers families truncate it, as their pipelines do). The
    count is its tokenizer's own (``tokenizers``, torch-free), special tokens included."""
    from trainer.toy import weights_dir  # torch-free: the package imports its parts lazily
    root = weights_dir() if cfg.model.model_path == "toy" else Path(cfg.model.model_path)
    tokenizer_file = root / "tokenizer" / "tokenizer.json"
    if not (root / "toy_config.json").is_file() or not tokenizer_file.is_file():
        return []
    import json

    from tokenizers import Tokenizer
    limit = cfg.model.adapter_options.get("max_sequence_length") or \
        json.loads((root / "toy_config.json").read_text())["max_prompt_tokens"]
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    out = []
    for where, record in numbered:
        n = len(tokenizer.encode(record["prompt"]).ids)
        if n > int(limit):
            out.append(f"{where}: the prompt has {n} tokens, more than the toy model's text "
                       f"window of {limit} (model.adapter_options.max_sequence_length): "
                       f"{cut(record['prompt'], 60)}")
    return out


def check_prompt_media(c: Checker, name: str, numbered: list[tuple[str, dict]]) -> None:
    """Decode every reference image of an editing prompt file now (``file:line: images[i]:
    why``), so a missing or broken source is a preflight error, not a crash in a rollout.
    Text-to-image files have none and cost nothing here."""
    with_images = [where for where, record in numbered if record.get("images")]
    if with_images and c.cfg.model.task not in CONDITIONED_TASKS:
        c.error(f"{flagged('data.' + name)}: {len(with_images)} record(s) carry source images "
                f"(first at {with_images[0]}) but model.task={c.cfg.model.task!r} takes no "
                f"conditioning media (tasks that do: {list(CONDITIONED_TASKS) or 'none yet'}); "
                f"they would be ignored")
        return
    without = [where for where, record in numbered if not record.get("images")]
    if without and c.cfg.model.task in CONDITIONED_TASKS:
        c.error(f"{flagged('data.' + name)}: {len(without)} record(s) carry no source images "
                f"(first at {without[0]}) but model.task={c.cfg.model.task!r} edits them")
    seen: dict = {}
    problems = [f"{where}: {problem}" for where, record in numbered
                for problem in record_media_problems(record, seen)]
    c.errors += [f"{flagged('data.' + name)}: {p}" for p in problems[:20]]
    if len(problems) > 20:
        c.error(f"{flagged('data.' + name)}: ... and {len(problems) - 20} more")


def check_reliability(c: Checker) -> None:
    r, t, ck = c.cfg.rollout, c.cfg.train, c.cfg.checkpoint
    for name in ("engine_timeout_floor_s", "engine_timeout_per_sample_s"):
        v = getattr(r, name)
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            c.error(f"{flagged('rollout.' + name)}={v!r} must be > 0")
    c.at_least("rollout.engine_max_restarts", r.engine_max_restarts, 0)
    c.at_least("train.max_rollouts_without_step", t.max_rollouts_without_step, 0)
    c.one_of("checkpoint.base_hash", ck.base_hash, ("sampled", "full"))
    if ck.resume and ck.overwrite:
        c.error(f"{flagged('checkpoint.resume')} and {flagged('checkpoint.overwrite')} contradict "
                f"each other: pass one")


def check_logging(c: Checker) -> None:
    lg, ck = c.cfg.logging, c.cfg.checkpoint
    c.at_least("logging.log_interval", lg.log_interval, 1)
    c.at_least("checkpoint.save_interval", ck.save_interval, -1, " (-1: never save)")
    if c.check_paths:
        for dotted, value in (("logging.run_dir", lg.run_dir), ("checkpoint.save", ck.save)):
            if value:
                problem = _unwritable_dir(Path(value))
                if problem:
                    c.error(f"{flagged(dotted)}={value!r} cannot be created: {problem}")
    if lg.profile_steps is not None:
        m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", str(lg.profile_steps))
        if not m or int(m.group(1)) >= int(m.group(2)):
            c.error(f"{flagged('logging.profile_steps')}={lg.profile_steps!r} must be 'A:B' with "
                    f"0 <= A < B")


def _unwritable_dir(path: Path) -> str | None:
    """Why ``path`` cannot be (or be made) a writable directory; None when it can."""
    probe = path
    while not probe.exists():
        if probe == probe.parent:
            return None
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file, not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable by this user"
    return None
