"""What a stock-path sync (``/update_weights_from_tensor`` + SGLang's checker) verifies, at a
bounded cost per step.

SGLang's ``/update_weights_from_tensor_checker`` hashes, on the server's host, exactly the
tensors named in the request (SHA-256 of dtype, shape and bytes), and the trainer hashes the same
ones on its host. Hashing every tensor costs a full host read of the model on both sides, each
step. The policy instead picks, per sync, which served tensors go into the checker request:

- **full** (every tensor): the first sync of a policy (the trainer's connect, a resume), the
  sync after ``request_full()`` (the loop calls it when it saves a checkpoint, so the weights a
  checkpoint stands for were verified whole on the server), the sync after a sampled one whose
  payload's size differed from the last (a layout never verified whole), and every ``full_every``-th sync
  when that is set;
- **sampled** (every other sync): a window of ``budget_bytes`` of the model, in send order,
  that rotates by ``budget_bytes`` each sync: the tensors whose bytes overlap the window are
  hashed whole (SGLang's checker hashes whole tensors).

Guarantee, beside its cost (``B`` = budget, ``T`` = the model's bytes, ``L`` = its largest tensor):
- a full sync detects any wrong byte, any tensor left unwritten or mis-named, on the server;
  a systematic fault (name mapping, packing, dtype, a dropped tensor) is therefore caught at
  the first sync, before the first rollout;
- a sampled sync hashes at most ``B + 2 L`` bytes per side, and every tensor is hashed at least
  once in any ``ceil(T / B)`` consecutive sampled syncs: a fault that persists (a tensor the
  server keeps stale) is caught within that many steps; a fault confined to one sync is caught
  when it falls in that sync's window (about ``B / T`` of the bytes);
- a sampled sync does not see a wrong byte outside its window; a tensor of the wrong shape
  still fails the update itself (SGLang's in-place loader compares shapes).
The extension's transport (trainer/engine/sglang/transport.py) verifies every byte of every
sync with the on-device checksum instead; this policy is for servers without the extension.

Use (trainer/engine/sglang/sync.py):

    check = policy.start(version)                 # one per sync
    ... for each served tensor, in send order:
        if check.wants(name, nbytes): digests[name] = tensor_sha256(tensor)
    check.finish()                                # the window moves on only after a success
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SyncCheck:
    """One sync's choice: ``wants(name, nbytes)`` in send order."""

    full: bool
    window: tuple[int, int]      # [start, start + budget) in bytes, modulo the model's size
    model_bytes: int             # the model's size as of the last sync (0: unknown yet)
    offset: int = 0
    hashed_bytes: int = 0
    hashed: list[str] = field(default_factory=list)
    _policy: "VerifyPolicy | None" = None

    def wants(self, name: str, nbytes: int) -> bool:
        first, self.offset = self.offset, self.offset + int(nbytes)
        take = self.full or _overlaps(first, int(nbytes), self.window, self.model_bytes)
        if take:
            self.hashed.append(name)
            self.hashed_bytes += int(nbytes)
        return take

    def finish(self) -> None:
        """The sync was verified: record the model's size and move the window on."""
        if self._policy is not None:
            self._policy._finished(self)


def _overlaps(first: int, nbytes: int, window: tuple[int, int], total: int) -> bool:
    """Whether bytes [first, first + nbytes) meet the cyclic window of a ``total``-byte model."""
    start, size = window
    if total <= 0 or size >= total:
        return True
    end = start + size
    for lo, hi in ((start, min(end, total)), (0, end - total)):  # the window, split at wrap
        if hi > lo and first < hi and lo < first + max(nbytes, 1):
            return True
    return False


class VerifyPolicy:
    """Which served tensors each stock-path sync hashes (module docstring).

    Args:
        budget_bytes: bytes of tensors a sampled sync hashes per side (before rounding up to
            whole tensors); 0 hashes everything every sync (the old behaviour). The default
            keeps a sampled sync of Qwen-Image (largest tensor 75 MB in bf16) under about
            0.3 GB hashed per side, and covers its 41 GB in about 300 syncs.
        full_every: also hash everything every this many syncs (0: only at the first sync and
            after ``request_full``).
    """

    def __init__(self, budget_bytes: int = 128 << 20, full_every: int = 0) -> None:
        problems = []
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            problems.append(f"budget_bytes must be an int >= 0, got {budget_bytes!r}")
        if isinstance(full_every, bool) or not isinstance(full_every, int) or full_every < 0:
            problems.append(f"full_every must be an int >= 0, got {full_every!r}")
        if problems:
            raise ValueError("VerifyPolicy: " + "; ".join(problems))
        self.budget_bytes = budget_bytes
        self.full_every = full_every
        self.model_bytes = 0
        self.cursor = 0
        self.syncs = 0
        self._full_requested = True  # the first sync verifies everything

    def request_full(self) -> None:
        """The next sync hashes every tensor (call it when a checkpoint is saved)."""
        self._full_requested = True

    def start(self, version: int) -> SyncCheck:
        full = (self._full_requested or self.budget_bytes == 0 or self.model_bytes == 0
                or (self.full_every and (self.syncs + 1) % self.full_every == 0))
        return SyncCheck(full=bool(full), window=(self.cursor, self.budget_bytes),
                         model_bytes=self.model_bytes, _policy=self)

    def _finished(self, check: SyncCheck) -> None:
        self.syncs += 1
        changed = check.offset != self.model_bytes
        if changed:  # first sync, or a payload of another size: its windows start over
            self.model_bytes, self.cursor = check.offset, 0
        if check.full:
            self._full_requested = False
        elif changed:  # a layout never verified whole: the next sync is full
            self._full_requested = True
        elif self.model_bytes:
            self.cursor = (self.cursor + self.budget_bytes) % self.model_bytes
