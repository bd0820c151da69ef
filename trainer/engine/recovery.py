"""Engine restarts: an engine that missed a deadline or died is replaced and re-synced, on
one rank or many.

    batch = call_with_recovery(trainer, "rollout", lambda: trainer.driver.generate(...))
    stats = call_with_recovery(trainer, "weight sync", trainer.sync_weights, collective=True)

``call_with_recovery`` runs a call that talks to the engine. ``EngineUnavailableError`` (a
missed deadline, a dead process, a closed pipe; the engine's own exceptions are not retried)
is caught, and so is (world 1 only, see below) a ``WeightSyncError`` while the engine
process is dead or stopped (the transfer timed out because the engine did); then every rank
takes part in the same steps:

1. Agreement: each rank contributes a success flag (``trainer.utils.collectives``: an all-reduce MIN
   of one number); when any rank failed, the failures' messages are all-gathered, so
   every rank knows which ranks failed and why.
2. Budget: restarting the failed engines must stay within ``rollout.engine_max_restarts``
   (engines restarted in the whole run, all ranks counted); otherwise every rank raises the
   same ``EngineError`` naming the rank(s), the stage and the cause.
3. Restart: each failed rank kills its engine and builds a new one and its weight sender
   (``_build_engine``); the rollout drivers are kept, now serving the new engine.
4. Re-sync, by all ranks (it gathers FSDP shards, a collective): a rank-local call (a
   rollout's or an eval's generate) is followed by ``resync_engine`` at the current policy
   version on every rank, then every engine's version is checked, then the failed ranks run
   the call again while the others keep their result. A ``collective`` call (the weight
   sync) is itself the re-sync: every rank rolls its policy version back to where the call
   started and runs it again, then every engine's version is checked.

A failure inside a re-sync is recovered the same way (it is a collective call), within the
same budget.

Design choices:

* Healthy engines are re-sent the weights too: the gathers need every rank, and re-sending a
  version an engine already holds is accepted (only older versions are refused).
* The agreement costs one all-reduce of one number per engine call of a step; messages
  travel only when something failed.
* SGLang servers are not ours to restart: their failures stop the run (on every rank).
* An engine that stops during the weight transfer itself is restarted in a world of 1 only.
  With more ranks the transfer's gathers run as the sender writes; a rank whose transfer
  failed part-way has left the others inside a gather it cannot rejoin, so it stops with an
  ``EngineError`` saying so (torchrun then ends the others).
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch.distributed as dist

from ipc import WeightSyncError
from trainer.utils.collectives import all_ranks_ok, failures_by_rank
from trainer.engine.embedded.client import EngineError, EngineUnavailableError

log = logging.getLogger("trainer")


def _multi_rank(trainer) -> bool:
    return int(getattr(trainer, "world", 1)) > 1 and dist.is_available() \
        and dist.is_initialized()


def agree_on_failures(trainer, failure: BaseException | None) -> dict[int, str]:
    """{rank: message} of every rank whose engine call failed, the same on every rank;
    every rank calls this together (one all-reduce; an all-gather when something failed)."""
    message = None if failure is None else str(failure)
    if not _multi_rank(trainer):
        return {} if message is None else {int(getattr(trainer, "rank", 0)): message}
    if all_ranks_ok(message is None):
        return {}
    return failures_by_rank(message)


def engine_down_behind(trainer, exc: WeightSyncError) -> EngineUnavailableError | None:
    """The failure of a weight sync whose engine process is dead or stopped, as an engine
    failure to restart (world 1; more ranks: an EngineError, see the module docstring);
    None when the engine looks alive (the sync's own error stands)."""
    down = getattr(trainer.engine, "down", None)
    state = down() if callable(down) else None
    if state is None:
        return None
    cause = (f"engine process {trainer.engine.pid} is {state}; the weight transfer failed: "
             f"{str(exc).splitlines()[-1].strip(' -')}")
    if _multi_rank(trainer):
        raise EngineError(f"engine failed during weight sync on rank {trainer.rank}: {cause}; "
                          "not restarting it: the transfer stopped part-way through the ranks' "
                          "gathers") from exc
    return EngineUnavailableError(cause)


def describe(stage: str, failed: dict[int, str]) -> str:
    return "; ".join(f"engine failed during {stage} on rank {rank}: {text}"
                     for rank, text in sorted(failed.items()))


def refusal(trainer, failed: dict[int, str]) -> str | None:
    """Why the failed engines are not restarted, or None (the same answer on every rank)."""
    if trainer.cfg.rollout.engine != "embedded":
        return "an SGLang server is not restarted by the trainer"
    used, limit = int(trainer.engine_restarts), int(trainer.cfg.rollout.engine_max_restarts)
    if used >= limit:
        return f"restart budget spent ({used} of rollout.engine_max_restarts={limit})"
    if used + len(failed) > limit:
        return (f"restarting {len(failed)} engines would exceed the budget ({used} of "
                f"rollout.engine_max_restarts={limit} used)")
    return None


def replace_engine(trainer) -> None:
    """Kill this rank's engine and weight sender and build new ones (no re-sync here)."""
    for part, end in ((trainer.engine, "kill"), (getattr(trainer, "sender", None), "close")):
        if part is None:
            continue
        try:
            getattr(part, end)()
        except Exception as exc:  # the old engine is being replaced whatever state it is in
            log.warning("ending the failed engine's %s: %s", type(part).__name__, exc)
    drivers = {name: getattr(trainer, name) for name in ("driver", "eval_driver")
               if getattr(trainer, name, None) is not None}
    trainer._build_engine()
    # The rollout drivers stay, serving the new engine: their seeds (an eval over several
    # seeds sets its own) and last rollout's statistics (the step's metrics, whose keys every
    # rank must have alike for the all-reduce) are kept.
    for name, driver in drivers.items():
        driver.engines = [trainer.engine]
        setattr(trainer, name, driver)


def check_engine_version(trainer) -> None:
    reported = trainer.engine.version
    if reported != trainer.policy_version:
        raise EngineError(f"the engine of rank {getattr(trainer, 'rank', 0)} reports weight "
                          f"version {reported} after the re-sync, the trainer is at "
                          f"{trainer.policy_version}")


def resync_all(trainer, stage: str) -> None:
    """Every rank re-sends its weights as the current policy version and checks its engine's
    version (a collective call, recovered like any other)."""
    version = int(trainer.policy_version)

    def resync() -> None:
        trainer.resync_engine(version)
        check_engine_version(trainer)
    call_with_recovery(trainer, f"{stage} (re-sync)", resync, collective=True)


def call_with_recovery(trainer, stage: str, call: Callable[[], Any], *,
                       collective: bool = False) -> Any:
    """``call()``, restarting failed engines (see the module docstring); every rank calls
    this together. ``collective``: the call itself takes part in collectives (so every rank
    runs it again after a restart) and is a re-sync (so no separate one is needed)."""
    version_at_start = trainer.policy_version
    rank = int(getattr(trainer, "rank", 0))
    result, pending, restarted = None, True, False
    while True:
        failure = None
        if pending:
            try:
                result = call()
                if collective and restarted:
                    check_engine_version(trainer)
                pending = False
            except EngineUnavailableError as exc:
                failure = exc
            except WeightSyncError as exc:
                failure = engine_down_behind(trainer, exc)
                if failure is None:
                    raise
        failed = agree_on_failures(trainer, failure)
        if not failed:
            return result
        why = refusal(trainer, failed)
        if why is not None:
            raise EngineError(f"{describe(stage, failed)}; not restarting it: {why}") from failure
        used, limit = int(trainer.engine_restarts), int(trainer.cfg.rollout.engine_max_restarts)
        trainer.engine_restarts = used + len(failed)
        then = (f"running the {stage} again on every rank from version {version_at_start}"
                if collective else f"re-syncing every rank's engine to version {version_at_start}")
        log.error("%s; restarting the engine of rank(s) %s (restarts %d of %d), then %s",
                  describe(stage, failed), sorted(failed), trainer.engine_restarts, limit, then)
        if rank in failed:
            replace_engine(trainer)
        restarted = True
        if collective:
            trainer.policy_version = version_at_start  # the call runs again from its start
            pending = True
        else:
            resync_all(trainer, stage)
            pending = rank in failed
