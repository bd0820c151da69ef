"""Engine restarts: an engine that missed a deadline or died is replaced and re-synced, on
one rank or many.

    batch = call_with_recovery(rollouts, "rollout", lambda: driver.generate(...),
                               resync=resync_engine)
    stats = call_with_recovery(rollouts, "weight sync", sync_weights, resync=resync_engine,
                               collective=True)

``rollouts`` is the rank's ``trainer.rollout.service.RolloutService`` (engine, sender, drivers,
policy version, restart budget); ``resync(version)`` re-sends the actor's weights to the
engine as that policy version (the loop's ``resync_engine``).

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
3. Restart: each failed rank's service kills its engine and starts a new one and its weight
   sender (``RolloutService.restart``); the rollout drivers are kept, now serving the new engine.
4. Re-sync, by all ranks (it gathers FSDP shards, a collective): a rank-local call (a
   rollout's or an eval's generate) is followed by ``resync`` at the current policy
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
from typing import TYPE_CHECKING, Any, Callable

import torch.distributed as dist

from ipc import WeightSyncError
from trainer.utils.collectives import all_ranks_ok, failures_by_rank
from trainer.engine.embedded.client import EngineError, EngineUnavailableError

if TYPE_CHECKING:
    from trainer.rollout.service import RolloutService

log = logging.getLogger("trainer")


def _multi_rank(rollouts: RolloutService) -> bool:
    return int(rollouts.world) > 1 and dist.is_available() and dist.is_initialized()


def agree_on_failures(rollouts: RolloutService, failure: BaseException | None) -> dict[int, str]:
    """{rank: message} of every rank whose engine call failed, the same on every rank;
    every rank calls this together (one all-reduce; an all-gather when something failed)."""
    message = None if failure is None else str(failure)
    if not _multi_rank(rollouts):
        return {} if message is None else {int(rollouts.rank): message}
    if all_ranks_ok(message is None):
        return {}
    return failures_by_rank(message)


def engine_down_behind(rollouts: RolloutService,
                       exc: WeightSyncError) -> EngineUnavailableError | None:
    """The failure of a weight sync whose engine process is dead or stopped, as an engine
    failure to restart (world 1; more ranks: an EngineError, see the module docstring);
    None when the engine looks alive (the sync's own error stands)."""
    down = getattr(rollouts.engine, "down", None)
    state = down() if callable(down) else None
    if state is None:
        return None
    cause = (f"engine process {rollouts.engine.pid} is {state}; the weight transfer failed: "
             f"{str(exc).splitlines()[-1].strip(' -')}")
    if _multi_rank(rollouts):
        raise EngineError(f"engine failed during weight sync on rank {rollouts.rank}: {cause}; "
                          "not restarting it: the transfer stopped part-way through the ranks' "
                          "gathers") from exc
    return EngineUnavailableError(cause)


def describe(stage: str, failed: dict[int, str]) -> str:
    return "; ".join(f"engine failed during {stage} on rank {rank}: {text}"
                     for rank, text in sorted(failed.items()))


def refusal(rollouts: RolloutService, failed: dict[int, str]) -> str | None:
    """Why the failed engines are not restarted, or None (the same answer on every rank)."""
    if not rollouts.restartable:
        return "an SGLang server is not restarted by the trainer"
    used, limit = int(rollouts.restarts), int(rollouts.max_restarts)
    if used >= limit:
        return f"restart budget spent ({used} of rollout.engine_max_restarts={limit})"
    if used + len(failed) > limit:
        return (f"restarting {len(failed)} engines would exceed the budget ({used} of "
                f"rollout.engine_max_restarts={limit} used)")
    return None


def check_engine_version(rollouts: RolloutService) -> None:
    reported = rollouts.engine.version
    if reported != rollouts.policy_version:
        raise EngineError(f"the engine of rank {rollouts.rank} reports weight "
                          f"version {reported} after the re-sync, the trainer is at "
                          f"{rollouts.policy_version}")


def resync_all(rollouts: RolloutService, stage: str, resync: Callable[[int], None]) -> None:
    """Every rank re-sends its weights as the current policy version and checks its engine's
    version (a collective call, recovered like any other)."""
    version = int(rollouts.policy_version)

    def resync_now() -> None:
        resync(version)
        check_engine_version(rollouts)
    call_with_recovery(rollouts, f"{stage} (re-sync)", resync_now, resync=resync,
                       collective=True)


def call_with_recovery(rollouts: RolloutService, stage: str, call: Callable[[], Any], *,
                       resync: Callable[[int], None], collective: bool = False) -> Any:
    """``call()``, restarting failed engines (see the module docstring); every rank calls
    this together. ``collective``: the call itself takes part in collectives (so every rank
    runs it again after a restart) and is a re-sync (so no separate one is needed)."""
    version_at_start = rollouts.policy_version
    rank = int(rollouts.rank)
    result, pending, restarted = None, True, False
    while True:
        failure = None
        if pending:
            try:
                result = call()
                if collective and restarted:
                    check_engine_version(rollouts)
                pending = False
            except EngineUnavailableError as exc:
                failure = exc
            except WeightSyncError as exc:
                failure = engine_down_behind(rollouts, exc)
                if failure is None:
                    raise
        failed = agree_on_failures(rollouts, failure)
        if not failed:
            return result
        why = refusal(rollouts, failed)
        if why is not None:
            raise EngineError(f"{describe(stage, failed)}; not restarting it: {why}") from failure
        rollouts.restarts += len(failed)
        then = (f"running the {stage} again on every rank from version {version_at_start}"
                if collective else f"re-syncing every rank's engine to version {version_at_start}")
        log.error("%s; restarting the engine of rank(s) %s (restarts %d of %d), then %s",
                  describe(stage, failed), sorted(failed), rollouts.restarts,
                  rollouts.max_restarts, then)
        if rank in failed:
            rollouts.restart()
        restarted = True
        if collective:
            rollouts.policy_version = version_at_start  # the call runs again from its start
            pending = True
        else:
            resync_all(rollouts, stage, resync)
            pending = rank in failed
