"""The admission rule a < (eta + v + 1) * B, the freshness check, and thread safety."""

import threading

import pytest

from areal_jobs.data.staleness import StalenessManager, is_fresh, may_push


def admit_all(mgr: StalenessManager, version: int) -> int:
    n = 0
    while mgr.try_admit(version):
        n += 1
    return n


@pytest.mark.parametrize("eta", [0, 1, 4])
def test_admission_allows_eta_plus_one_batches_ahead(eta):
    b = 3
    mgr = StalenessManager(batch_size=b, max_staleness=eta, max_running=10_000)
    assert admit_all(mgr, version=0) == (eta + 1) * b
    for _ in range((eta + 1) * b):
        mgr.on_accepted()
    assert admit_all(mgr, version=0) == 0  # nothing more until the trainer consumes a batch
    assert admit_all(mgr, version=1) == b  # one version later: exactly one more batch


def test_eta_zero_is_synchronous():
    mgr = StalenessManager(batch_size=4, max_staleness=0, max_running=100)
    for version in range(5):
        assert admit_all(mgr, version) == 4
        for _ in range(4):
            mgr.on_accepted()


def test_concurrency_cap_and_capacity():
    mgr = StalenessManager(batch_size=10, max_staleness=4, max_running=3)
    assert mgr.capacity(0) == 3
    assert admit_all(mgr, 0) == 3
    mgr.on_accepted()
    assert mgr.capacity(0) == 1 and mgr.try_admit(0)


def test_rejected_and_expired_groups_give_their_slot_back():
    mgr = StalenessManager(batch_size=2, max_staleness=0, max_running=10)
    assert admit_all(mgr, 0) == 2
    mgr.on_rejected()
    assert mgr.try_admit(0)
    mgr.on_accepted()
    mgr.on_accepted()
    assert not mgr.try_admit(0)
    mgr.on_expired()
    assert mgr.try_admit(0)
    assert mgr.state.rejected == 2


def test_counter_misuse_raises():
    mgr = StalenessManager(batch_size=1, max_staleness=0, max_running=1)
    with pytest.raises(RuntimeError):
        mgr.on_accepted()
    with pytest.raises(RuntimeError):
        mgr.on_expired()
    with pytest.raises(ValueError):
        StalenessManager(batch_size=0, max_staleness=0, max_running=1)


def test_state_dict_round_trip():
    mgr = StalenessManager(batch_size=2, max_staleness=1, max_running=8)
    admit_all(mgr, 0)
    mgr.on_accepted()
    other = StalenessManager(batch_size=2, max_staleness=1, max_running=8)
    other.load_state_dict(mgr.state_dict())
    assert other.state == mgr.state
    assert admit_all(other, 0) == admit_all(mgr, 0)


def test_is_fresh_boundary():
    assert is_fresh(oldest_version=6, trainer_version=10, max_staleness=4)
    assert not is_fresh(oldest_version=5, trainer_version=10, max_staleness=4)
    assert is_fresh(3, 3, 0) and not is_fresh(2, 3, 0)


def test_thread_safety_never_over_admits():
    b, eta = 5, 2
    mgr = StalenessManager(batch_size=b, max_staleness=eta, max_running=1000)
    admitted = []
    barrier = threading.Barrier(8)

    def worker():
        barrier.wait(timeout=10)
        count = 0
        for _ in range(200):
            if mgr.try_admit(0):
                count += 1
        admitted.append(count)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sum(admitted) == (eta + 1) * b
    assert mgr.state.running == (eta + 1) * b


def test_may_push_worked_example_from_the_docstring():
    # B = 2, trainer at version 5, a long answer in flight that must train by version 6
    assert may_push(9, version=5, unacked=2, in_flight_deadlines=[6], batch_size=2)
    assert not may_push(9, version=5, unacked=3, in_flight_deadlines=[6], batch_size=2)


def test_may_push_earliest_deadline_always_goes():
    # nothing in flight is due before it: the hold can never block the group everyone waits for
    assert may_push(6, version=5, unacked=50, in_flight_deadlines=[6, 7, 9], batch_size=2)


def test_may_push_ignores_groups_past_their_deadline():
    # deadline 4 < version 5: that group expires whatever we do, so it holds nothing back
    assert may_push(9, version=5, unacked=3, in_flight_deadlines=[4], batch_size=2)


def test_may_push_counts_every_earlier_in_flight_group():
    # two groups due at version 5 need both slots of batch 5: no other group may take one
    assert not may_push(8, version=5, unacked=0, in_flight_deadlines=[5, 5], batch_size=2)
    assert may_push(8, version=5, unacked=0, in_flight_deadlines=[5], batch_size=2)
    # with a later deadline for one of them, batch 6 has room too: 0 + 1 + 2 <= 4
    assert may_push(8, version=5, unacked=0, in_flight_deadlines=[5, 6], batch_size=2)


def test_may_push_with_eta_zero_changes_nothing():
    # synchronous: every group is due at the version it was admitted under
    assert may_push(3, version=3, unacked=1, in_flight_deadlines=[3, 3], batch_size=4)
