"""Console progress: a run-level tqdm bar (rollouts done / total, rate, ETA, the current phase
and the latest train and eval reward) above the per-rollout bars the driver draws (rollout and
eval groups) and a train bar over optimizer updates.

The phase comes from the loop's own ``StageTimer`` stages (rollout, reward, train,
weight_sync, eval...): ``RunProgress.watch(timer, updates)`` returns a timer that also names
the stage on the bar and, for the "train" stage, opens the train bar; the optimizer's own
step hook (``optimizer.register_step_post_hook(progress.optimizer_stepped)``) advances it. So
no call is added inside the step. A resumed run starts the bar at its resume point; tqdm's
rate and ETA then count this session's rollouts only.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from tqdm.auto import tqdm


class RunProgress:
    def __init__(self, total: int, initial: int = 0, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self.bar = None
        self.postfix: dict[str, str] = {}
        self._train: _Ticker | None = None
        if enabled:
            self.bar = tqdm(total=total, initial=initial, desc="run", unit="rollout",
                            dynamic_ncols=True, position=0)

    def phase(self, name: str) -> None:
        self._set(phase=name)

    def step_done(self, metrics: dict[str, float]) -> None:
        """One rollout finished: advance, and show its reward (and eval reward, if any)."""
        values = {}
        if "reward/mean" in metrics:
            values["reward"] = f"{metrics['reward/mean']:.4g}"
        if "eval/reward_mean" in metrics:
            values["eval"] = f"{metrics['eval/reward_mean']:.4g}"
        self._set(**values)
        if self.bar is not None:
            self.bar.update(1)

    def _set(self, **values: str) -> None:
        self.postfix.update(values)
        if self.bar is not None:
            self.bar.set_postfix(self.postfix, refresh=True)

    def write(self, line: str) -> None:
        """A console line above the bars (tqdm.write keeps them intact)."""
        if self.bar is not None:
            tqdm.write(line)

    def watch(self, timer, updates_per_rollout: int = 0):
        return _PhaseTimer(timer, self, updates_per_rollout)

    def optimizer_stepped(self, *_args) -> None:
        """An ``Optimizer.register_step_post_hook`` hook: one update of the train bar."""
        if self._train is not None:
            self._train.tick()

    @contextlib.contextmanager
    def train_bar(self, total: int) -> Iterator["_Ticker"]:
        """``with progress.train_bar(n) as bar: ... bar.tick()`` per optimizer update."""
        bar = None
        if self.enabled:
            bar = tqdm(total=total, desc="train", unit="update", leave=False, position=1)
        try:
            yield _Ticker(bar)
        finally:
            if bar is not None:
                bar.close()

    def close(self) -> None:
        """Close the run bar; later calls (a timer still wrapped) are then no-ops."""
        if self.bar is not None:
            self.bar.close()
        self.bar, self.enabled = None, False


class _Ticker:
    def __init__(self, bar) -> None:
        self.bar = bar

    def tick(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)


class _PhaseTimer:
    """A StageTimer whose stages also set the run bar's phase (everything else delegated)."""

    def __init__(self, timer, progress: RunProgress, updates: int) -> None:
        self._timer, self._progress, self._updates = timer, progress, updates

    @contextlib.contextmanager
    def stage(self, name: str):
        self._progress.phase(name)
        with contextlib.ExitStack() as stack:
            if name == "train" and self._updates > 0:
                self._progress._train = stack.enter_context(
                    self._progress.train_bar(self._updates))
                stack.callback(setattr, self._progress, "_train", None)
            stack.enter_context(self._timer.stage(name))
            yield

    def __getattr__(self, name):
        return getattr(self._timer, name)
