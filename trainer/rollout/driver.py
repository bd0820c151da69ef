"""``RolloutDriver``: prompt groups -> engine requests in waves -> one in-memory RolloutBatch.

Per rollout: resolve the trained SDE steps once (so every
candidate and engine uses the same set), prune stale artifact directories, build each group's
``n`` candidates with stable sample ids, dispatch the groups to the engines in waves, validate
and pack every response with the adapter, and return the batch (images included) for the reward
and the actor. Sidecars and PNGs are written beside it, for audit, on a background thread that
overlaps the next wave; the training path never reads them back.

Design choices:
- A request carries ``wave_size`` prompt groups (default 1: a group of 8 is the batch the
  transformer runs; larger waves trade memory for fewer, bigger forwards). A wave is one
  request per engine, in flight concurrently (one thread per engine); groups go to engines
  round-robin, in order, so a given rollout always maps groups to engines the same way.
- Sample ids (``sample_id_mode``): "metadata" is ``prompt:<id>:sample:<slot>`` with the
  record's ``metadata.prompt_id`` or ``metadata.sample_id`` (else the group index);
  "positional" / "group_index" is ``prompt:<group_index>:sample:<slot>``. Two candidates of one
  rollout with the same id are an error (they would get identical noise).
- ``driver_xt`` false (the fallback): the request's engine seed is ``seed +
  first_group_index * n``, so candidates differ by their position in the request.
- Evaluation (``rollout_id=None``) writes under ``<root>/eval/<task>/rollout_<policy_version>``.
- The engine's reported weight version must equal ``policy_version``: a mismatch means a
  rollout from stale weights, which is raised rather than trained on (an engine that reports
  no version, such as a stock SGLang server, is not checked).
"""
from __future__ import annotations

from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm.auto import tqdm

from trainer.media import batch_sources
from trainer.models.base import GenerativeModelAdapter, RolloutBatch
from trainer.profiling import add_times, nvtx_range
from trainer.metrics import settle_writes
from trainer.rollout.artifacts import (prune_stale_artifacts, rollout_dir, sampling_fingerprint,
                                       write_group_images, write_group_sidecar)
from trainer.models.batch import concat_batches
from trainer.config.sampling import SAMPLE_ID_MODES, SamplingConfig


def _problem_list(title: str, problems: list[str]) -> ValueError:
    return ValueError(f"{title}:\n  - " + "\n  - ".join(problems))


