"""train.gc: Python's collection kept out of the train stage (trainer/utils/host_gc.py)."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from test_train_loop import make_trainer  # noqa: F401  (fixture)
from trainer.utils.host_gc import HostGarbageCollection, resolve_gc_mode


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_rollout_mode_collects_only_when_told_and_restores_the_process():
    assert gc.isenabled()
    schedule = HostGarbageCollection("rollout")
    try:
        assert not gc.isenabled()
        ref = weakref.ref(_Cycle())
        for _ in range(5000):  # far past the generation-0 threshold: nothing collects it
            _Cycle()
        assert ref() is not None
        schedule.while_engine_works()
        assert ref() is None and schedule.collections == 1
        schedule.step_done()
        assert schedule.frozen and gc.get_freeze_count() > 0
        frozen = gc.get_freeze_count()
        # freezes once only: a second freeze would move these tracked objects into the
        # permanent generation too (the count can also fall by a few: frozen objects are
        # still freed when their last reference goes)
        kept = [[] for _ in range(1000)]
        schedule.step_done()
        assert gc.get_freeze_count() < frozen + len(kept) // 2
    finally:
        schedule.close()
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_python_mode_and_auto_resolution():
    schedule = HostGarbageCollection("python")
    schedule.while_engine_works()
    schedule.step_done()
    assert gc.isenabled() and schedule.collections == 0 and not schedule.frozen
    assert resolve_gc_mode("auto", torch.device("cpu")) == "python"
    assert resolve_gc_mode("auto", torch.device("cuda", 0)) == "rollout"
    assert resolve_gc_mode("python", torch.device("cuda", 0)) == "python"


@pytest.mark.multiproc
@pytest.mark.slow
def test_trainer_collects_during_the_rollout_and_trains_the_same(make_trainer, monkeypatch):
    """With train.gc=rollout no automatic collection runs in the train stage, one runs per
    rollout while the engine works, and the weights after two steps equal Python's schedule's
    bit for bit; closing the trainer gives the process its schedule back."""
    import trainer.loop as loop_module

    seen = []
    real_train_on = loop_module.train_on

    def recording(*args, **kwargs):
        seen.append(gc.isenabled())
        return real_train_on(*args, **kwargs)

    monkeypatch.setattr(loop_module, "train_on", recording)  # the loop's train stage
    weights = {}
    for mode in ("python", "rollout"):
        trainer = make_trainer([f"train.gc={mode}"])
        for r in range(2):
            trainer.train_step(r)
        weights[mode] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        if mode == "rollout":
            assert trainer.host_gc.collections == 2 and trainer.host_gc.frozen
        trainer.close()
        assert gc.isenabled() and gc.get_freeze_count() == 0
    assert seen == [True, True, False, False]
    assert weights["python"].keys() == weights["rollout"].keys()
    for name, value in weights["python"].items():
        assert torch.equal(value, weights["rollout"][name]), name
