"""The stock path's verification policy (trainer/engine/sglang/verify.py): which tensors a sync
hashes, and the bounds its docstring promises."""
import math

import pytest

from trainer.engine.sglang.verify import VerifyPolicy

# a model's served tensors in send order: (name, bytes); odd sizes, one large tensor
MODEL = [(f"t{k}", size) for k, size in enumerate([700, 64, 5000, 1300, 64, 2900, 640, 11])]
TOTAL = sum(size for _, size in MODEL)
LARGEST = max(size for _, size in MODEL)


def _sync(policy, version, model=MODEL):
    check = policy.start(version)
    picked = [name for name, size in model if check.wants(name, size)]
    check.finish()
    return check, picked


def test_first_sync_and_the_sync_after_a_checkpoint_hash_every_tensor():
    policy = VerifyPolicy(budget_bytes=1000)
    check, picked = _sync(policy, 1)
    assert check.full and picked == [n for n, _ in MODEL]
    assert not _sync(policy, 2)[0].full
    policy.request_full()
    check, picked = _sync(policy, 3)
    assert check.full and len(picked) == len(MODEL)
    assert not _sync(policy, 4)[0].full


def test_sampled_syncs_stay_within_budget_and_cover_every_tensor_in_ceil_total_over_budget():
    budget = 1000
    policy = VerifyPolicy(budget_bytes=budget)
    _sync(policy, 0)
    rounds = math.ceil(TOTAL / budget)
    for start in range(3):  # any window of `rounds` consecutive sampled syncs covers all
        seen, sizes = set(), []
        probe = VerifyPolicy(budget_bytes=budget)
        probe.model_bytes, probe.cursor, probe._full_requested = TOTAL, start * budget % TOTAL, False
        for v in range(rounds):
            check, picked = _sync(probe, v)
            assert not check.full
            seen.update(picked)
            sizes.append(check.hashed_bytes)
        assert seen == {n for n, _ in MODEL}
        assert max(sizes) <= budget + 2 * LARGEST
    # and the rotation really moves: two consecutive sampled syncs pick different tensors
    assert _sync(policy, 1)[1] != _sync(policy, 2)[1]


def test_a_changed_payload_is_verified_whole_next_and_budget_zero_hashes_everything():
    policy = VerifyPolicy(budget_bytes=1000)
    _sync(policy, 0)
    _sync(policy, 1)
    bigger = MODEL + [("extra", 4000)]
    check, _ = _sync(policy, 2, bigger)
    assert not check.full and policy.model_bytes == TOTAL + 4000 and policy.cursor == 0
    check, picked = _sync(policy, 3, bigger)  # that layout was never verified whole
    assert check.full and len(picked) == len(bigger)
    every = VerifyPolicy(budget_bytes=0)
    for v in range(3):
        assert _sync(every, v)[1] == [n for n, _ in MODEL]


def test_full_every_hashes_everything_periodically():
    policy = VerifyPolicy(budget_bytes=1000, full_every=3)
    fulls = [_sync(policy, v)[0].full for v in range(7)]
    assert fulls == [True, False, True, False, False, True, False]


def test_a_failed_sync_does_not_move_the_window():
    policy = VerifyPolicy(budget_bytes=1000)
    _sync(policy, 0)
    check = policy.start(1)
    first = [n for n, s in MODEL if check.wants(n, s)]
    # no finish(): the sync failed; the retry hashes the same window
    assert _sync(policy, 1)[1] == first


def test_bad_settings_are_refused_in_one_error():
    with pytest.raises(ValueError, match="budget_bytes.*full_every"):
        VerifyPolicy(budget_bytes=-1, full_every=True)
