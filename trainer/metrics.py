"""Metrics: JSONL always, TensorBoard by default, W&B on request; rank 0 only.

Names live under namespaces (train/…, reward/…, perf/…, eval/…). Values reaching ``log``
must already be Python floats: the caller decides when to pay the host sync (`.item()`),
once per logged step.

A resume cuts the run's history back to the resumed step (``truncate_after``): the lines of
``metrics.jsonl`` past it are removed, and TensorBoard's writer is reopened with
``purge_step`` so TensorBoard discards the old events past it as well.

A full or failing disk under the run dir does not stop the run: each line of
``metrics.jsonl`` is one ``os.write`` of the whole line to a file opened for appending (no
buffer that could flush half a line later), and a write that fails or comes back short is cut
back to the file's previous length, so the file only ever holds whole lines. A failed metrics
line, TensorBoard call or picture is logged (the first of each kind in full, then counted) and
counted as ``logging/write_failures``, which the next line that reaches the disk carries. A
torn last line (a crash mid-write, or a file cut by something else) is dropped at resume with a
warning.
"""
from __future__ import annotations

import errno
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image


class MetricsLogger:
    def __init__(self, run_dir: str | Path, *, enabled: bool = True, tensorboard: bool = True,
                 wandb: bool = False, wandb_project: str = "flowgrpo",
                 config: dict[str, Any] | None = None) -> None:
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self._tb = None
        self._wandb = None
        self._jsonl: int | None = None  # O_APPEND descriptor of metrics.jsonl
        self._failures_before = _WRITE_FAILURES["count"]
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = _open_append(self.run_dir / "metrics.jsonl")
        if tensorboard:  # local: TensorBoard's writer (protobuf) only when it is enabled
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        if wandb:  # optional dependency; readable name, resumable id: trainer/wandb_run.py
            from trainer.wandb_run import init_wandb
            self._wandb = init_wandb(self.run_dir, wandb_project, config or {})

    def log(self, step: int, metrics: dict[str, float], *, console: bool = True) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items()}
        if self.write_failures:
            clean["logging/write_failures"] = float(self.write_failures)
        line = json.dumps({"step": step, "time": time.time(), **clean}) + "\n"
        self._guarded("metrics.jsonl", lambda: _append_whole_line(self._jsonl, line.encode()))
        if self._tb is not None:
            def scalars():
                for k, v in clean.items():
                    if math.isfinite(v):
                        self._tb.add_scalar(k, v, step)
            self._guarded("tensorboard", scalars)
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        if console:
            print(self.console_line(step, clean), flush=True)

    @property
    def write_failures(self) -> int:
        """Failed writes of this process's logs, pictures and artifacts since this logger
        started (``logging/write_failures``)."""
        return _WRITE_FAILURES["count"] - self._failures_before

    def _guarded(self, kind: str, write) -> bool:
        """Run one write into the run dir; an OSError is logged and counted, not raised (see
        the module docstring). Returns whether it succeeded."""
        try:
            write()
            return True
        except OSError as exc:
            record_write_failure(f"{kind} in {self.run_dir}", exc)
            return False

    def truncate_after(self, step: int) -> int:
        """Drop every ``metrics.jsonl`` line with a step > ``step`` (kept lines unchanged, the
        file replaced atomically) and make TensorBoard discard its events past ``step``.
        Returns the number of lines removed."""
        if not self.enabled:
            return 0
        path = self.run_dir / "metrics.jsonl"
        os.close(self._jsonl)
        kept, dropped = [], 0
        lines = path.read_text(errors="replace").splitlines(keepends=True)
        if lines and _torn(lines[-1]):
            logging.getLogger("trainer").warning(
                "%s: dropped its torn last line (%d bytes, a write cut short by a crash or a "
                "full disk): %.80r", path, len(lines[-1].encode()), lines[-1])
            lines.pop()
        for line in lines:
            try:
                past = json.loads(line).get("step", 0) > step
            except (ValueError, AttributeError):
                past = False  # an unparsable line inside is kept: it is not ours to judge
            if past:
                dropped += 1
            else:
                kept.append(line)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)
        self._jsonl = _open_append(path)
        if self._tb is not None:
            from torch.utils.tensorboard import SummaryWriter
            self._tb.close()
            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=step + 1)
        logging.getLogger("trainer").log(
            logging.WARNING if dropped else logging.INFO,
            "resumed at step %d: removed %d metrics.jsonl lines past it%s", step, dropped,
            " (TensorBoard purges its events past it)" if self._tb is not None else "")
        return dropped

    def clear(self) -> None:
        """Start the history over (a run started with --overwrite)."""
        self.truncate_after(-1)

    @staticmethod
    def console_line(step: int, m: dict[str, float]) -> str:
        keys = [("reward/mean", "reward"), ("eval/reward_mean", "eval"),
                ("train/loss", "loss"), ("train/ratio_mean", "ratio"),
                ("train/clip_fraction", "clip"), ("train/grad_norm", "gnorm"),
                ("perf/step_time", "step_s"), ("perf/samples_per_s", "samples/s"),
                ("weight_sync/seconds", "sync_s")]
        parts = [f"step {step}"]
        parts += [f"{short} {m[k]:.4g}" for k, short in keys if k in m]
        return " | ".join(parts)

    def image_grid(self, tag: str, step: int, images: np.ndarray, path: Path | None = None,
                   ncol: int = 8) -> np.ndarray:
        """[N, H, W, 3] uint8 -> one grid image, to TensorBoard and optionally a PNG."""
        grid = make_grid(images, ncol)
        if self.enabled:
            if self._tb is not None:
                self._guarded("tensorboard",
                              lambda: self._tb.add_image(tag, grid, step, dataformats="HWC"))
            if path is not None:
                self._guarded(f"picture {path.name}", lambda: _save_png(grid, path))
        return grid

    def image(self, tag: str, step: int, image: np.ndarray, path: Path | None = None) -> None:
        """One ready-made picture (HWC uint8) to TensorBoard, W&B and optionally a PNG."""
        if not self.enabled:
            return
        if self._tb is not None:
            self._guarded("tensorboard",
                          lambda: self._tb.add_image(tag, image, step, dataformats="HWC"))
        if self._wandb is not None:  # wandb is optional: trainer.wandb_run imports it
            from trainer.wandb_run import log_image
            log_image(self._wandb, tag, step, image)
        if path is not None:
            self._guarded(f"picture {path.name}", lambda: _save_png(image, path))

    def write_text(self, name: str, text: str) -> bool:
        """A small file of the run dir (``summary.json``), written whole through a temporary
        file; a failure is logged and counted like any other write. Returns whether it was."""
        path = self.run_dir / name

        def write() -> None:
            tmp = path.with_name(f".{path.name}.tmp")
            try:
                tmp.write_text(text)
                os.replace(tmp, path)
            except OSError:
                tmp.unlink(missing_ok=True)
                raise
        return self.enabled and self._guarded(name, write)

    def samples(self, tag: str, step: int, grid: np.ndarray, images, texts: list[str],
                path: Path | None = None) -> None:
        """Samples: the captioned grid to TensorBoard and the PNG, and to W&B one captioned
        image per sample (trainer.wandb_run.log_samples), which W&B's media panel pages
        through and whose captions it shows whole."""
        if not self.enabled:
            return
        if self._tb is not None:
            self._tb.add_image(tag, grid, step, dataformats="HWC")
        if self._wandb is not None:
            from trainer.wandb_run import log_samples
            log_samples(self._wandb, tag, step, images, texts)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(grid).save(path)

    def close(self) -> None:
        if self._jsonl is not None:
            os.close(self._jsonl)
            self._jsonl = None
        if self._tb is not None:
            self._guarded("tensorboard", self._tb.close)
        if self._wandb is not None:
            self._wandb.finish()


