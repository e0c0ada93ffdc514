"""The fault model of launch/planning/sim/faults.py against hand-worked values, and its closed form against a
seeded Monte Carlo draw of the same failures."""

from __future__ import annotations

import math

import pytest

from launch.planning.sim.faults import (
    LLAMA3_GPU_MTBF_H,
    FaultModel,
    compare,
    monte_carlo_useful_share,
    server_down_share,
    useful_share,
)

HOUR = 3600.0


def test_llama3_rate_per_gpu():
    # 419 unexpected interruptions in 54 days on 16,384 GPUs: one per ~3.1 h for the job
    assert LLAMA3_GPU_MTBF_H == pytest.approx(50_677, abs=1)
    assert LLAMA3_GPU_MTBF_H / 16_384 == pytest.approx(3.09, abs=0.01)


def test_useful_share_by_hand():
    # rate ln2 per checkpoint interval: P(run survives a whole interval) q = 1/2, so a run keeps on
    # average tau * q / (1 - q) = tau of the 1 / rate = tau / ln2 it runs
    rate = math.log(2) / HOUR
    assert useful_share(rate, 0.0, HOUR) == pytest.approx(math.log(2))
    # plus a downtime as long as the mean run: half of it again
    assert useful_share(rate, HOUR / math.log(2), HOUR) == pytest.approx(math.log(2) / 2)
    assert useful_share(0.0, 600.0, HOUR) == 1.0


def test_useful_share_small_rate_loses_half_an_interval_plus_downtime():
    rate = 1e-6  # per second
    # first order; the rest is of order (rate * 1500 s)^2 = 2.3e-6
    assert useful_share(rate, 1000.0, 1000.0) == pytest.approx(1 - rate * (500 + 1000), abs=5e-6)


@pytest.mark.parametrize("rate_per_h,down_s,checkpoint_s", [(0.5, 900.0, 2700.0), (2.0, 300.0, 600.0)])
def test_closed_form_matches_monte_carlo(rate_per_h, down_s, checkpoint_s):
    rate = rate_per_h / HOUR
    exact = useful_share(rate, down_s, checkpoint_s)
    drawn = monte_carlo_useful_share(rate, down_s, checkpoint_s, horizon_s=20_000 / rate, seed=0)
    assert drawn == pytest.approx(exact, rel=0.02)


def test_server_down_share_by_hand():
    # one failure per GPU-hour, all restartable, 360 s to restart: down 0.1 h per 1 h up
    m = FaultModel(gpu_mtbf_h=1.0, restartable_share=1.0, server_restart_s=360.0)
    assert server_down_share(m, gpus_per_server=1, gpus_per_node=8) == pytest.approx(0.1 / 1.1)
    # all hardware: any of the node's 8 GPUs takes the server out for node_replace_s = 0.05 h
    m = FaultModel(gpu_mtbf_h=1.0, restartable_share=0.0, node_replace_s=180.0)
    assert server_down_share(m, gpus_per_server=1, gpus_per_node=8) == pytest.approx(0.4 / 1.4)


def test_compare_by_hand():
    # 3 rollout + 1 trainer GPU, each failing at ln2 / (4 h): the job fails at ln2 per hour (one
    # checkpoint interval), the trainer alone at a quarter of that; restarts cost nothing
    m = FaultModel(
        gpu_mtbf_h=4 / math.log(2),
        restartable_share=1.0,
        server_restart_s=0.0,
        requeue_wait_s=0.0,
        startup_s=0.0,
        checkpoint_interval_s=HOUR,
    )
    o = compare(
        m,
        rollout_gpus=3,
        trainer_gpus=1,
        gpus_per_server=1,
        gpus_per_node=4,
        tokens_per_s=1000.0,
        step_s=36.0,
    )
    q = 2**-0.25
    assert o.useful_requeue == pytest.approx(math.log(2))
    assert o.useful_healing == pytest.approx(math.log(2) / 4 * q / (1 - q))  # 0.9158
    assert o.tokens_per_s_requeue == pytest.approx(693.1, abs=0.1)
    assert o.tokens_per_s_healing == pytest.approx(915.8, abs=0.1)
    assert o.steps_per_h_requeue == pytest.approx(100 * math.log(2))
    assert o.job_interruptions_per_day_requeue == pytest.approx(24 * math.log(2))
    assert o.server_restarts_per_day == pytest.approx(18 * math.log(2))
    assert o.node_losses_per_day == 0.0 and o.servers_down_mean == 0.0


def test_bad_fault_model_names_the_key():
    with pytest.raises(ValueError, match="restartable_share"):
        FaultModel(restartable_share=1.5)
    with pytest.raises(ValueError, match="gpu_mtbf_h"):
        FaultModel(gpu_mtbf_h=0)
