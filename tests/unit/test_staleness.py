"""The admission rule a < (eta + v + 1) * B, the freshness check, and thread safety."""

import threading

import pytest

from areal_jobs.staleness import StalenessManager, is_fresh, may_push


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


# ------------------------------------------------------------------ algo.exact_delay


def test_exact_delay_target_ramps_then_lags_by_d():
    from areal_jobs.staleness import exact_delay_target

    assert [exact_delay_target(v, 3) for v in range(7)] == [0, 0, 0, 0, 1, 2, 3]
    assert [exact_delay_target(v, 0) for v in range(3)] == [0, 1, 2]


def test_exact_delay_batch_takes_only_groups_old_enough():
    from areal_jobs.staleness import exact_delay_batch

    # trainer at 5, d = 2: version 3's groups; a version-4 group waits for the next step
    assert exact_delay_batch([4, 3, 3], 5, 2, 2) == [1, 2]
    assert exact_delay_batch([4, 3, 4], 5, 2, 2) is None
    assert exact_delay_batch([0, 0, 0], 1, 4, 3) == [0, 1, 2]  # the ramp: version 0's


def simulate(delay, batch, max_running, versions, seed, gate=True):
    """Admission (the real StalenessManager) and a trainer taking exact_delay_batch and publishing
    under exact_delay_may_publish, groups finishing in random order after random times. Returns
    (the versions of each trained batch, groups whose generation straddled an update); the
    batches stop short when no batch can ever be taken (a deadlock)."""
    import random

    from areal_jobs.staleness import exact_delay_batch, exact_delay_may_publish

    rng = random.Random(seed)
    mgr = StalenessManager(batch, delay, max_running)
    version, trained_this_version = 0, False
    in_flight: list[list] = []  # [admitted version, ticks left, straddled]
    inbox: list[tuple[int, bool]] = []  # (version, straddled)
    batches, straddled = [], 0
    for _ in range(200_000):
        if len(batches) == versions:
            return batches, straddled
        action = rng.random()
        if action < 0.4 and mgr.try_admit(version):
            in_flight.append([version, rng.randint(1, 6), False])
        elif action < 0.8 and in_flight:
            g = rng.choice(in_flight)
            g[1] -= 1
            if g[1] <= 0:
                in_flight.remove(g)
                mgr.on_accepted()
                inbox.append((g[0], g[2]))
        elif not trained_this_version:
            picked = exact_delay_batch([v for v, _ in inbox], version, delay, batch)
            if picked is not None:
                batches.append(sorted(inbox[i][0] for i in picked))
                straddled += sum(inbox[i][1] for i in picked)
                inbox = [g for i, g in enumerate(inbox) if i not in set(picked)]
                trained_this_version = True
        elif not gate or exact_delay_may_publish(len(inbox), delay, batch):
            version, trained_this_version = version + 1, False
            for g in in_flight:  # an update while a group generates: its tokens span versions
                g[2] = True
    return batches, straddled


@pytest.mark.parametrize("delay", [0, 1, 2, 5])
@pytest.mark.parametrize("batch, max_running", [(1, 1), (3, 2), (3, 100)])
def test_exact_delay_trains_every_batch_exactly_d_versions_late(delay, batch, max_running):
    """Whatever the finishing order and the concurrency: batch v is version max(0, v - d)'s,
    nothing straddles an update, and the queue never deadlocks."""
    for seed in range(3):
        batches, straddled = simulate(delay, batch, max_running, versions=40, seed=seed)
        assert len(batches) == 40 and straddled == 0
        for v, versions in enumerate(batches):
            assert versions == [max(0, v - delay)] * batch, (v, versions)


def test_without_the_publish_gate_samples_straddle_updates_or_the_queue_starves():
    """The gate is what makes the queue work: publishing as soon as a batch is trained updates the
    servers while groups of the current version still generate (they straddle versions), and
    slots of a version go to groups admitted later, so its batch never fills (a deadlock)."""
    runs = [simulate(2, 3, 100, versions=40, seed=s, gate=False) for s in range(3)]
    assert any(straddled > 0 or len(batches) < 40 for batches, straddled in runs)


def test_a_lowered_bound_holds_admission_until_the_trainer_has_consumed_the_surplus():
    """algo.max_staleness=auto moves the bound: nothing admitted is taken back."""
    b = 2
    mgr = StalenessManager(batch_size=b, max_staleness=4, max_running=100)
    assert admit_all(mgr, 0) == 5 * b
    for _ in range(5 * b):
        mgr.on_accepted()
    mgr.set_bound(1)
    # 10 groups admitted under 4; under 1 the next one waits for (1 + v + 1) * B > 10: version 4,
    # and is trained 1 version later (position 10: the trainer's version 5)
    assert [admit_all(mgr, v) for v in range(1, 4)] == [0, 0, 0]
    assert admit_all(mgr, 4) == b
    mgr.set_bound(3)
    assert admit_all(mgr, 4) == 2 * b  # a raise admits at once: (3 + 4 + 1) * B - 12
    with pytest.raises(ValueError):
        mgr.set_bound(-1)