# Failed writes into the run dir, per process (the artifact writer and the logger count into
# one figure), and the kinds already reported in full.
_WRITE_FAILURES: dict[str, Any] = {"count": 0, "kinds": set()}


def record_write_failure(what: str, exc: OSError) -> int:
    """Log (the first failure of each kind as an error, later ones as warnings) and count one
    failed write; returns the process's count."""
    _WRITE_FAILURES["count"] += 1
    kind = what.split(" in ")[0]
    first = kind not in _WRITE_FAILURES["kinds"]
    _WRITE_FAILURES["kinds"].add(kind)
    logging.getLogger("trainer").log(
        logging.ERROR if first else logging.WARNING,
        "could not write %s (%s: %s); the run goes on (logging/write_failures = %d)", what,
        errno.errorcode.get(exc.errno or 0, type(exc).__name__), exc.strerror or exc,
        _WRITE_FAILURES["count"])
    return _WRITE_FAILURES["count"]


def settle_writes(futures, what: str) -> int:
    """Wait for background writes (the rollout's artifacts); an OSError among them (a full
    disk) is logged and counted, not raised: they are records of the run, not the run.
    Returns how many failed."""
    failed = 0
    for future in futures:
        try:
            future.result()
        except OSError as exc:
            record_write_failure(what, exc)
            failed += 1
    return failed


