"""Engine restarts: an engine that missed a deadline or died is replaced and re-synced.

    batch = call_with_recovery(trainer, "rollout", lambda: trainer.driver.generate(...))

``call_with_recovery`` runs a call that talks to the engine; on ``EngineUnavailableError``
(a missed deadline, a dead process, a closed pipe: the engine's own exceptions are not
retried) it logs the failure with its stage, kills the engine, builds a new one through the
trainer's ``_build_engine`` (engine, weight sender, rollout driver), pushes the trainer's
weights to it as the current policy version (``trainer.resync_engine``: the version is checked
afterwards), and runs the call again. ``rollout.engine_max_restarts`` bounds the restarts of
a whole run; past it the run stops with an ``EngineError`` naming the stage, the count and
the last failure.

Design choices:

* One rank only (world 1). Re-syncing gathers the FSDP-sharded weights, a collective the
  other ranks would have to join at the same moment; in a multi-rank run the failure stops
  the run with the same clear error (torchrun then ends the other ranks).
* SGLang servers are not ours to restart: their failures stop the run.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from trainer.engine.client import EngineError, EngineUnavailableError

log = logging.getLogger("trainer")


def restart_engine(trainer) -> None:
    """Kill the trainer's engine, start a new one and re-sync it to the policy version."""
    for part, end in ((trainer.engine, "kill"), (getattr(trainer, "sender", None), "close")):
        if part is None:
            continue
        try:
            getattr(part, end)()
        except Exception as exc:  # the old engine is being replaced whatever state it is in
            log.warning("ending the failed engine's %s: %s", type(part).__name__, exc)
    version = int(trainer.policy_version)
    trainer._build_engine()
    trainer.resync_engine(version)
    reported = trainer.engine.version
    if reported != version:
        raise EngineError(f"the restarted engine reports weight version {reported} after the "
                          f"re-sync, the trainer is at {version}")


def call_with_recovery(trainer, stage: str, call: Callable[[], Any]) -> Any:
    """``call()``, restarting the engine (see the module docstring) when it fails."""
    while True:
        try:
            return call()
        except EngineUnavailableError as exc:
            used = trainer.engine_restarts
            limit = int(trainer.cfg.rollout.engine_max_restarts)
            why = None
            if trainer.cfg.rollout.engine != "embedded":
                why = "an SGLang server is not restarted by the trainer"
            elif getattr(trainer, "world", 1) > 1:
                why = "restarts need a world of 1 (the re-sync gathers across ranks)"
            elif used >= limit:
                why = f"restart budget spent ({used} of rollout.engine_max_restarts={limit})"
            if why is not None:
                raise EngineError(f"engine failed during {stage}: {exc}; not restarting it: "
                                  f"{why}") from exc
            log.error("engine failed during %s: %s; restarting it (%d of %d) and re-syncing "
                      "the weights as version %d", stage, exc, used + 1, limit,
                      trainer.policy_version)
            trainer.engine_restarts = used + 1
            restart_engine(trainer)