class RolloutDriver:
    """Generates rollouts from prompt records through one or more engine clients.

    Args:
        adapter: the model family's adapter (builds requests, validates and packs responses).
        engines: ``EngineClient`` / ``SGLangEngineClient`` instances (one per GPU of this rank).
        sampling: the rollout.sampling config (a SamplingConfig, or its table), validated here.
        seed: --generation-seed (the driver's x_T recipe seed).
        task: generation task, the artifact subdirectory (e.g. "t2i").
        artifact_root: where sidecars and PNGs go; None writes nothing.
        retention: rollouts kept under artifact_root (<= 0: all).
        wave_size: prompt groups per engine request (None: 1).
        sample_id_mode: "metadata" | "positional" | "group_index".
        noise_steps: ``rollout_id -> SDE steps`` of a training rollout when ``train.algorithm``
            chooses them (trainer.algorithms.schedule); None: the sampling config's rule.
    """

    def __init__(self, adapter: GenerativeModelAdapter, engines: list[Any], *,
                 sampling: "dict[str, Any] | SamplingConfig", seed: int, task: str,
                 artifact_root: str | None = None,
                 retention: int = 2, wave_size: int | None = None,
                 sample_id_mode: str = "metadata",
                 noise_steps: Callable[[int], list[int]] | None = None) -> None:
        problems = []
        if not engines:
            problems.append("no engines")
        if not isinstance(sampling, (dict, SamplingConfig)):
            problems.append(f"sampling must be a dict or a SamplingConfig, got {type(sampling).__name__}")
            sampling = {}
        if isinstance(seed, bool) or not isinstance(seed, int):
            problems.append(f"seed must be an integer, got {seed!r}")
        if not isinstance(task, str) or not task or "/" in task:
            problems.append(f"task must be a plain name such as 't2i', got {task!r}")
        if wave_size is not None and (isinstance(wave_size, bool) or not isinstance(wave_size, int)
                                      or wave_size < 1):
            problems.append(f"wave_size must be a positive integer or None, got {wave_size!r}")
        if isinstance(retention, bool) or not isinstance(retention, int):
            problems.append(f"retention must be an integer, got {retention!r}")
        if sample_id_mode not in SAMPLE_ID_MODES:
            problems.append(f"sample_id_mode must be one of {SAMPLE_ID_MODES}, got {sample_id_mode!r}")
        configured = getattr(sampling, "sample_id_mode", None) or sampling.get("sample_id_mode")
        if configured is not None and configured != sample_id_mode:
            problems.append(f"sampling['sample_id_mode'] is {configured!r} but the driver was built "
                            f"with {sample_id_mode!r}")
        config, sampling_problems = SamplingConfig.check(sampling)
        problems += sampling_problems  # here, at construction, not at the first rollout
        if problems:
            raise _problem_list("invalid rollout driver configuration", problems)
        self.adapter = adapter
        self.engines = list(engines)
        self.sampling = config.to_dict()
        self.sampling_config: SamplingConfig = config
        self.seed = int(seed)
        self.task = task
        self.artifact_root = None if artifact_root is None else Path(artifact_root)
        self.retention = int(retention)
        self.wave_size = wave_size or 1
        # Model compute the engines reported for the last generate(), seconds per part summed
        # over requests (engines serving in parallel add up: GPU-seconds, not wall time).
        self.last_compute_s: dict[str, float] = {}
        self.last_compiles: list[int] = []  # torch.compile events each request reported
        self.last_engine_memory: dict[str, int] = {}  # max over requests: allocated, peak
        self.sample_id_mode = sample_id_mode
        self.fingerprint = sampling_fingerprint(self.sampling)
        self.driver_xt = bool(self.sampling.get("driver_xt", True))
        # train.algorithm's own SDE steps per training rollout (trainer.algorithms.schedule)
        self.algorithm_noise_steps = noise_steps

    # ---- candidates ---------------------------------------------------------------------------
    def sample_ids(self, records: list[dict[str, Any]], n: int) -> list[list[str]]:
        """Stable candidate ids, ``[group][slot]``."""
        out = []
        for g, record in enumerate(records):
            key: Any = g
            if self.sample_id_mode == "metadata":
                meta = record.get("metadata") or {}
                key = meta.get("prompt_id", meta.get("sample_id", g))
            out.append([f"prompt:{key}:sample:{slot}" for slot in range(n)])
        return out

    def _check_records(self, records: Any, n: Any) -> None:
        problems = []
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            problems.append(f"n_samples_per_prompt must be a positive integer, got {n!r}")
        if not isinstance(records, list) or not records:
            problems.append("records must be a non-empty list of {'prompt', 'metadata'} dicts")
        else:
            for i, r in enumerate(records):
                if not isinstance(r, dict) or not isinstance(r.get("prompt"), str):
                    problems.append(f"record {i} has no string 'prompt': {r!r}"[:200])
                elif not isinstance(r.get("metadata", {}) or {}, dict):
                    problems.append(f"record {i} has a non-dict 'metadata'")
        if problems:
            raise _problem_list("invalid rollout input", problems)

    # ---- one rollout ---------------------------------------------------------------------------
    def generate(self, records: list[dict[str, Any]], n_samples_per_prompt: int, *,
                 rollout_id: int | None, policy_version: int, write_artifacts: bool = True,
                 progress: bool = False,
                 while_waiting: Callable[[], None] | None = None) -> RolloutBatch:
        """Generate ``n_samples_per_prompt`` candidates per record; ``rollout_id=None`` is eval.
        ``while_waiting`` runs once, on this thread, after the first requests are sent and
        before their answers are awaited (host work done while the engines work)."""
        self._check_records(records, n_samples_per_prompt)
        n = n_samples_per_prompt
        sde = (self.algorithm_noise_steps(rollout_id)
               if self.algorithm_noise_steps is not None and rollout_id is not None
               else self.sampling_config.noise_steps(rollout_id))
        ids = self.sample_ids(records, n)
        dupes = sorted(s for s, c in Counter(s for group in ids for s in group).items() if c > 1)
        if dupes:
            raise ValueError(f"duplicate sample ids in one rollout {dupes[:5]} (sample_id_mode="
                             f"{self.sample_id_mode!r}): records share a prompt_id/sample_id")
        directory = self._prepare_directory(rollout_id, policy_version, write_artifacts)

        chunks = [list(range(g, min(g + self.wave_size, len(records))))
                  for g in range(0, len(records), self.wave_size)]
        requests = []
        for groups in chunks:
            prompts = [records[g]["prompt"] for g in groups for _ in range(n)]
            # each candidate carries its record's reference images (None: text-to-image)
            sources = batch_sources([records[g] for g in groups for _ in range(n)])
            req_seed = self.seed if self.driver_xt else self.seed + groups[0] * n
            requests.append(self.adapter.build_rollout_request(
                prompts, [s for g in groups for s in ids[g]], self.sampling_config, rollout_id=rollout_id,
                seed=req_seed, sde_indices=sde, group_index=[g for g in groups for _ in range(n)],
                images=sources))

        # One weight checksum per engine per rollout, recorded in every candidate's manifest
        # (with the policy version and sampling fingerprint: docs/design.md#data).
        checksums = {e: engine.checksum() for e, engine in enumerate(self.engines)} \
            if directory is not None else {}
        metadata = self._metadata(records, ids, n, policy_version, directory, checksums)
        bar = None
        if progress:
            bar = tqdm(total=len(records), desc="rollout" if rollout_id is not None else "eval",
                       unit="group", leave=False)
        packed: list[RolloutBatch] = [None] * len(requests)  # type: ignore[list-item]
        self.last_compute_s, self.last_compiles, self.last_engine_memory = {}, [], {}
        writes: list[Future] = []
        num_engines = len(self.engines)
        with nvtx_range("rollout"), ThreadPoolExecutor(num_engines, "rollout-engine") as pool, \
                ThreadPoolExecutor(1, "rollout-artifacts") as writer:
            for start in range(0, len(requests), num_engines):
                wave = list(range(start, min(start + num_engines, len(requests))))
                futures = {i: pool.submit(self._serve, self.engines[i % num_engines], requests[i])
                           for i in wave}
                if while_waiting is not None and start == 0:
                    while_waiting()
                for i in wave:
                    packed[i], reported, compute = futures[i].result()
                    add_times(self.last_compute_s, compute)
                    if reported is not None and reported != policy_version:
                        raise RuntimeError(
                            f"rollout at policy version {policy_version} got stale weights: engine "
                            f"{i % num_engines} served version {reported} for groups {chunks[i]}")
                    packed[i].policy_version, packed[i].rollout_id = int(policy_version), rollout_id
                    packed[i].metadata = [metadata[g * n + s] for g in chunks[i] for s in range(n)]
                    if bar is not None:
                        bar.update(len(chunks[i]))
                    if directory is not None:
                        writes.append(writer.submit(self._write_request, directory, packed[i],
                                                    requests[i], chunks[i], n,
                                                    checksums[i % num_engines]))
            settle_writes(writes, f"rollout artifacts in {directory}")  # full disk: counted
        if bar is not None:
            bar.close()

        batch = concat_batches(packed)
        batch.policy_version = int(policy_version)
        batch.rollout_id = rollout_id
        return batch

    def _serve(self, engine: Any, request: dict[str, Any]
               ) -> tuple[RolloutBatch, int | None, dict[str, float] | None]:
        """One request on one engine; the adapter validates the answer (one error, all problems).
        Also returns the weight version the engine reported (None: it reports none, e.g. a
        stock SGLang server) and its model-compute seconds (None when it reports none)."""
        response = engine.generate(request)
        reported = response.get("policy_version") if isinstance(response, dict) else None
        compute = response.get("compute_s") if isinstance(response, dict) else None
        if not isinstance(compute, dict):
            compute = None
        if isinstance(response, dict) and isinstance(response.get("compiles"), int):
            self.last_compiles.append(response["compiles"])  # list.append: thread-safe
        for key in ("memory_allocated_bytes", "memory_peak_bytes"):
            value = response.get(key) if isinstance(response, dict) else None
            if isinstance(value, int):
                self.last_engine_memory[key] = max(value, self.last_engine_memory.get(key, 0))
        return self.adapter.pack_trajectory(response, request), reported, compute

    def _prepare_directory(self, rollout_id: int | None, policy_version: int,
                           write_artifacts: bool) -> Path | None:
        if self.artifact_root is None or not write_artifacts:
            return None
        evaluation = rollout_id is None
        dir_id = int(policy_version) if evaluation else int(rollout_id)
        directory = rollout_dir(self.artifact_root, self.task, dir_id, evaluation=evaluation)
        # Training prunes by retention; evaluation keeps its history and only clears its own
        # (and abandoned-future) directories.
        prune_stale_artifacts(directory.parent, current_rollout_id=dir_id,
                              retention=0 if evaluation else self.retention)
        directory.mkdir(parents=True, exist_ok=True)
        return directory

    def _write_request(self, directory: Path, batch: RolloutBatch, request: dict[str, Any],
                       groups: list[int], n: int, checksum: str) -> None:
        sigmas = self._schedule(batch, request)
        for k, g in enumerate(groups):
            rows = batch.select(list(range(k * n, (k + 1) * n)))
            write_group_sidecar(directory, g, rows, task=self.task, sigmas=sigmas, seed=self.seed,
                                sampling_fp=self.fingerprint, weight_checksum=checksum)
            if rows.images is not None:
                write_group_images(directory, g, rows.images)

    def _schedule(self, batch: RolloutBatch, request: dict[str, Any]) -> torch.Tensor:
        """The full schedule the request sampled with (driver sigmas, else the adapter's)."""
        sent = (request.get("extra_sampling_params") or {}).get("sigmas")
        if sent is not None:
            return torch.tensor(sent, dtype=torch.float32)
        steps = int(request["num_inference_steps"])
        return self.adapter.scheduler_sigmas(steps, batch.geometry).to(torch.float32)

    def _metadata(self, records: list[dict[str, Any]], ids: list[list[str]], n: int,
                  policy_version: int, directory: Path | None,
                  checksums: dict[int, str]) -> list[dict[str, Any]]:
        out = []
        for g, record in enumerate(records):
            engine_idx = (g // self.wave_size) % len(self.engines)
            for slot in range(n):
                meta = dict(record.get("metadata") or {})
                meta.update({"sample_id": ids[g][slot], "group_index": g, "slot": slot,
                             "policy_version": int(policy_version),
                             "sampling_fingerprint": self.fingerprint})
                if engine_idx in checksums:
                    meta["weight_checksum"] = checksums[engine_idx]
                if directory is not None:
                    meta["sidecar"] = str(directory / f"group_{g:08d}.safetensors")
                out.append(meta)
        return out