def _open_append(path: Path) -> int:
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def _append_whole_line(fd: int, data: bytes) -> None:
    """Append ``data`` with one write; a failed or short write is cut back to the previous
    end of file (so no torn line stays) and raised as OSError."""
    start = os.fstat(fd).st_size
    try:
        written = os.write(fd, data)
        if written != len(data):
            raise OSError(errno.ENOSPC, f"short write ({written} of {len(data)} bytes)")
    except OSError:
        try:
            os.ftruncate(fd, start)
        except OSError:
            pass  # resume drops a torn last line (truncate_after)
        raise


def _torn(line: str) -> bool:
    """A last line cut short: no newline at its end, or not a JSON object."""
    if not line.endswith("\n"):
        return True
    try:
        return not isinstance(json.loads(line), dict)
    except ValueError:
        return True


def _save_png(image: np.ndarray, path: Path) -> None:
    """A picture appears whole or not at all (a temporary file renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        Image.fromarray(image).save(tmp, format="PNG")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def step_metrics(*, step_time: float, stage_times: dict[str, float], recompiles: float,
                 compute: dict[str, float], outside: dict[str, float], samples: int,
                 sde_steps: int, world: int, counters: dict[str, int],
                 device: torch.device) -> dict[str, float]:
    """The perf/* and train/* figures of one training step (this rank's; the loop reduces).

    ``samples`` is this rank's; rates are multiplied by ``world`` (every rank trains as many).
    ``counters``: ``TrainerState``'s counters (policy version, failures, restarts)."""
    m = {f"perf/{k}_time": v for k, v in stage_times.items()}
    m["perf/step_time"] = step_time
    m["perf/recompiles"] = recompiles
    m.update({f"perf/compute/{k}": v for k, v in compute.items()})
    m["perf/model_compute_time"] = sum(compute.values())
    m.update({f"perf/outside/{k}": v for k, v in outside.items()})
    # Share of the step outside transformer / VAE / text-encoder / reward-model compute
    # (ComputeMeter's definition): the framework's own overhead, target <= 5 % on a GPU.
    m["perf/outside_compute_share"] = 1.0 - sum(compute.values()) / step_time
    m["perf/samples_per_s"] = samples / step_time * world
    m["perf/train_samples_per_s"] = samples / stage_times["train"] * world
    m["perf/train_transitions_per_s"] = samples * sde_steps / stage_times["train"] * world
    m["train/policy_version"] = float(counters["policy_version"])
    m["train/weight_sync_failures"] = float(counters["weight_sync_failures"])
    m["train/checkpoint_failures"] = float(counters["checkpoint_failures"])
    m["train/engine_restarts"] = float(counters["engine_restarts"])
    if device.type == "cuda":
        gb = 2.0 ** 30
        m["perf/mem_allocated_gb"] = torch.cuda.memory_allocated(device) / gb
        m["perf/mem_reserved_gb"] = torch.cuda.memory_reserved(device) / gb
        m["perf/mem_peak_gb"] = torch.cuda.max_memory_allocated(device) / gb
    return m


def make_grid(images: np.ndarray, ncol: int = 8, pad: int = 2) -> np.ndarray:
    n, h, w, c = images.shape
    ncol = max(1, min(ncol, n))
    nrow = (n + ncol - 1) // ncol
    grid = np.full((nrow * (h + pad) + pad, ncol * (w + pad) + pad, c), 255, dtype=np.uint8)
    for i in range(n):
        r, q = divmod(i, ncol)
        y, x = pad + r * (h + pad), pad + q * (w + pad)
        grid[y:y + h, x:x + w] = images[i]
    return grid
