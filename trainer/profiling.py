"""NVTX ranges for every stage and a step window for `nsys --capture-range=cudaProfilerApi`.

Ranges are no-ops without CUDA (and cost one Python call with it; NVTX itself is a no-op
when no profiler is attached). Stage names are fixed by ARCHITECTURE.md: rollout,
rollout/denoise, reward, train/replay, train/backward, train/optimizer, weight_sync/gather,
weight_sync/transport, weight_sync/commit, offload, onload, checkpoint, eval.
"""
from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch

_CUDA = torch.cuda.is_available()


@contextlib.contextmanager
def nvtx_range(name: str) -> Iterator[None]:
    if _CUDA:
        torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            torch.cuda.nvtx.range_pop()
    else:
        yield


class ComputeMeter:
    """Model compute measured in place, inside the real step (perf/compute/*).

    ``region(name, device)`` wraps one model call (a transformer forward or backward, the VAE
    decode, the text encoder, the reward model). On a CUDA device it records a pair of CUDA
    events on the current stream, so a region's time is the GPU time from its first kernel's
    turn to its last kernel's end, launch gaps inside it included, and nothing is
    synchronised until ``pop()``; on the CPU it is the host clock. Regions do not nest: an
    inner region inside an open one is not timed again. The share of a step outside model
    compute is then 1 - sum(regions) / step (sampler maths, log-prob kernels, advantages,
    optimizer, weight sync, data movement and Python orchestration all count as outside).
    """

    def __init__(self) -> None:
        self._open = False
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._host: dict[str, float] = {}

    @contextlib.contextmanager
    def region(self, name: str, device: torch.device | str) -> Iterator[None]:
        if self._open:
            yield
            return
        self._open = True
        try:
            if torch.device(device).type == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                yield
                end.record()
                self._events.append((name, start, end))
            else:
                t0 = time.perf_counter()
                yield
                self._host[name] = self._host.get(name, 0.0) + time.perf_counter() - t0
        finally:
            self._open = False

    def pop(self) -> dict[str, float]:
        """Seconds per region name since the last pop (waits for the last CUDA region)."""
        out, self._host = self._host, {}
        if self._events:
            for name, start, end in self._events:
                end.synchronize()
                out[name] = out.get(name, 0.0) + start.elapsed_time(end) / 1000.0
            self._events = []
        return out


def add_times(into: dict[str, float], more: dict[str, float] | None) -> dict[str, float]:
    for k, v in (more or {}).items():
        into[k] = into.get(k, 0.0) + float(v)
    return into


class StageTimer:
    """Wall time per stage (host clock) plus its NVTX range.

    ``sync=True`` synchronises the device at the stage's end so the time is the stage's own
    (one host sync per stage, five or six per step: negligible against the step);
    ``stage(name, current_stream_only=True)`` waits for the current stream alone, for a stage
    that leaves copies running on a side stream on purpose.
    """

    def __init__(self, sync: bool = True) -> None:
        self.times: dict[str, float] = {}
        self.sync = sync and _CUDA

    @contextlib.contextmanager
    def stage(self, name: str, current_stream_only: bool = False) -> Iterator[None]:
        t0 = time.perf_counter()
        with nvtx_range(name):
            yield
            if self.sync and current_stream_only:
                torch.cuda.current_stream().synchronize()  # NOTE: host sync, once per stage
            elif self.sync:
                torch.cuda.synchronize()  # NOTE: host sync, once per stage
        self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0

    def pop(self) -> dict[str, float]:
        out, self.times = self.times, {}
        return out


def parse_profile_steps(spec: str | None) -> tuple[int, int] | None:
    """'A:B' -> (A, B): rollouts A..B-1 are captured."""
    if not spec:
        return None
    try:
        a, b = (int(x) for x in spec.split(":"))
    except ValueError as exc:
        raise ValueError(f"--profile-steps expects A:B with integers, got {spec!r}") from exc
    if not 0 <= a < b:
        raise ValueError(f"--profile-steps {spec!r}: need 0 <= A < B")
    return a, b


class ProfileWindow:
    """Calls cudaProfilerStart before rollout A and cudaProfilerStop after rollout B-1."""

    def __init__(self, spec: str | None) -> None:
        self.window = parse_profile_steps(spec)
        self.active = False

    def before(self, rollout_id: int) -> None:
        if self.window and _CUDA and rollout_id == self.window[0] and not self.active:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            self.active = True

    def after(self, rollout_id: int) -> None:
        if self.active and rollout_id == self.window[1] - 1:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            self.active = False
